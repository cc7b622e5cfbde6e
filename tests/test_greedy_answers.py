"""The target's greedy answers are generated once per prompt and settings: a frozen target answers the same way."""

import torch

from dflash.eval.replay import greedy_continuations
from dflash.models.targets import build_tiny_target
from tests.schema_options import EVAL_BATCH


def test_a_prompt_is_answered_once_per_settings(monkeypatch):
    target = build_tiny_target("llama", seed=0, tokenizer="builtin")
    calls = []
    real = target.model.generate

    def counting(input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        return real(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(target.model, "generate", counting)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7]]
    first = greedy_continuations(target, prompts, max_new_tokens=4, stop_token_ids=[], engine="hf",
                                 batch_size=EVAL_BATCH)
    assert first[0] == first[2] and calls == [2]  # the repeated prompt is generated once
    again = greedy_continuations(target, prompts[:2], max_new_tokens=4, stop_token_ids=[], engine="hf",
                                 batch_size=EVAL_BATCH)
    assert again == first[:2] and calls == [2]  # answered before: nothing generated
    longer = greedy_continuations(target, prompts[:1], max_new_tokens=6, stop_token_ids=[], engine="hf",
                                  batch_size=EVAL_BATCH)
    assert calls == [2, 1] and longer[0][:4] == first[0]  # other settings: generated
    target.model.to(torch.float64)  # another dtype answers anew
    greedy_continuations(target, prompts[:1], max_new_tokens=4, stop_token_ids=[], engine="hf", batch_size=EVAL_BATCH)
    assert calls == [2, 1, 1]
