"""Token ids of a conversation in the target's own chat template, and the loss mask over them.

The prompt is rendered with the generation prompt (what the target saw when it wrote the response) and the
response ids are appended unchanged: re-tokenising decoded text could split tokens differently from what the
target generated, and the drafter must learn the target's own token stream.
"""

from __future__ import annotations

from typing import Any


def prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Ids of `messages` (ending with a user turn) in the tokenizer's chat template, generation prompt added."""
    if not messages or messages[-1].get("role") != "user":
        raise ValueError(f"messages must end with a user turn, got roles {[m.get('role') for m in messages]}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    # return_dict=True gives the same BatchEncoding on every transformers 5.x (the plain return type changed).
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = list(encoded["input_ids"])
    if not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"chat template produced no flat list of token ids: {ids[:8]!r}")
    return ids


def encode_conversation(tokenizer: Any, messages: list[dict],
                        response_ids: list[int] | None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): templated prompt + response ids; the mask is 1 exactly on the response.

    The response keeps its end-of-turn/eos token when it has one, so the drafter learns to end turns.
    With response_ids None only the prompt is returned (mask all 0).
    """
    ids = prompt_ids(tokenizer, messages)
    response = [int(t) for t in (response_ids or [])]
    return ids + response, [0] * len(ids) + [1] * len(response)
