"""Replay at T > 0: the expected acceptance (expected_acceptance.py) along the target's own sampled continuations.

Each prompt is continued once by the target, sampled at T (seeded: every drafter evaluated with the same seed is
measured on the same continuations), the same text distribution a live decode at T commits. One target pass over
prompt + continuation gives the features the drafter reads and the final hidden states the target's p_T comes
from (through its lm_head and logit transform, as the drafter's q); every continuation position is then drafted
from as an anchor and the steps are walked in expectation. No acceptance is sampled, so two drafters differ only
by what they propose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash.inference.generation import batch_seed, cut_at_stop_strings, cut_response, generation_config, \
    hf_generate
from dflash.inference.static_decode import resolve_engine, static_generate
from dflash.eval.expected_acceptance import ExpectedTrace, check_rule, expected_traces, head_logits
from dflash.eval.metrics import PhaseTimer
from dflash.eval.replay import DrafterProposer, pad_id
from dflash.models.drafter import DFlashDraftModel


def sampled_continuations(adapter, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int],
                          temperature: float, seed: int, batch_size: int, engine: str = "auto") -> list[list[int]]:
    """The target's continuation of each prompt sampled at `temperature` (plain: no top-k / top-p), up to and
    including its first stop token (or before its first stop string), at most max_new_tokens; seeded per prompt
    batch (hf) or per prompt (static)."""
    pad = pad_id(adapter, stop_token_ids)
    if resolve_engine(engine, adapter) == "static":
        made = static_generate(adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
                               pad_id=pad, batch_size=batch_size, temperature=temperature, seed=seed)
    else:
        config = generation_config(max_new_tokens, list(stop_token_ids), pad, temperature, 1.0)
        stops, made = set(stop_token_ids), []
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            rows = hf_generate(adapter, batch, config, pad, batch_seed(seed, [str(first)]))
            made += [cut_response(row, stops, max_new_tokens)[0] for row in rows]
    return [cut_at_stop_strings(tokens, adapter.stop_strings(), adapter.tokenizer)[0] for tokens in made]


@torch.inference_mode()
def target_pass_with_final(adapter, sequences: list[list[int]],
                           layer_ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One batched target pass (right padding): per sequence, features [T, K*H] and final hidden states [T, H]."""
    width = max(len(s) for s in sequences)
    pad = pad_id(adapter, adapter.stop_token_ids())
    ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in sequences], device=adapter.device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=adapter.device)
    features, final = adapter.capture_with_final(ids, mask, layer_ids)
    return ([features[i, : len(s)] for i, s in enumerate(sequences)],
            [final[i, : len(s)] for i, s in enumerate(sequences)])


@torch.inference_mode()
def replay_estimate(drafter: DFlashDraftModel, adapter, prompts: list[list[int]], *, max_new_tokens: int,
                    temperature: float, draft_sampling: str, draft_temperature: float | None = None, seed: int = 0,
                    stop_token_ids: list[int] | None = None, batch_size: int,
                    progress: Callable[[int], None] | None = None,
                    timer: PhaseTimer | None = None) -> list[ExpectedTrace]:
    """The expected step records of `drafter` at `temperature` on `prompts` (module docstring), one per prompt.

    draft_temperature: what sampled drafts are drawn at (None: `temperature`; expected_acceptance.block_survival).
    `timer` (optional) is charged with "generate" (the sampled continuations), "target_pass" and "estimate".
    """
    check_rule(temperature, draft_sampling)
    if not prompts:
        return []
    timer = timer if timer is not None else PhaseTimer()
    stop_ids = adapter.stop_token_ids() if stop_token_ids is None else list(stop_token_ids)
    config = drafter.config
    with timer.phase("generate"):
        continuations = sampled_continuations(adapter, prompts, max_new_tokens=max_new_tokens,
                                              stop_token_ids=stop_ids, temperature=temperature, seed=seed,
                                              batch_size=batch_size)
    traces: list[ExpectedTrace] = []
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        sequences = [list(p) + c for p, c in zip(chunk, continuations[first : first + batch_size])]
        with timer.phase("target_pass"):
            features, finals = target_pass_with_final(adapter, sequences, config.target_layer_ids)
        with timer.phase("estimate"):
            proposer = DrafterProposer(drafter, adapter, sequences, features)
            head, transform = adapter.lm_head_weight(), adapter.logit_transform
            traces += expected_traces(head_logits(proposer.hidden, head, transform), head, finals, sequences,
                                      [len(p) for p in chunk], block_size=config.block_size,
                                      max_new_tokens=max_new_tokens, temperature=temperature,
                                      path_temperature=temperature, draft_sampling=draft_sampling,
                                      transform=transform, draft_temperature=draft_temperature)
        if progress is not None:
            progress(len(chunk))
    return traces
