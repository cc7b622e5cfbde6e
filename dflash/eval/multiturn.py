"""Second-turn prompts: the next user turn of a multi-turn benchmark, asked on top of the target's own first answer.

MT-Bench's turn 2 ("now rewrite your answer as ...") refers to the answer of turn 1, and a serving engine sees the
conversation [user turn 1, assistant = the model's own answer, user turn 2]. So the target answers turn 1 greedily
(the continuation the replay measures, `greedy_continuations`), the answer is decoded to text as a chat client would
store it, and the chat template renders the three messages; acceptance is then measured on the turn-2 continuation.
"""

from __future__ import annotations

from typing import Any

from dflash.data.prompts import Prompt
from dflash.eval.replay import greedy_continuations


def answer_text(adapter, continuation: list[int]) -> str:
    """The assistant text of a generated continuation: the final stop token dropped, special tokens skipped."""
    if continuation and continuation[-1] in set(adapter.stop_token_ids()):
        continuation = continuation[:-1]
    return adapter.tokenizer.decode(continuation, skip_special_tokens=True)


def second_turn_conversations(
    adapter,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    template_kwargs: dict[str, Any] | None = None,
    batch_size: int,
) -> list[list[dict]]:
    """Per prompt: its messages + the target's greedy answer (at most `max_new_tokens` tokens) + its first follow-up.

    `template_kwargs` go to the chat template of the first turn (e.g. the thinking flag), as for evaluation.
    """
    missing = [p.id for p in prompts if not p.follow_ups]
    if missing:
        raise ValueError(f"prompts {missing[:5]} have no second user turn (Prompt.follow_ups is empty); "
                         f"turns: 2 needs a multi-turn source such as mtbench")
    kwargs = template_kwargs or {}
    first = [adapter.chat_ids(p.messages, **kwargs) for p in prompts]
    answers = greedy_continuations(adapter, first, max_new_tokens=max_new_tokens,
                                   stop_token_ids=adapter.stop_token_ids(), batch_size=batch_size)
    return [[*p.messages, {"role": "assistant", "content": answer_text(adapter, answer)},
             {"role": "user", "content": p.follow_ups[0]}]
            for p, answer in zip(prompts, answers)]
