"""compile_target_layers: compiled target layers capture what the eager ones did, once compiled (CPU, inductor)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dflash.models.targets import load_target
from dflash.models.targets.compile_target import compile_target_layers, target_layers_compiled

# Two layers each; the qwen3_5 pair is one GDN layer and one full-attention layer, the two kinds of the 27B target.
TINY = {
    "llama": {"num_hidden_layers": 2},
    "qwen3_5": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
}


def right_padded(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(width)
    ids = torch.randint(4, 200, (2, width), generator=generator)
    mask = torch.ones(2, width, dtype=torch.long)
    mask[1, width - 3:] = 0
    return ids, mask


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Graphs that an earlier test compiled for the same layer code would be reused, and counted as none here."""
    torch._dynamo.reset()


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.slow
def test_compiled_layers_capture_the_eager_features(one_thread, family):
    target = load_target("tiny", tiny={"family": family, "seed": 0, "tokenizer": "builtin", **TINY[family]})
    taps = [0, 1]
    widths = (9, 14)  # two padded lengths: one dynamic-shape graph must serve both
    names = [name for name, _ in target.model.named_parameters()]
    eager = {w: target.capture(*right_padded(w), taps) for w in widths}
    eager_logits, eager_features = target.forward_with_features(*right_padded(9), taps)

    before = graphs()
    assert compile_target_layers(target) == target.num_layers
    for width in widths:
        torch.testing.assert_close(target.capture(*right_padded(width), taps), eager[width], rtol=1e-5, atol=1e-5)
    logits, features = target.forward_with_features(*right_padded(9), taps)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(features, eager_features, rtol=1e-5, atol=1e-5)
    assert graphs() > before, "no layer ran a compiled graph"
    assert [name for name, _ in target.model.named_parameters()] == names

    # Applying it again wraps nothing twice, and the same shapes run the graphs already compiled.
    forwards = [layer.forward for layer in target.decoder_layers()]
    compiled_graphs = graphs()
    assert compile_target_layers(target) == 0
    assert [layer.forward for layer in target.decoder_layers()] == forwards
    for width in widths:
        torch.testing.assert_close(target.capture(*right_padded(width), taps), eager[width], rtol=1e-5, atol=1e-5)
    assert graphs() == compiled_graphs, "the second application or a repeated shape recompiled"


def test_the_block_compiles_the_layers_and_gives_the_eager_ones_back(one_thread):
    target = load_target("tiny", tiny={"family": "llama", "seed": 0, "tokenizer": "builtin", **TINY["llama"]})
    eager_forwards = [layer.forward for layer in target.decoder_layers()]
    ids, mask = right_padded(9)
    eager = target.capture(ids, mask, [0, 1])
    with target_layers_compiled(target, enabled=False):
        assert [layer.forward for layer in target.decoder_layers()] == eager_forwards
    before = graphs()
    with target_layers_compiled(target):
        assert all(layer.forward != forward for layer, forward in zip(target.decoder_layers(), eager_forwards))
        torch.testing.assert_close(target.capture(ids, mask, [0, 1]), eager, rtol=1e-5, atol=1e-5)
    assert graphs() > before
    assert [layer.forward for layer in target.decoder_layers()] == eager_forwards  # the eval stage runs these
    assert all("forward" not in vars(layer) for layer in target.decoder_layers())
    assert compile_target_layers(target) == target.num_layers  # not marked compiled any more


def test_offline_capture_runs_inside_the_block_when_asked(tmp_path, monkeypatch):
    from dflash.config import compose
    from dflash.models.targets import compile_target
    from dflash.pipeline import Pipeline

    entered = []
    real = compile_target.target_layers_compiled

    def recording(adapter, enabled=True):
        entered.append(enabled)
        return real(adapter, enabled=False)  # the wiring is under test here, not the compiler

    monkeypatch.setattr(compile_target, "target_layers_compiled", recording)
    for flag in ("false", "true"):
        Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path / flag}",
                          "stages=[data,capture]", f"capture.compile={flag}"])).run()
    assert entered == [False, True]


def test_a_placed_target_keeps_its_device_hooks_and_a_failed_compile_leaves_nothing(monkeypatch):
    """A target placed over several devices has accelerate's wrapper as every layer's instance forward (it moves
    the inputs to the layer's device): the block must give that wrapper back, not the class's forward."""
    target = load_target("tiny", tiny={"family": "llama", "seed": 0, **TINY["llama"]}, device=["cpu", "cpu"])
    wrappers = [vars(layer)["forward"] for layer in target.decoder_layers()]
    with target_layers_compiled(target):
        assert [vars(layer)["forward"] for layer in target.decoder_layers()] != wrappers
    assert [vars(layer)["forward"] for layer in target.decoder_layers()] == wrappers

    real, calls = torch.compile, []

    def fails_on_the_second_layer(function, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("inductor failed")
        return real(function, **kwargs)

    monkeypatch.setattr(torch, "compile", fails_on_the_second_layer)
    with pytest.raises(RuntimeError, match="inductor failed"):
        with target_layers_compiled(target):
            pass
    assert [vars(layer)["forward"] for layer in target.decoder_layers()] == wrappers
