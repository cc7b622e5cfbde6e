"""DrafterProposer.contexts: consecutive rows without left padding get a view of the cached keys/values instead of
an index gather, and the drafts, hidden states and replay traces stay bit-identical to the gather."""

from __future__ import annotations

import pytest
import torch

from dflash.eval.replay import DrafterProposer, replay
from dflash.models.targets import build_tiny_target
from tests.test_eval import prompts_for, stored_proposer


def gathered(self, rows, index, source, left_padded):
    """The index gather every step used before the slice path existed (the reference semantics)."""
    return [(k[index[:, None], :, source].transpose(1, 2), v[index[:, None], :, source].transpose(1, 2))
            for k, v in self.context]


def shares_storage(view, base):
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_consecutive_rows_slice_the_cache(tiny_target, make_drafter, monkeypatch):
    adapter = tiny_target("llama")
    drafter = make_drafter(adapter, std=0.2)
    prompts, _, proposer = stored_proposer(adapter, drafter)
    start = min(len(p) for p in prompts)  # longer than the sliding window of 8
    assert start > drafter.config.sliding_window
    cases = {  # (rows, starts): does the step slice?
        ((1, 2), (start, start)): True,
        ((0,), (len(prompts[0]) + 2,)): True,
        ((0, 2), (start, start)): False,  # not consecutive
        ((2, 1), (start, start)): False,  # not ascending
        ((1, 2), (start, start + 1)): False,  # row 1 is left-padded
    }
    hidden_of = {}
    for (rows, starts), slices in cases.items():
        index = torch.tensor(rows)
        num_context = max(starts)
        source = (torch.arange(num_context)[None] - (num_context - torch.tensor(starts))[:, None]).clamp(min=0)
        context = proposer.contexts(list(rows), index, source, min(starts) != num_context)
        assert all(shares_storage(k, base_k) == slices and shares_storage(v, base_v) == slices
                   for (k, v), (base_k, base_v) in zip(context, proposer.context))
        for (k, v), (want_k, want_v) in zip(context, gathered(proposer, rows, index, source, None)):
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        hidden_of[rows, starts] = proposer.hidden(list(rows), list(starts), [4, 3][: len(rows)])
    monkeypatch.setattr(DrafterProposer, "contexts", gathered)
    for (rows, starts), hidden in hidden_of.items():
        assert torch.equal(hidden, proposer.hidden(list(rows), list(starts), [4, 3][: len(rows)]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_replay_is_unchanged_by_slicing(device, tiny_target, make_drafter, monkeypatch):
    # Chunks of 2 over 3 prompts: the last chunk is a lone row (sliced every step), the first mixes both paths.
    adapter = tiny_target("llama") if device == "cpu" else build_tiny_target("llama", 0, tokenizer="builtin",
                                                                             device=device)
    drafter = make_drafter(adapter, std=0.2).to(device)
    prompts = prompts_for(adapter)
    original_hidden, original_contexts = DrafterProposer.hidden, DrafterProposer.contexts
    sliced_steps = []

    def counting_contexts(self, rows, index, source, left_padded):
        context = original_contexts(self, rows, index, source, left_padded)
        sliced_steps.append(shares_storage(context[0][0], self.context[0][0]))
        return context

    def run():
        outputs = []

        def recording_hidden(self, rows, starts, size):
            outputs.append(original_hidden(self, rows, starts, size))
            return outputs[-1]

        monkeypatch.setattr(DrafterProposer, "hidden", recording_hidden)
        # The gathered step, whose contexts this test follows (on CUDA the default drafts at one shape instead).
        results = replay(drafter, adapter, prompts, max_new_tokens=14, stop_token_ids=[], batch_size=2,
                         fixed_shape=False)
        return results, outputs

    monkeypatch.setattr(DrafterProposer, "contexts", counting_contexts)
    sliced, sliced_outputs = run()
    assert any(sliced_steps) and not all(sliced_steps), sliced_steps
    monkeypatch.setattr(DrafterProposer, "contexts", gathered)
    reference, reference_outputs = run()
    assert len(sliced_outputs) == len(reference_outputs) == len(sliced_steps)
    assert all(torch.equal(a, b) for a, b in zip(sliced_outputs, reference_outputs))
    for a, b in zip(sliced, reference):
        assert a.continuation == b.continuation
        assert (a.trace.committed, a.trace.accepted, a.trace.drafted) == \
            (b.trace.committed, b.trace.accepted, b.trace.drafted)
