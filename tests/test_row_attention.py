"""Decode attention over each row's own keys (flex attention, dflash/models/targets/row_attention.py): equal to masked
attention at every row length and sliding window (block boundaries included) and with soft-capped logits; through
regeneration with refilled rows the same tokens as HF greedy (dense and windowed targets) and the same sampled
tokens as the SDPA engine; one span for every step; clear errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

from dflash.inference import static_decode

from dflash.models.targets.row_attention import FLEX_BLOCK, RowPrefixAttention, resolve_attention
from dflash.inference.static_decode import StaticGenerator, static_generate
from dflash.models.targets import build_tiny_target
from tests.test_static_decode import REFILL_BUDGETS, REFILL_LENGTHS, hf_alone, make_prompts
from tests.test_static_windows import WINDOWED

B = FLEX_BLOCK
# Columns on both sides of block edges, the first and the last column of a 4-block cache.
COLUMNS = torch.tensor([0, B - 2, B - 1, B, B + 1, 2 * B + 5, 3 * B - 1, 4 * B - 2, 4 * B - 1, 7])


def masked_reference(q, keys, values, column, window=None, softcap=None):
    """float64 attention of q [R, kv, g, D] over cache [R, kv, L, D]: row r sees column[r] - window < p <= column[r]
    (no lower bound without a window), logits soft-capped (cap * tanh(x / cap)) before the mask when given."""
    logits = q.double() @ keys.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    p = torch.arange(keys.shape[2])
    seen = p <= column[:, None]
    if window is not None:
        seen &= p > column[:, None] - window
    logits = logits.masked_fill(~seen[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1) @ values.double()


@pytest.mark.parametrize("window", [None, 1, 5, B, B + 1, 2 * B + 3, 10 * B])
def test_each_row_attends_over_its_own_keys_only(window):
    rows, kv, groups, dim, length = len(COLUMNS), 2, 3, 16, 4 * B
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, kv, groups, dim, generator=g)
    keys, values = (torch.randn(rows, kv, length, dim, generator=g) for _ in range(2))
    attention = RowPrefixAttention(rows, kv, groups, length, torch.device("cpu"), windows=(None, window))
    attention.update(COLUMNS)
    got = attention(q, keys, values, 1 / math.sqrt(dim), window)
    want = masked_reference(q, keys, values, COLUMNS, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # Keys outside a row's range do not matter, whatever they hold (a previous occupant's, or garbage).
    p = torch.arange(length)
    outside = (p > COLUMNS[:, None]) | ((p <= COLUMNS[:, None] - window) if window is not None else False)
    scribbled = keys.clone()
    scribbled[outside[:, None, :].expand(rows, kv, length)] = 1e4
    torch.testing.assert_close(attention(q, scribbled, values, 1 / math.sqrt(dim), window), got)


def keys_read(mask, rows: int, length: int, block: int) -> torch.Tensor:
    """[rows, length]: how many times a block-sparse kernel reads each key under `mask` (BlockMask): once per
    listed partial block holding it where mask_mod allows it, once per listed full block holding it."""
    blocks = length // block
    slot = torch.arange(blocks)
    block_of = torch.arange(length) // block

    def listed(count, indices):
        count, indices = count.view(rows, 1).long(), indices.view(rows, blocks).long()
        assert indices.min() >= 0 and indices.max() < blocks  # every entry, those past the count too
        return ((indices[:, :, None] == block_of) & (slot[None, :, None] < count[:, :, None])).sum(1)

    allowed = mask.mask_mod(torch.arange(rows)[:, None], 0, 0, torch.arange(length)[None]).long()
    return listed(mask.kv_num_blocks, mask.kv_indices) * allowed + listed(mask.full_kv_num_blocks,
                                                                          mask.full_kv_indices)


@pytest.mark.parametrize("block", [1, 2, 4, 8])
def test_the_block_lists_read_every_visible_key_once_and_nothing_else(block):
    # Eager flex (the CPU path) evaluates mask_mod on every key and never reads the block lists that the compiled
    # kernel follows, so the lists are checked here on their own: every column of caches of 1-4 blocks, every
    # window up to past the cache.
    for blocks in range(1, 5):
        length = block * blocks
        column = torch.arange(length)  # one row per column
        windows = (None, *range(1, length + 3))
        attention = RowPrefixAttention(length, 1, 1, length, torch.device("cpu"), windows=windows, block=block)
        attention.update(column)
        p = torch.arange(length)
        for window in windows:
            visible = (p <= column[:, None]) & ((p > column[:, None] - window) if window else True)
            read = keys_read(attention.block_masks[window], length, length, block)
            assert torch.equal(read, visible.long()), (block, length, window)
            # A row reads at most two blocks through the mask (the ones its range cuts).
            assert attention.block_masks[window].kv_num_blocks.max() <= 2


@pytest.mark.slow
def test_compiled_flex_follows_the_block_lists():
    # Inductor's CPU flex kernel skips the blocks a row's lists leave out: the lists and the mask together give
    # the masked reference, with garbage outside each row's range.
    rows, kv, groups, dim, length = len(COLUMNS), 1, 3, 16, 4 * B
    g = torch.Generator().manual_seed(2)
    q = torch.randn(rows, kv, groups, dim, generator=g)
    keys, values = (torch.randn(rows, kv, length, dim, generator=g) for _ in range(2))
    attention = RowPrefixAttention(rows, kv, groups, length, torch.device("cpu"), windows=(None, B + 3))
    attention.update(COLUMNS)
    compiled = torch.compile(flex_attention, dynamic=False)
    p = torch.arange(length)
    for window in (None, B + 3):
        outside = (p > COLUMNS[:, None]) | ((p <= COLUMNS[:, None] - window) if window else False)
        scribbled = keys.masked_fill(outside[:, None, :, None], 1e4)
        got = compiled(q, scribbled, values, block_mask=attention.block_masks[window], scale=1 / math.sqrt(dim))
        want = masked_reference(q, keys, values, COLUMNS, window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_regeneration_through_the_compiled_flex_kernel(monkeypatch):
    # The CUDA path compiles the flex call, and the compiled kernel reads the block lists each step rewrites in
    # place; inductor's CPU kernel does the same, so the engine runs it here: HF greedy's tokens with refilled rows.
    from dflash.models.targets import row_attention

    monkeypatch.setattr(row_attention, "_flex", functools.cache(lambda device_type: torch.compile(
        row_attention._row_flex_attention, dynamic=False, fullgraph=True)))
    adapter = build_tiny_target("qwen3", 0, tokenizer="builtin", initializer_range=0.2, num_hidden_layers=2)
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    got = static_generate(adapter, prompts, max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0,
                          batch_size=3, attention="flex")
    assert got == hf_alone(adapter, prompts, REFILL_BUDGETS, [2])


def test_soft_capped_logits():
    rows, kv, groups, dim, length = len(COLUMNS), 1, 2, 8, 4 * B
    g = torch.Generator().manual_seed(1)
    q = 4 * torch.randn(rows, kv, groups, dim, generator=g)  # logits well past the cap
    keys, values = (torch.randn(rows, kv, length, dim, generator=g) for _ in range(2))
    attention = RowPrefixAttention(rows, kv, groups, length, torch.device("cpu"), windows=(None, 9), softcap=2.0)
    attention.update(COLUMNS)
    for window in (None, 9):
        got = attention(q, keys, values, 1 / math.sqrt(dim), window, softcap=2.0)
        want = masked_reference(q, keys, values, COLUMNS, window, softcap=2.0)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got.double(), masked_reference(q, keys, values, COLUMNS, window), atol=1e-2)
    with pytest.raises(ValueError, match="soft cap 3.0"):
        attention(q, keys, values, 1 / math.sqrt(dim), None, softcap=3.0)


def test_a_cache_length_off_the_block_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the flex block"):
        RowPrefixAttention(2, 1, 1, FLEX_BLOCK + 8, torch.device("cpu"))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_flex_decoding_gives_the_sdpa_engine_and_hf_tokens(family):
    adapter = build_tiny_target(family, 0, tokenizer="builtin", initializer_range=0.2)
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    expected = hf_alone(adapter, prompts, REFILL_BUDGETS, [2])
    for batch_size in (3, 5):
        generator = StaticGenerator(adapter, attention="flex")
        got = generator.generate(prompts, max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0,
                                 batch_size=batch_size)
        assert got == expected, batch_size
        assert generator.last_stats.admissions > 1  # rows were refilled, over a previous occupant's keys
    sampled = dict(max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0, batch_size=4, temperature=0.9,
                   top_p=0.8, seed=3)
    assert static_generate(adapter, prompts, **sampled, attention="flex") == static_generate(
        adapter, prompts, **sampled, attention="sdpa")


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_flex_decoding_of_windowed_targets_gives_hf_tokens(family):
    adapter = build_tiny_target(family, 0, tokenizer="builtin", initializer_range=0.2, **WINDOWED[family])
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    expected = hf_alone(adapter, prompts, REFILL_BUDGETS, [2])
    got = static_generate(adapter, prompts, max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0,
                          batch_size=3, attention="flex")
    assert got == expected


def test_flex_decodes_every_step_at_one_span():
    adapter = build_tiny_target("qwen3", 0, tokenizer="builtin", initializer_range=0.2)
    spans = []
    generator = StaticGenerator(adapter, attention="flex")
    decoder = generator._decoder_for(2, 256, [2], 0.0, 1.0)
    decode = decoder.decode
    decoder.decode = lambda steps, span: (spans.append(span), decode(steps, span))
    generator.generate([[5, 6, 7], [8, 9]], max_new_tokens=3, stop_token_ids=[2], pad_id=0, batch_size=2)
    assert spans and set(spans) == {256}


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_a_compiled_step_with_flex_compiles_nothing_once_warm(family, monkeypatch):
    # capture_graphs runs a compiled step COMPILED_WARMUPS times to warm up, then again while capturing: that call
    # must not compile (dynamo only here: the eager backend traces what inductor would get).
    overrides = WINDOWED.get(family, {}) if family == "gemma2" else {}
    adapter = build_tiny_target(family, 0, tokenizer="builtin", initializer_range=0.2, num_hidden_layers=2,
                                **overrides)
    monkeypatch.setattr(static_decode, "_compiled_step", functools.cache(
        lambda: torch.compile(static_decode._Decoder.step, fullgraph=True, backend="eager")))
    generator = StaticGenerator(adapter, attention="flex", compile_step=True)
    with torch.inference_mode():
        decoder = generator._decoder_for(3, 128, [2], 0.0, 1.0)
        for _ in range(static_decode.COMPILED_WARMUPS):
            decoder.advance(decoder.spans[0])
        graphs = counters["stats"]["unique_graphs"]
        decoder.advance(decoder.spans[0])
        decoder.advance(decoder.spans[0])
    assert counters["stats"]["unique_graphs"] == graphs
    prompts = make_prompts()
    assert generator.generate(prompts, max_new_tokens=6, stop_token_ids=[2], pad_id=0, batch_size=3) == \
        static_generate(adapter, prompts, max_new_tokens=6, stop_token_ids=[2], pad_id=0, batch_size=3)


def test_attention_choices():
    adapter = build_tiny_target("llama", 0, tokenizer="builtin")
    assert resolve_attention("auto", adapter.engine_layout) == "sdpa"  # on the CPU
    assert resolve_attention("flex", adapter.engine_layout) == "flex"
    assert resolve_attention("sdpa", adapter.engine_layout) == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of"):
        StaticGenerator(adapter, attention="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5, B + 1])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_compiled_flex_on_cuda_equals_masked_attention(window, softcap):
    rows, kv, groups, dim, length = len(COLUMNS), 3, 3, 64, 4 * B
    g = torch.Generator().manual_seed(3)
    q = torch.randn(rows, kv, groups, dim, generator=g)
    keys, values = (torch.randn(rows, kv, length, dim, generator=g) for _ in range(2))
    attention = RowPrefixAttention(rows, kv, groups, length, torch.device("cuda"), windows=(None, window),
                                   softcap=softcap)
    attention.update(COLUMNS.cuda())
    p = torch.arange(length)
    outside = (p > COLUMNS[:, None]) | ((p <= COLUMNS[:, None] - window) if window else False)
    scribbled = keys.masked_fill(outside[:, None, :, None], 1e4)
    got = attention(q.cuda(), scribbled.cuda(), values.cuda(), 1 / math.sqrt(dim), window, softcap)
    want = masked_reference(q, keys, values, COLUMNS, window, softcap)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flex_under_cuda_graphs_replays_the_eager_step(dtype):
    adapter = build_tiny_target("qwen3", 0, tokenizer="builtin", initializer_range=0.2, device="cuda", dtype=dtype)
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    args = dict(max_new_tokens=REFILL_BUDGETS, stop_token_ids=[2], pad_id=0, batch_size=3, attention="flex")
    graphed = static_generate(adapter, prompts, **args, cuda_graphs=True)
    assert graphed == static_generate(adapter, prompts, **args, cuda_graphs=False)
    assert resolve_attention("auto", adapter.engine_layout) == "flex"
    if dtype == "float32":
        assert graphed == hf_alone(adapter, prompts, REFILL_BUDGETS, [2])
        assert static_generate(adapter, prompts, **args, compile_step=True) == graphed
        # Sampled rows (the synthetic prompts' draws): each prompt's uniform stream, replayed inside the graph.
        sampled = dict(args, temperature=0.9, top_p=0.8, seed=3, cuda_graphs=True)
        assert static_generate(adapter, prompts, **sampled) == static_generate(adapter, prompts,
                                                                               **dict(sampled, attention="sdpa"))
