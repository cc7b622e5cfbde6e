"""Packed capture (capture.pack): sequences laid end to end in one row give each sequence's own features, on dense
and GDN hybrid targets; the store written from packed runs equals the padded one; the checks still name samples."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from dflash.extract.capture import capture_dataset
from dflash.extract.shard_rows import packed_runs
from dflash.extract.feature_checks import feature_flags, packed_feature_flags, raise_on_bad_features
from dflash.extract.store import FeatureStore
from dflash.models.targets import build_tiny_target
from dflash.models.targets.gdn_kernels import fla_installed
from dflash.models.targets.packed_attention import PACKED_ATTENTION, packed_attention, packed_attention_forward
from tests.schema_options import capture_options

FAMILIES = ["llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
LENGTHS = [11, 6, 9, 1, 20, 4]


def random_sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 256, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_gives_each_sequence_its_own_features(family):
    """Attention stays inside each sequence, positions restart at 0, and a GDN layer's conv and recurrent states
    do not leak from one sequence into the next."""
    adapter = build_tiny_target(family, tokenizer="builtin")
    sequences = random_sequences(LENGTHS)
    layer_ids = list(range(adapter.num_layers - 1))
    packed = adapter.capture_packed(torch.cat(sequences), LENGTHS, layer_ids)
    alone = torch.cat([adapter.capture(s[None], None, layer_ids)[0] for s in sequences])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)
    # The same row run as one plain sequence differs after the first one: the comparison can fail.
    plain = adapter.capture(torch.cat(sequences)[None], None, layer_ids)[0]
    assert (plain[LENGTHS[0]:] - alone[LENGTHS[0]:]).abs().max() > 1e-2
    torch.testing.assert_close(plain[:LENGTHS[0]], alone[:LENGTHS[0]], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sliding_window_layers_keep_their_window_when_packed(device):
    """A Mistral-style target (every layer a sliding window of 8 keys): sequences longer than the window see only
    their last 8 keys, packed or alone (on CUDA in bf16: FlashAttention's window arguments)."""
    from transformers import MistralConfig, MistralForCausalLM

    from dflash.models.targets.registry import wrap_model
    from dflash.models.targets.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer("builtin")
    config = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    adapter = wrap_model(MistralForCausalLM(config).to(device=device, dtype=dtype), tokenizer)
    lengths = [20, 5, 13]
    sequences = [s.to(device) for s in random_sequences(lengths, seed=4)]
    packed = adapter.capture_packed(torch.cat(sequences), lengths, [0, 2]).float()
    alone = torch.cat([adapter.capture(s[None], None, [0, 2])[0] for s in sequences]).float()
    error = float((packed - alone).norm() / alone.norm())
    assert error < (2e-2 if device == "cuda" else 1e-6), f"relative error {error:.3g}"
    config.sliding_window = None  # the window matters for these lengths: without it the features differ
    unwindowed = adapter.capture(sequences[0][None], None, [0, 2])[0].float()
    assert float((unwindowed - alone[:20]).norm() / alone[:20].norm()) > 5 * error


def test_packed_capture_rejects_bad_lengths():
    adapter = build_tiny_target("llama", tokenizer="builtin")
    ids = torch.arange(4, 14)
    with pytest.raises(ValueError, match="sum to the row's 10 tokens"):
        adapter.capture_packed(ids, [4, 5], [1])
    with pytest.raises(ValueError, match="must be positive"):
        adapter.capture_packed(ids, [10, 0], [1])
    with pytest.raises(ValueError, match="1-D row"):
        adapter.capture_packed(ids[None], [10], [1])


def test_packed_attention_takes_one_row_only():
    q = torch.randn(2, 4, 6, 8)
    with pytest.raises(ValueError, match="one row of sequences laid end to end, got a batch of 2"):
        packed_attention_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 2, 6]))


def test_packed_attention_is_restored_after_an_error():
    adapter = build_tiny_target("qwen3_5", tokenizer="builtin")
    before = adapter.config._attn_implementation
    assert before != PACKED_ATTENTION
    with pytest.raises(RuntimeError, match="boom"):
        with packed_attention(adapter.model):
            assert adapter.config._attn_implementation == PACKED_ATTENTION
            raise RuntimeError("boom")
    assert adapter.config._attn_implementation == before
    # Outside the block the model runs its padded batches exactly as before.
    ids = torch.randint(4, 256, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    reference = adapter.capture(ids, mask, [1, 3])
    adapter.capture_packed(torch.cat([ids[0], ids[1, :4]]), [7, 4], [1, 3])
    torch.testing.assert_close(adapter.capture(ids, mask, [1, 3]), reference, atol=0, rtol=0)


def test_packed_runs_keep_order_and_budget():
    import numpy as np

    lengths = np.array([5, 3, 9, 2, 2, 12, 1])
    runs = packed_runs(lengths, 10)
    assert runs == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]  # 12 > 10 runs alone
    assert [j for first, end in runs for j in range(first, end)] == list(range(len(lengths)))
    assert packed_runs(np.array([4]), 1) == [(0, 1)]


def test_packed_flags_match_padded_flags_and_name_the_sample():
    g = torch.Generator().manual_seed(0)
    lengths, taps, hidden = [3, 5, 2], [1, 4], 6
    flat = torch.randn(sum(lengths), len(taps) * hidden, generator=g)
    padded = torch.zeros(len(lengths), max(lengths), flat.shape[1])
    start = 0
    for row, n in enumerate(lengths):
        padded[row, :n] = flat[start:start + n]
        start += n
    torch.testing.assert_close(packed_feature_flags(flat, lengths, taps), feature_flags(padded, lengths, taps))
    flat[3:8, hidden:] = 2.5  # sample 1, second tap: constant
    flat[8, 0] = float("nan")  # sample 2, first tap
    flags = packed_feature_flags(flat, lengths, taps)
    with pytest.raises(ValueError, match="sample 'b': tap 4 has zero variance"):
        raise_on_bad_features(flags, ["a", "b", "c"], taps)
    with pytest.raises(ValueError, match="sample 'c': tap 1 has non-finite"):
        raise_on_bad_features(flags[[0, 2]], ["a", "c"], taps)
    with pytest.raises(ValueError, match="one row per token"):
        packed_feature_flags(flat[:-1], lengths, taps)


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_packed_store_equals_padded_store(tmp_path, dtype):
    adapter = build_tiny_target("qwen3_5", tokenizer="builtin")
    sequences = random_sequences([13, 7, 20, 1, 16, 9, 11], seed=1)
    data = Dataset.from_dict({"id": [f"s{i}" for i in range(len(sequences))],
                              "input_ids": [s.tolist() for s in sequences],
                              "loss_mask": [[1] * len(s) for s in sequences]})
    stores = {}
    for pack in (False, True):
        capture_dataset(adapter, data, tmp_path / str(pack), [1, 3, 6], batch_tokens=30, shard_tokens=40,
                        dtype=dtype, check_every=3, fingerprint={}, show_progress=False, pack=pack)
        stores[pack] = FeatureStore(tmp_path / str(pack))
    for i in range(len(sequences)):
        padded, packed = stores[False][i], stores[True][i]
        assert torch.equal(padded["input_ids"], packed["input_ids"])
        tolerance = 0.07 if dtype == "fp8" else 1e-5  # fp8: one rounding step of e4m3 apart at most
        torch.testing.assert_close(packed["hidden"].float(), padded["hidden"].float(), atol=tolerance,
                                   rtol=tolerance)


def test_a_leaking_packed_capture_is_caught_by_the_crosscheck(tmp_path, monkeypatch):
    """A target whose layers ignored the packing (states carried across sequences) fails the sampled re-forward."""
    adapter = build_tiny_target("llama", tokenizer="builtin")
    sequences = random_sequences([6, 8], seed=2)
    data = Dataset.from_dict({"id": ["a", "b"], "input_ids": [s.tolist() for s in sequences],
                              "loss_mask": [[1] * len(s) for s in sequences]})

    def leaking(input_ids, lengths, layer_ids):
        return adapter.capture(input_ids[None], None, layer_ids)[0]

    monkeypatch.setattr(adapter, "capture_packed", leaking)
    # check_every=1000 selects sample 0 alone, the first of its run (nothing before it to leak from): its run's
    # last sample is checked instead.
    for check_every in (1, 1000):
        with pytest.raises(ValueError, match=r"sample 'b': tap 2 differs from output_hidden_states\[3\]"):
            capture_dataset(adapter, data, tmp_path / str(check_every), [2], fingerprint={}, show_progress=False,
                            **capture_options(pack=True, check_every=check_every))


def test_a_target_packing_cannot_serve_is_captured_in_padded_batches_within_batch_tokens(tmp_path, monkeypatch):
    adapter = build_tiny_target("llama", tokenizer="builtin")
    monkeypatch.setattr(adapter, "packing_problem", lambda: "its attention soft-caps its logits")
    sequences = random_sequences([60] + [4] * 30, seed=3)
    data = Dataset.from_dict({"id": [f"s{i}" for i in range(len(sequences))],
                              "input_ids": [s.tolist() for s in sequences],
                              "loss_mask": [[1] * len(s) for s in sequences]})
    shapes = []
    capture = adapter.capture
    monkeypatch.setattr(adapter, "capture", lambda ids, mask, taps: (shapes.append(tuple(ids.shape)),
                                                                      capture(ids, mask, taps))[1])
    capture_dataset(adapter, data, tmp_path, [2], fingerprint={}, show_progress=False,
                    **capture_options(pack=True, batch_tokens=180, check_every=0))
    assert shapes and max(rows * width for rows, width in shapes) <= 180  # not 31 rows x 60 in one batch


@pytest.mark.gpu(reason="FlashAttention's varlen kernel, fla")
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_packed_capture_matches_one_at_a_time_on_cuda(family):
    """The real kernels: FlashAttention's variable-length attention and, on the hybrid, fla's conv and chunked
    gated delta rule reading cu_seqlens, in bf16, against each sequence captured alone."""
    if family == "qwen3_5" and not fla_installed():
        pytest.skip("needs flash-linear-attention")
    adapter = build_tiny_target(family, tokenizer="builtin", device="cuda", dtype="bfloat16",
                                num_hidden_layers=8, hidden_size=128, head_dim=32, intermediate_size=256)
    lengths = [300, 17, 129, 1, 64, 511]
    sequences = [s.cuda() for s in random_sequences(lengths, seed=3)]
    layer_ids = [1, 3, 6]
    packed = adapter.capture_packed(torch.cat(sequences), lengths, layer_ids).float()
    alone = torch.cat([adapter.capture(s[None], None, layer_ids)[0] for s in sequences]).float()
    error = (packed - alone).norm() / alone.norm()
    assert error < 2e-2, f"relative error {error:.3g}"
    plain = adapter.capture(torch.cat(sequences)[None], None, layer_ids)[0].float()
    leak = (plain[lengths[0]:] - alone[lengths[0]:]).norm() / alone[lengths[0]:].norm()
    assert leak > 5 * error  # the comparison can tell a leak from rounding
