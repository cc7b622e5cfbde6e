"""The static engines on targets with sliding-window layers: Gemma 3 (local and global layers, one RoPE base per
layer type, a final logit soft cap), Gemma 2 (soft-capped attention logits), Mistral (a window on every layer) and
Qwen3 with window layers. Regeneration equals HF greedy `generate` token for token, StaticTarget's logits and taps
equal the dynamic-cache CachedTarget's, live decoding through it is lossless, the masks are transformers' own, a
window longer than the sequence changes nothing, and a dense target still builds one mask per step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import sliding_window_causal_mask_function

from dflash.eval.live import live_decode, target_only_decode
from dflash.models.targets.attention_switch import attention_implementation
from dflash.models.targets.static_attention import visibility_masks
from dflash.inference.static_decode import StaticGenerator, static_generate
from dflash.inference.static_target import StaticTarget
from dflash.inference.target_cache import CachedTarget
from dflash.models.targets import build_tiny_target
from tests.schema_options import DRAFT_SAMPLING
from tests.test_eval_live import oracle, own_greedy
from tests.test_static_decode import REFILL_BUDGETS, REFILL_LENGTHS, hf_alone, hf_greedy, make_prompts

# family -> config overrides: windows of 8, shorter than the prompts and answers below. The Gemmas' heads are
# untied: a random tied Gemma repeats its input token (its scaled embedding dominates the residual).
WINDOWED = {
    # Gemma 3's default layout: sliding layers 0-4, 6, 7 and a full layer 5; a final soft cap strong enough to
    # move logits well past the tolerances.
    "gemma3_text": {"final_logit_softcapping": 5.0, "tie_word_embeddings": False},
    # sliding and full layers alternate; attention logits soft-capped at 50
    "gemma2": {"tie_word_embeddings": False},
    "mistral": {},  # every layer a window of 8
    "qwen3": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},  # layers 3-7 sliding
}
LENGTHS = (5, 17, 9, 30, 1, 12)


@pytest.fixture(scope="module")
def target():
    cache: dict = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_tiny_target(family, 0, tokenizer="builtin", initializer_range=0.2,
                                           **{**WINDOWED[family], **overrides})
        return cache[key]

    return get


def test_masks_are_transformers_sliding_window_masks():
    """Key p visible to query q iff q - window < p <= q, as transformers' sliding-window mask function says."""
    columns = torch.arange(12)
    positions = torch.tensor([0, 3, 7, 8, 11])
    masks = visibility_masks(columns, positions, (None, 1, 4, 8, 100), torch.float32)
    for window, mask in masks.items():
        if window is None:
            expected = columns[None] <= positions[:, None]
        else:
            rule = sliding_window_causal_mask_function(window)
            expected = rule(0, 0, positions[:, None], columns[None])
        assert torch.equal(mask == 0, expected), window
        assert torch.equal(mask[mask != 0], torch.full_like(mask[mask != 0], float("-inf")))
    assert torch.equal(masks[100], masks[None])


def test_gemma3_layers_get_their_window_and_rope_table(target):
    adapter = target("gemma3_text")
    layout = adapter.static_layout()
    kinds = adapter.config.layer_types
    assert layout.rope_kinds == tuple(kinds) and layout.windows == tuple(8 if k == "sliding_attention" else None
                                                                          for k in kinds)
    assert layout.mask_windows == (8, None) and not layout.plain
    tables = layout.rope_table(40)
    positions = torch.arange(40)[None]
    probe = torch.zeros(1)
    for kind in ("sliding_attention", "full_attention"):
        cos, sin = adapter.text_model().rotary_emb(probe, positions, kind)
        assert torch.equal(tables[kind][0], cos[0]) and torch.equal(tables[kind][1], sin[0])
    # A local RoPE base (10k) and a global one (1M): the tables differ.
    assert not torch.equal(tables["sliding_attention"][0], tables["full_attention"][0])


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_regeneration_matches_hf_greedy(family, target):
    adapter = target(family)
    prompts = make_prompts(LENGTHS)
    expected = hf_greedy(adapter, prompts, 20, [])
    assert min(len(set(c)) for c in expected) > 3, expected  # varied text, so equality means something
    # The windows matter: the same weights with windows longer than the sequences decode other tokens.
    assert hf_greedy(target(family, sliding_window=4096), prompts, 20, []) != expected
    # 3 rows for 6 prompts: refilled rows over stale keys of longer occupants.
    got = static_generate(adapter, prompts, max_new_tokens=20, stop_token_ids=[], pad_id=0, batch_size=3)
    assert got == expected


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_static_target_equals_cached_target(family, target):
    adapter = target(family)
    taps = [0, 5, adapter.num_layers - 1]
    # 120 prompt tokens: the verifies below cross the first 128-column attention span, far past the window.
    prompt = [4 + (i * 7) % 200 for i in range(120)]
    static, cached = StaticTarget(adapter, taps, capacity=160), CachedTarget(adapter, taps)
    for got, want in zip(static.forward(prompt, last_logits_only=True), cached.forward(prompt, last_logits_only=True)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for block, keep in (([5, 6, 7, 8], 2), (torch.tensor([9, 10, 11]), 3), ([12, 13, 14, 15], 1), ([16], 1)):
        got, want = static.verify(block), cached.verify(block)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        start = static.length - len(block)
        static.rollback(start + keep)
        cached.rollback(start + keep)
    # Gemma 3's final soft cap (5) moves logits this large by far more than the tolerance.
    assert family != "gemma3_text" or got[0].abs().max() > 1


@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_live_static_is_lossless(family, target, make_drafter, monkeypatch):
    adapter = target(family)
    prompt = make_prompts((30,))[0]
    truth = own_greedy(adapter, prompt, 20)
    assert len(set(truth)) > 3, truth
    drafter = make_drafter(adapter, block_size=5)
    result = live_decode(drafter, adapter, prompt, max_new_tokens=20, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    assert result.engine == "static" and result.continuation == truth
    plain = target_only_decode(adapter, prompt, max_new_tokens=20, stop_token_ids=[], target_engine="static")
    assert plain.continuation == truth
    # Partial and full acceptance, rollbacks of every length: the same steps as the hf engine.
    oracle(monkeypatch, adapter, prompt, truth)
    static = live_decode(drafter, adapter, prompt, max_new_tokens=20, stop_token_ids=[], target_engine="static",
                         draft_sampling=DRAFT_SAMPLING)
    hf = live_decode(drafter, adapter, prompt, max_new_tokens=20, stop_token_ids=[], target_engine="hf",
                     draft_sampling=DRAFT_SAMPLING)
    assert static.continuation == hf.continuation == truth and static.trace == hf.trace


def test_a_window_longer_than_the_sequence_changes_nothing(target):
    """Mistral with a window of 4096 decodes what the same weights without a window decode: the same tokens, and
    StaticTarget's numbers bit for bit (its masks are equal)."""
    wide, full = target("mistral", sliding_window=4096), target("mistral", sliding_window=None)
    assert wide.static_layout().mask_windows == (4096,) and full.static_layout().plain
    prompts = make_prompts(LENGTHS)
    tokens = [static_generate(t, prompts, max_new_tokens=20, stop_token_ids=[], pad_id=0, batch_size=3)
              for t in (wide, full)]
    assert tokens[0] == tokens[1] == hf_greedy(full, prompts, 20, [])
    static = [StaticTarget(t, [2], capacity=64) for t in (wide, full)]
    for block in ([4 + i for i in range(30)], [5, 6, 7], [8]):
        for got, want in zip(*(s.forward(block) for s in static)):
            assert torch.equal(got, want)


@pytest.mark.slow
def test_compiled_step_gives_the_same_tokens():
    """torch.compile of the decode step (fullgraph) over a local and a global Gemma 3 layer: HF's tokens. The
    generic adapter's construction leaves no output-recording hooks on the layers for the compile to trip on."""
    adapter = build_tiny_target("gemma3_text", 0, tokenizer="builtin", initializer_range=0.2, num_hidden_layers=2,
                                layer_types=["sliding_attention", "full_attention"], **WINDOWED["gemma3_text"])
    prompts = make_prompts(LENGTHS)
    got = static_generate(adapter, prompts, max_new_tokens=12, stop_token_ids=[2], pad_id=0, batch_size=3,
                          compile_step=True)
    assert got == hf_greedy(adapter, prompts, 12, [2])


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] = self.counts.get(str(func.overloadpacket), 0) + 1
        return func(*args, **(kwargs or {}))


def masks_per_step(adapter) -> int:
    """The additive masks one regeneration decode step builds (masked fills of -inf)."""
    generator = StaticGenerator(adapter)
    generator.generate([[5, 6, 7]], max_new_tokens=2, stop_token_ids=[], pad_id=0, batch_size=1)
    decoder = generator._decoder
    counter = OpCounter()
    with torch.inference_mode(), counter:
        decoder.advance(128)
    return counter.counts.get("aten.masked_fill_", 0)


def test_masks_are_built_once_per_step_and_window(target):
    """One mask per step for a dense target (whatever its depth), one per distinct window for Gemma 3."""
    dense = build_tiny_target("llama", 0, tokenizer="builtin")
    assert dense.static_layout().mask_windows == (None,) and dense.static_layout().plain
    assert masks_per_step(dense) == 1
    assert masks_per_step(target("gemma3_text")) == 2


@pytest.mark.parametrize("family,change,reason", [
    ("gemma3_text", {"use_bidirectional_attention": True}, "attends bidirectionally"),
    ("mistral", {"layer_types": ["chunked_attention"] * 8}, r"layer_types \['chunked_attention'\] are neither"),
])
def test_what_the_engines_cannot_run_is_refused_by_name(family, change, reason):
    adapter = build_tiny_target(family, 0, tokenizer="builtin", **change)
    assert adapter.static_layout_problem() is not None
    with pytest.raises(ValueError, match=reason):
        StaticTarget(adapter, [], capacity=16)
    sinks = build_tiny_target("gpt_oss", 0, tokenizer="builtin")
    assert "'gpt_oss' is not a family" in sinks.static_layout_problem()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_with_windows(dtype):
    """Gemma 3 on the GPU: regeneration's graphs (and its compiled step) give the eager step's tokens, and in
    float32 HF's; StaticTarget's verify and one-token graphs give its eager forwards bit for bit."""
    adapter = build_tiny_target("gemma3_text", 0, tokenizer="builtin", initializer_range=0.2, device="cuda",
                                dtype=dtype, **WINDOWED["gemma3_text"])
    prompts = make_prompts(REFILL_LENGTHS, seed=2)
    args = dict(max_new_tokens=REFILL_BUDGETS, stop_token_ids=[], pad_id=0, batch_size=3)
    graphed = static_generate(adapter, prompts, **args, cuda_graphs=True)
    assert graphed == static_generate(adapter, prompts, **args, cuda_graphs=False)
    if dtype == "float32":
        assert graphed == hf_alone(adapter, prompts, REFILL_BUDGETS, [])
        assert static_generate(adapter, prompts, **args, compile_step=True) == graphed
    taps = [0, 5, adapter.num_layers - 1]
    prompt = [4 + (i * 7) % 200 for i in range(118)]
    graphed, eager = (StaticTarget(adapter, taps, capacity=160, graph_sizes=range(1, 5), cuda_graphs=graphs)
                      for graphs in (True, False))
    for static in (graphed, eager):
        static.forward(prompt, last_logits_only=True)
    for block, keep in (([5, 6], 1), ([7, 8, 9], 2), ([10, 11, 12, 13], 4), ([14, 15, 16], 1), ([17], 1)):
        for got, want in zip(graphed.verify(block), eager.verify(block)):
            assert torch.equal(got, want)
        start = graphed.length - len(block)
        graphed.rollback(start + keep)
        eager.rollback(start + keep)


def test_gemma2_keeps_its_attention_soft_cap_under_any_attention_default(target):
    """Only HF's eager attention applies Gemma 2's attention soft cap; a model loaded with SDPA (transformers 5.17's
    default for it) is switched to eager by its adapter, so the HF forward and the static engines run one model."""
    adapter = target("gemma2")
    model = adapter.model
    ids = torch.tensor([[4 + (i * 7) % 200 for i in range(40)]])
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        with attention_implementation(model, "sdpa"):
            try:  # the cap matters: SDPA gives other logits (5.17), or refuses a soft cap (later releases)
                assert not torch.allclose(model(input_ids=ids).logits, eager, atol=1e-4, rtol=1e-4)
            except ValueError as refused:
                assert "softcap" in str(refused)
            type(adapter)(model, adapter.tokenizer)
            assert model.config._attn_implementation == "eager"
            torch.testing.assert_close(model(input_ids=ids).logits, eager, atol=0, rtol=0)
