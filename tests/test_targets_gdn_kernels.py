"""GDN kernel routing of hybrid targets (dflash/models/targets/gdn_kernels.py) and the capture path's inputs.

On the CPU the fla route must never be applied; the routing machinery itself is exercised on the CPU with a pure
torch conv standing in for fla's kernel. The fla-vs-torch comparison needs CUDA and flash-linear-attention.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash.models.targets import gdn_kernels, load_target
from dflash.models.targets.gdn_kernels import (
    CONV_GLOBAL, FLA_CONV_NAME, describe_gdn_kernels, gdn_layers, transformers_conv,
)

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def tiny(family: str, **kwargs):
    return load_target("tiny", tiny={"family": family, "seed": 0, "tokenizer": "builtin", **kwargs})


def padded_batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def shifted_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None) -> tuple[torch.Tensor, None]:
    """A causal depthwise conv on [B, T, D] written as a sum of shifted copies (fla's calling convention)."""
    width, length = weight.shape[1], x.shape[1]
    padded = F.pad(x, (0, 0, width - 1, 0))
    y = sum(padded[:, k:k + length] * weight[:, k] for k in range(width))
    y = y + bias if bias is not None else y
    return (F.silu(y) if activation else y), None


def modeling_namespace(adapter) -> dict:
    return vars(sys.modules[type(gdn_layers(adapter.model)[0]).__module__])


@pytest.mark.parametrize("family", HYBRIDS)
def test_cpu_model_is_left_as_loaded(family):
    adapter = tiny(family, num_hidden_layers=4)
    layers = gdn_layers(adapter.model)
    assert len(layers) == len(adapter.linear_attention_layer_ids()) == 3
    touched = [name for name, m in adapter.model.named_modules() if "forward" in vars(m)
               or any(key.startswith("_dflash") for key in vars(m))]
    assert touched == []
    kernels = adapter.gdn_kernels()
    assert kernels["conv"] == f"{type(layers[0]).__module__}.causal_conv1d_fn (torch reference)"
    fla = importlib.util.find_spec("fla") is not None
    assert ("fla.ops" in kernels["chunk"]) == fla and "chunk_gated_delta_rule" in kernels["chunk"]
    with pytest.raises(RuntimeError, match="needs flash-linear-attention installed and the GDN layers on a CUDA"):
        adapter.set_gdn_conv("fla")
    with pytest.raises(ValueError, match="unknown causal conv1d choice 'triton'"):
        adapter.set_gdn_conv("triton")
    assert adapter.set_gdn_conv("torch") == kernels
    assert not any("forward" in vars(layer) for layer in layers)


def test_dense_model_has_no_gdn_kernels(tiny_target):
    assert describe_gdn_kernels(tiny_target("llama").model) == {}


def test_transformers_conv_matches_the_torch_reference():
    conv = transformers_conv(shifted_conv)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 6, generator=g).transpose(1, 2)  # transformers' layout: a [B, D, T] view
    weight = torch.randn(6, 4, generator=g)
    reference = modeling_qwen3_5.causal_conv1d_fn  # the torch fallback here: causal-conv1d is not installed
    torch.testing.assert_close(conv(x, weight, None, activation="silu"), reference(x, weight, None, activation="silu"))
    torch.testing.assert_close(conv(x, weight), reference(x, weight))
    with pytest.raises(ValueError, match="right-padded batches only.*seq_idx"):
        conv(x, weight, activation="silu", seq_idx=torch.zeros(2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        conv(x, weight, activation="silu", cu_seq_lens_q=torch.tensor([0, 9, 18]))
    with pytest.raises(ValueError, match="activation silu/swish or none, got 'gelu'"):
        conv(x, weight, activation="gelu")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_routing_is_per_model_and_restores_the_global(family, monkeypatch):
    """The route machinery on the CPU: a recording torch conv stands in for fla, the CUDA check is lifted."""
    plain, routed = tiny(family), tiny(family)
    calls: list[tuple] = []

    def recording(**kwargs):
        calls.append(tuple(kwargs["x"].shape))
        return shifted_conv(**kwargs)

    monkeypatch.setattr(gdn_kernels, "runs_on_cuda", lambda layer: True)
    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: transformers_conv(recording))
    namespace = modeling_namespace(routed)
    original = namespace[CONV_GLOBAL]
    assert routed.set_gdn_conv("fla")["conv"] == FLA_CONV_NAME
    ids, mask = padded_batch(256, [11, 6, 9])
    layer_ids = list(range(routed.num_layers))
    logits, features = routed.forward_with_features(ids, mask, layer_ids)
    assert len(calls) == len(routed.linear_attention_layer_ids()) and calls[0] == (3, 11, gdn_layers(routed.model)[0]
                                                                                   .conv1d.weight.shape[0])
    assert namespace[CONV_GLOBAL] is original
    reference_logits, reference = plain.forward_with_features(ids, mask, layer_ids)
    assert len(calls) == len(routed.linear_attention_layer_ids())  # the other model kept transformers' conv
    torch.testing.assert_close(features, reference, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=1e-4)

    def failing(**kwargs):
        raise RuntimeError("conv failed")

    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: transformers_conv(failing))
    routed.set_gdn_conv("fla")
    with pytest.raises(RuntimeError, match="conv failed"):
        routed.capture(ids, mask, [0])
    assert namespace[CONV_GLOBAL] is original
    calls.clear()
    assert routed.set_gdn_conv("torch")["conv"] == (
        f"{type(gdn_layers(routed.model)[0]).__module__}.causal_conv1d_fn (torch reference)")
    torch.testing.assert_close(routed.capture(ids, mask, layer_ids), plain.capture(ids, mask, layer_ids))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_capture_can_leave_the_padding_mask_out(family):
    """Right padding under a causal mask: with drop_padding_mask (the default on CUDA) no mask reaches the model
    (no [b,1,T,T] mask, causal SDPA), and real positions still equal one unpadded sequence at a time. The CPU
    default keeps the mask."""
    adapter = tiny(family)
    seen: list = []
    handle = adapter.text_model().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    ids, mask = padded_batch(256, [12, 5])
    layer_ids = [0, 3, 6]
    try:
        adapter.capture(ids, mask, layer_ids)
        assert seen[-1] is mask  # CPU default: the mask is passed on, CPU results unchanged
        adapter.drop_padding_mask = True
        features, final = adapter.capture_with_final(ids, mask, layer_ids)
        dropped = adapter.capture(ids, mask, layer_ids)
    finally:
        handle.remove()
    assert seen[1:] == [None, None]
    for row, length in enumerate(mask.sum(dim=1).tolist()):
        alone, alone_final = adapter.capture_with_final(ids[row:row + 1, :length], None, layer_ids)
        torch.testing.assert_close(features[row:row + 1, :length], alone, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(dropped[row:row + 1, :length], alone, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(final[row:row + 1, :length], alone_final, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and flash-linear-attention")
def test_fla_conv_matches_torch_conv_on_cuda():
    adapter = load_target("tiny", tiny={"family": "qwen3_5", "seed": 0, "tokenizer": "builtin"},
                          dtype="bfloat16", device="cuda")
    assert adapter.gdn_kernels()["conv"] == FLA_CONV_NAME  # "auto" at load
    ids, mask = padded_batch(256, [300, 129, 64])
    ids, mask, real = ids.cuda(), mask.cuda(), mask.bool().cuda()
    layer_ids = [0, 3, 6]
    fast = adapter.capture(ids, mask, layer_ids)[real].float()
    torch_conv = adapter.set_gdn_conv("torch")["conv"]
    assert torch_conv != FLA_CONV_NAME and "causal_conv1d_fn" in torch_conv
    slow = adapter.capture(ids, mask, layer_ids)[real].float()
    assert float((fast - slow).norm() / slow.norm()) < 2e-2
    assert adapter.set_gdn_conv("fla")["conv"] == FLA_CONV_NAME
