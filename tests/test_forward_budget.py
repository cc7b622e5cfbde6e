"""A capture forward that runs out of device memory is planned again in smaller pieces, for the rest of the capture
(dflash/extract/forward_budget.py): the features are those of a smaller capture.batch_tokens, and one sample that
does not fit alone ends the capture naming it."""

from __future__ import annotations

import pytest
import torch

from dflash.extract.capture import capture_dataset
from dflash.extract.forward_budget import ForwardBudget, SampleTooLarge
from dflash.extract.store import FeatureStore
from dflash.models.targets import build_tiny_target
from tests.schema_options import capture_options
from tests.test_capture import make_dataset

LENGTHS = [13, 7, 20, 1, 16, 9, 11, 5, 8, 12]


@pytest.fixture(scope="module")
def dense():
    return build_tiny_target("llama", seed=0, tokenizer="builtin")


def options(pack: bool, batch_tokens: int) -> dict:
    return capture_options(pack=pack, batch_tokens=batch_tokens, shard_tokens=30, dtype="float32",
                           fingerprint={"unit": 1}, show_progress=False)


def out_of_memory_above(monkeypatch, adapter, method: str, limit: int) -> list[int]:
    """adapter.<method> raises torch.OutOfMemoryError for a forward of more than `limit` tokens (padded: rows x
    width); the token counts of the forwards that raised."""
    original, raised = getattr(adapter, method), []

    def forward(*args, **kwargs):
        tokens = args[0].numel()
        if tokens > limit:
            raised.append(tokens)
            raise torch.OutOfMemoryError(f"CUDA out of memory (a test's, {tokens} tokens)")
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, method, forward)
    return raised


def stored(folder) -> list[torch.Tensor]:
    store = FeatureStore(folder)
    return [store[i]["hidden"] for i in range(len(store))]


@pytest.mark.parametrize("pack, method", [(True, "capture_packed"), (False, "capture")])
def test_a_forward_out_of_memory_is_captured_again_in_halves_for_the_rest_of_the_capture(
        tmp_path, dense, monkeypatch, caplog, pack, method):
    data = make_dataset(LENGTHS)
    capture_dataset(dense, data, tmp_path / "small", [1, 3], **options(pack, 24))
    raised = out_of_memory_above(monkeypatch, dense, method, 24)
    with caplog.at_level("WARNING"):
        manifest = capture_dataset(dense, data, tmp_path / "big", [1, 3], **options(pack, 48))
    assert manifest["complete"] and manifest["num_samples"] == len(LENGTHS)
    for got, want in zip(stored(tmp_path / "big"), stored(tmp_path / "small")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The budget is the capture's, not a shard's (30 tokens a shard): once halved, no later forward runs out again.
    assert len(raised) == 1 and raised[0] > 24
    assert "ran out of device memory" in caplog.text and "tokens a forward from here on" in caplog.text


def test_a_sample_that_does_not_fit_alone_ends_the_capture_naming_it(tmp_path, dense, monkeypatch):
    out_of_memory_above(monkeypatch, dense, "capture_packed", 15)
    with pytest.raises(SampleTooLarge, match=r"sample s2 \(20 tokens\) does not fit one forward of the target on its "
                                             r"device even alone: lower data.max_length"):
        capture_dataset(dense, make_dataset(LENGTHS), tmp_path / "store", [1, 3], **options(True, 48))


def test_the_budget_halves_from_the_forward_that_failed():
    budget = ForwardBudget(64)

    def out_of_memory():
        raise torch.OutOfMemoryError("test")

    assert budget.fits(lambda: None, 64, None) and budget.tokens == 64
    assert not budget.fits(out_of_memory, 40, None) and budget.tokens == 20  # half the failed forward's 40
    assert not budget.fits(out_of_memory, 64, None) and budget.tokens == 10  # never above what last failed
    with pytest.raises(ValueError, match="batch_tokens must be >= 1"):
        ForwardBudget(0)
    with pytest.raises(RuntimeError, match="not memory"):  # any other error is not retried
        budget.fits(lambda: (_ for _ in ()).throw(RuntimeError("not memory")), 8, None)


def test_a_check_against_a_plain_forward_out_of_memory_is_skipped_not_taken_for_the_capture(tmp_path, dense,
                                                                                          monkeypatch, caplog):
    """The plain forward of check_every keeps every layer's states: its running out of memory skips that check,
    saying so, and neither halves the budget nor ends the capture."""
    from dflash.extract import feature_checks

    def out_of_memory(adapter, ids, features, layer_ids, sample_id, final=None):
        raise torch.OutOfMemoryError("a test's")

    monkeypatch.setattr(feature_checks, "crosscheck_sample", out_of_memory)
    raised = out_of_memory_above(monkeypatch, dense, "capture_packed", 10_000)
    with caplog.at_level("WARNING"):
        manifest = capture_dataset(dense, make_dataset(LENGTHS), tmp_path / "store", [1, 3],
                                   **{**options(True, 48), "check_every": 3})
    assert manifest["complete"] and raised == []
    assert "the check of sample s2 (20 tokens) against a plain forward was skipped" in caplog.text  # s0 opens a run
    assert "a forward from here on" not in caplog.text
