"""Token ids of a conversation in the target's own chat template, and the loss mask over them.

The prompt is rendered with the generation prompt (what the target saw when it wrote the response) and the
response ids are appended unchanged: re-tokenising decoded text could split tokens differently from what the
target generated, and the drafter must learn the target's own token stream.
"""

from __future__ import annotations

from typing import Any


def prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Ids of `messages` (ending with a user turn) in the tokenizer's chat template, generation prompt added."""
    return prompt_ids_many(tokenizer, [messages])[0]


def prompt_ids_many(tokenizer: Any, conversations: list[list[dict]], template_kwargs: dict[str, Any] | None = None,
                    names: list[str] | None = None) -> list[list[int]]:
    """prompt_ids of many conversations: each rendered by the chat template, then all tokenised in one batch call.

    That is what `apply_chat_template(tokenize=True)` does one conversation at a time (render, then tokenise
    without adding special tokens); batching lets a fast tokenizer use every core, which matters for the tens of
    thousands of multi-turn prompts of a data stage. template_kwargs: the template's options (enable_thinking...).
    names: what to call each conversation in an error (a prompt id); its index without them.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")

    def problem(i: int, what: str) -> ValueError:
        name = names[i] if names is not None else f"#{i}"
        roles = [m.get("role") for m in conversations[i]]
        return ValueError(f"conversation {name} (roles {roles}): {what}")

    for i, messages in enumerate(conversations):
        if not messages or messages[-1].get("role") != "user":
            raise problem(i, "messages must end with a user turn")
    texts = []
    for i, messages in enumerate(conversations):
        try:
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                       **(template_kwargs or {})))
        except Exception as err:  # noqa: BLE001 - a template's own error (jinja), named with its conversation
            raise problem(i, f"the chat template refused it ({type(err).__name__}: {err})") from err
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    result = []
    for ids in encoded:
        ids = list(ids)
        if not ids or not isinstance(ids[0], int):  # a fast tokenizer's rows are uniform: the first id tells
            raise ValueError(f"chat template produced no flat list of token ids: {ids[:8]!r}")
        result.append(ids)
    return result


def encode_conversation(tokenizer: Any, messages: list[dict], response_ids: list[int] | None,
                        prompt: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): templated prompt + response ids; the mask is 1 exactly on the response.

    The response keeps its end-of-turn/eos token when it has one, so the drafter learns to end turns.
    With response_ids None only the prompt is returned (mask all 0). `prompt`: the prompt ids when already
    computed (prompt_ids_many), else they are computed here.
    """
    ids = list(prompt) if prompt is not None else prompt_ids(tokenizer, messages)
    response = [int(t) for t in (response_ids or [])]
    return ids + response, [0] * len(ids) + [1] * len(response)
