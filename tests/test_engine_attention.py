"""The static engines (regeneration's decoder, live decoding's StaticTarget) run the target's own HF decoder layers
with their attention (dflash/models/targets/engine_attention.py): every layer's forward runs under the switch, the
switch is undone after each engine call (also one that raises), and an attention layer under the switch without
the engine's attend function refuses to run."""

from __future__ import annotations

import functools

import pytest
import torch

from dflash.inference.static_decode import static_generate
from dflash.inference.static_target import StaticTarget
from dflash.models.targets import build_tiny_target
from dflash.models.targets.engine_attention import (
    ENGINE_ATTENTION, AttendNotPassed, EngineCache, engine_attention, engine_attention_forward,
)
from dflash.models.targets.layout import TargetLayout


@pytest.fixture(scope="module")
def adapter():
    return build_tiny_target("qwen3", 0, tokenizer="builtin", initializer_range=0.2, num_hidden_layers=3)


def run_engines(adapter) -> None:
    """Both engines once: a prefill and decode steps of regeneration, a prefill and a verify of the live target."""
    static_generate(adapter, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_token_ids=[], pad_id=0, batch_size=2)
    target = StaticTarget(adapter, [1], capacity=32)
    target.forward([5, 6, 7])
    target.verify([8, 9])


def layer_configs(adapter) -> list:
    return list({id(m.config): m.config for m in adapter.decoder_layers().modules() if hasattr(m, "config")}.values())


def test_the_engines_run_each_hf_decoder_layer(adapter):
    calls: dict[int, list[tuple[int, str, bool]]] = {}

    def record(index, layer, args, kwargs):
        calls.setdefault(index, []).append(
            (args[0].shape[1], layer.self_attn.config._attn_implementation, callable(kwargs.get("engine_attend"))))

    layers = adapter.decoder_layers()
    handles = [layer.register_forward_pre_hook(functools.partial(record, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        run_engines(adapter)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(calls) == list(range(len(layers)))
    assert all(calls[i] == calls[0] for i in calls)
    widths = [width for width, _, _ in calls[0]]
    # regeneration: a prefill of 3 columns, one-token steps; the live target: a prefill of 3, a verify of 2
    assert widths[0] == 3 and 1 in widths and widths[-2:] == [3, 2]
    assert {(implementation, attend) for _, implementation, attend in calls[0]} == {(ENGINE_ATTENTION, True)}


def test_the_attention_switch_is_undone_after_each_engine_call(adapter):
    configs = layer_configs(adapter)
    before = [config._attn_implementation for config in configs]
    assert ENGINE_ATTENTION not in before
    run_engines(adapter)
    assert [config._attn_implementation for config in configs] == before

    def boom(layer, args):
        raise RuntimeError("boom")

    handle = adapter.decoder_layers()[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            static_generate(adapter, [[5, 6, 7]], max_new_tokens=2, stop_token_ids=[], pad_id=0, batch_size=1)
        assert [config._attn_implementation for config in configs] == before
        with pytest.raises(RuntimeError, match="boom"):
            StaticTarget(adapter, [], capacity=16).forward([5, 6])
        assert [config._attn_implementation for config in configs] == before
    finally:
        handle.remove()
    # The model's own forward (capture, the dynamic live target, HF generate) runs its own attention again.
    adapter.model(torch.tensor([[5, 6, 7]]))


def test_attention_under_the_switch_needs_the_engines_attend(adapter):
    before = adapter.config._attn_implementation
    with engine_attention(adapter.decoder_layers()):
        with pytest.raises(AttendNotPassed, match="without the static engine's attend function"):
            adapter.model(torch.tensor([[5, 6, 7]]))
    assert adapter.config._attn_implementation == before
    q = k = v = torch.zeros(1, 2, 3, 16)
    attn = adapter.decoder_layers()[0].self_attn
    with pytest.raises(ValueError, match=r"cannot apply the attention sinks \(s_aux\)"):
        engine_attention_forward(attn, q, k, v, None, engine_attend=lambda *a: q, s_aux=torch.zeros(2))


def test_the_window_and_soft_cap_go_to_the_attend_function(adapter):
    """A layer's sliding window and attention soft cap reach the engine's attend function, which masks by them."""
    q = k = v = torch.zeros(1, 2, 3, 16)
    attn = adapter.decoder_layers()[0].self_attn
    seen = []

    def attend(*args):
        seen.append(args[3:])
        return q

    engine_attention_forward(attn, q, k, v, None, scaling=0.25, engine_attend=attend, sliding_window=8, softcap=50.0)
    engine_attention_forward(attn, q, k, v, None, scaling=0.25, engine_attend=attend)
    assert seen == [(0.25, 8, 50.0), (0.25, None, None)]


def test_the_engines_run_the_target_only_through_the_adapters_forward(adapter, monkeypatch):
    """Every static-engine forward of the target is TargetAdapter.forward with an EngineCache: the layout's layer
    loop runs inside it only, and the engines' tokens, logits and features are those of an unwrapped run."""
    def outputs():
        tokens = static_generate(adapter, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_token_ids=[], pad_id=0,
                                 batch_size=2)
        target = StaticTarget(adapter, [1], capacity=32)
        return tokens, target.forward([5, 6, 7]), target.verify([8, 9])

    expected = outputs()
    caches, inside = [], []
    real_forward, real_run = adapter.forward, TargetLayout.run

    def forward(*args, **kwargs):
        caches.append(kwargs.get("cache"))
        inside.append(True)
        try:
            return real_forward(*args, **kwargs)
        finally:
            inside.pop()

    def run(*args, **kwargs):
        assert inside, "TargetLayout.run was called outside TargetAdapter.forward"
        return real_run(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", forward)
    monkeypatch.setattr(TargetLayout, "run", run)
    tokens, first, second = outputs()
    # regeneration: one prefill and 3 decode steps; the live target: a prefill and a verify
    assert len(caches) == 6 and all(isinstance(cache, EngineCache) for cache in caches)
    assert tokens == expected[0]
    for got, want in zip((*first, *second), (*expected[1], *expected[2])):
        assert torch.equal(got, want)
