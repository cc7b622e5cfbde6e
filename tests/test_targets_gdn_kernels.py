"""GDN kernel routing of hybrid targets (dflash/models/targets/gdn_kernels.py) and the capture path's inputs.

The conv is chosen per call from the input's device: on CPU inputs transformers' conv always runs; the choice of
fla's kernel for CUDA inputs and the router inside a real GDN forward are exercised on the CPU with fla's
availability mocked and a pure torch conv standing in for its kernel. The fla-vs-torch comparison needs CUDA and
flash-linear-attention.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

from dflash.models.targets import gdn_kernels, load_target
from dflash.models.targets.gdn_kernels import (
    CONV_GLOBAL, DEVICE_ROUTED_GLOBALS, FLA_CONV_NAME, UPDATE_GLOBAL, choose_causal_conv1d, conv_choice,
    describe_gdn_kernels, gdn_layers, route_causal_conv1d, transformers_conv,
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
    # A CPU model runs the torch reference even where fla is installed (its Triton kernels need CUDA inputs).
    assert "fla.ops" not in kernels["chunk"] and "chunk_gated_delta_rule" in kernels["chunk"]
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
    reference = gdn_kernels._torch_conv(modeling_qwen3_5.causal_conv1d_fn)  # torch fallback: no causal-conv1d here
    torch.testing.assert_close(conv(x, weight, None, activation="silu"), reference(x, weight, None, activation="silu"))
    torch.testing.assert_close(conv(x, weight), reference(x, weight))
    with pytest.raises(ValueError, match="packed sequences as cu_seq_lens_q, not seq_idx"):
        conv(x, weight, activation="silu", seq_idx=torch.zeros(2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed sequences come as one row, got a batch of 2"):
        conv(x, weight, activation="silu", cu_seq_lens_q=torch.tensor([0, 9, 18]))
    seen = []

    def packing_kernel(x, weight, bias=None, activation=None, cu_seqlens=None):
        seen.append(cu_seqlens.tolist())
        return shifted_conv(x, weight, bias, activation)

    offsets = torch.tensor([0, 4, 9])  # fla's kernel reads the offsets itself
    transformers_conv(packing_kernel)(x[:1], weight, activation="silu", cu_seq_lens_q=offsets)
    assert seen == [[0, 4, 9]]
    with pytest.raises(ValueError, match="activation silu/swish or none, got 'gelu'"):
        conv(x, weight, activation="gelu")


def test_the_conv_is_chosen_per_call_from_the_input_device(monkeypatch):
    """No GPU needed: a CUDA device object is enough to ask which conv a CUDA input would get."""
    torch_conv, fast = (lambda *args, **kwargs: "torch"), (lambda *args, **kwargs: "fla")
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: fast)  # fla importable
    assert choose_causal_conv1d(cpu, torch_conv) is torch_conv
    assert choose_causal_conv1d(cuda, torch_conv) is fast
    assert choose_causal_conv1d(cuda, torch_conv, "fla") is fast
    assert choose_causal_conv1d(cuda, torch_conv, "torch") is torch_conv
    with pytest.raises(RuntimeError, match="conv 'fla' needs flash-linear-attention installed.*on cpu"):
        choose_causal_conv1d(cpu, torch_conv, "fla")
    with pytest.raises(ValueError, match="unknown causal conv1d choice 'triton'"):
        choose_causal_conv1d(cuda, torch_conv, "triton")
    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: None)  # fla not importable
    assert choose_causal_conv1d(cuda, torch_conv) is torch_conv
    with pytest.raises(RuntimeError, match="conv 'fla' needs flash-linear-attention installed"):
        choose_causal_conv1d(cuda, torch_conv, "fla")


def test_packed_rows_run_the_torch_references_one_sequence_at_a_time():
    """transformers' torch conv and chunked gated delta rule ignore cu_seqlens (they would carry one sequence's
    states into the next); the routers split a packed row for them, on CPU inputs and where fla is missing."""
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 5, 6, 13])
    segments = [(0, 5), (5, 6), (6, 13)]
    x = torch.randn(1, 13, 8, generator=g).transpose(1, 2)  # [1, D, T]
    weight, bias = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    # The module globals may be routers already (any GDN model loaded in this process routes them).
    transformers_conv_fn = gdn_kernels._torch_conv(modeling_qwen3_5.causal_conv1d_fn)
    torch_conv = gdn_kernels.torch_reference(transformers_conv_fn)
    router = gdn_kernels._router(transformers_conv_fn)
    got = router(x, weight, bias, activation="silu", cu_seq_lens_q=offsets)
    expected = torch.cat([torch_conv(x[:, :, a:b], weight, bias, activation="silu") for a, b in segments], dim=2)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert (torch_conv(x, weight, bias, activation="silu") - expected).abs().max() > 1e-3  # it would leak

    q, k = (torch.randn(1, 13, 2, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 13, 2, 16, generator=g)
    gate, beta = -torch.rand(1, 13, 2, generator=g), torch.rand(1, 13, 2, generator=g)
    reference = gdn_kernels.torch_reference(gdn_kernels._kernel(modeling_qwen3_5.torch_chunk_gated_delta_rule))
    chunk = gdn_kernels._device_router(reference)
    out, state = chunk(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
    alone = torch.cat([reference(q[:, a:b], k[:, a:b], v[:, a:b], g=gate[:, a:b], beta=beta[:, a:b],
                                 use_qk_l2norm_in_kernel=True)[0] for a, b in segments], dim=1)
    assert state is None
    torch.testing.assert_close(out, alone, atol=0, rtol=0)
    whole = reference(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    assert (whole - alone).abs().max() > 1e-3
    with pytest.raises(ValueError, match="from a zero state, without final states"):
        chunk(q, k, v, g=gate, beta=beta, output_final_state=True, cu_seqlens=offsets)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                    reason="mocks fla's absence and presence; with fla installed its real kernels are routed "
                           "(test_fla_conv_matches_torch_conv_on_cuda covers them)")
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_router_picks_per_call_inside_the_gdn_forward(family, monkeypatch):
    """fla installed (mocked, a recording torch conv for its kernel): CPU inputs still run transformers' conv;
    treating the CPU as fla's device shows the router calls fla's kernel from every GDN layer, and that the
    adapter's choice ("torch") and a failing kernel leave nothing behind."""
    plain = tiny(family)
    ids, mask = padded_batch(256, [11, 6, 9])
    layer_ids = list(range(plain.num_layers))
    reference_logits, reference = plain.forward_with_features(ids, mask, layer_ids)
    reference_final = plain.capture_with_final(ids, mask, [0])[1]
    namespace = modeling_namespace(plain)
    original = namespace[CONV_GLOBAL]
    monkeypatch.setitem(namespace, CONV_GLOBAL, original)  # put transformers' kernels back after the test
    for name in DEVICE_ROUTED_GLOBALS:
        monkeypatch.setitem(namespace, name, namespace[name])
    calls: list[tuple] = []

    def recording(**kwargs):
        calls.append(tuple(kwargs["x"].shape))
        return shifted_conv(**kwargs)

    monkeypatch.setattr(gdn_kernels, "fla_installed", lambda: True)
    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: transformers_conv(recording))
    routed = tiny(family)
    router = namespace[CONV_GLOBAL]
    gdn = len(routed.linear_attention_layer_ids())
    assert router is original and hasattr(router, gdn_kernels._TORCH_CONV_ATTR)  # routed at load, fla or not
    kernels = [namespace[name] for name in DEVICE_ROUTED_GLOBALS if name in namespace]
    assert kernels and all(hasattr(k, gdn_kernels._KERNEL_ATTR) for k in kernels)  # device-routed as well
    assert route_causal_conv1d(routed.model) == gdn and namespace[CONV_GLOBAL] is router  # once per module
    torch_name = f"{type(gdn_layers(routed.model)[0]).__module__}.causal_conv1d_fn (torch reference)"
    assert routed.gdn_kernels()["conv"] == torch_name
    torch.testing.assert_close(routed.capture(ids, mask, layer_ids), reference, atol=0, rtol=0)
    assert calls == []  # CPU inputs: transformers' conv
    with pytest.raises(RuntimeError, match="needs flash-linear-attention installed and the GDN layers on a CUDA"):
        routed.set_gdn_conv("fla")

    monkeypatch.setattr(gdn_kernels, "FLA_DEVICE_TYPE", "cpu")  # CPU inputs now take fla's path
    assert routed.gdn_kernels()["conv"] == FLA_CONV_NAME
    logits, features = routed.forward_with_features(ids, mask, layer_ids)
    assert len(calls) == gdn and calls[0] == (3, 11, gdn_layers(routed.model)[0].conv1d.weight.shape[0])
    torch.testing.assert_close(features, reference, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=1e-4)

    calls.clear()
    assert routed.set_gdn_conv("torch")["conv"] == torch_name
    torch.testing.assert_close(routed.capture(ids, mask, layer_ids), reference, atol=0, rtol=0)
    assert calls == []  # the adapter's forwards run its choice ...
    with torch.no_grad():
        routed.model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(calls) == gdn  # ... other calls of the model run "auto"

    def failing(**kwargs):
        raise RuntimeError("conv failed")

    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: transformers_conv(failing))
    assert routed.set_gdn_conv("fla")["conv"] == FLA_CONV_NAME
    with pytest.raises(RuntimeError, match="conv failed"):
        routed.capture(ids, mask, [0])
    assert gdn_kernels._choice.get() == "auto"  # the adapter's choice ended with its forward
    with conv_choice("torch"), torch.no_grad():  # a direct call of the model runs the choice around it
        hidden = routed.text_model()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    torch.testing.assert_close(hidden, reference_final, atol=0, rtol=0)
    assert namespace[CONV_GLOBAL] is router


def test_device_routed_kernels_follow_the_input_device(monkeypatch):
    """transformers hands a GDN layer fla's gated-delta-rule kernels whenever fla is installed, and the causal-conv1d
    package's one-token conv update whenever that is installed, also for a model on the CPU; the router runs the
    torch reference the kernel wraps for CPU inputs and the kernel for CUDA inputs."""
    calls: list[str] = []

    def gated_delta_rule(query, key, value, g=None, beta=None):
        calls.append("reference")
        return query + 1

    def conv_update(hidden_states, conv_state, weight, bias=None, activation=None):
        calls.append("reference")
        return hidden_states + 1

    def kernel_of(reference):
        @functools.wraps(reference)
        def kernel(*args, **kwargs):
            calls.append("kernel")
            return reference(*args, **kwargs)
        return kernel

    q = torch.zeros(2)
    routers = [gdn_kernels._device_router(kernel_of(reference)) for reference in (gated_delta_rule, conv_update)]
    for router, reference in zip(routers, (gated_delta_rule, conv_update)):
        by_name = dict(zip(inspect.signature(reference).parameters, (q, q, q)))
        assert torch.equal(router(q, q, q), q + 1) and torch.equal(router(**by_name), q + 1)
    assert calls == ["reference"] * 4  # no kernel was entered
    monkeypatch.setattr(gdn_kernels, "FLA_DEVICE_TYPE", "cpu")  # CPU inputs now count as CUDA ones
    calls.clear()
    for router in routers:
        router(q, q, q)
    assert calls == ["kernel", "reference"] * 2


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                    reason="mocks fla's absence and presence; with fla installed its real kernels are routed")
@pytest.mark.parametrize("installed", ["fla_installed", "causal_conv1d_installed"])
def test_a_cpu_cached_decode_never_enters_the_conv_update_package(monkeypatch, installed):
    """The causal-conv1d package (a stand-in that fails on any call) installed, with or without fla (mocked): a CPU
    model's cached decode runs transformers' torch update and decodes what it decodes without them."""
    plain = tiny("qwen3_5")
    prompt = torch.tensor([[5, 9, 17, 33, 60, 7]])
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = plain.model.generate(prompt, **greedy)
    namespace = modeling_namespace(plain)
    for name in (CONV_GLOBAL, *DEVICE_ROUTED_GLOBALS):  # put transformers' kernels back after the test
        monkeypatch.setitem(namespace, name, namespace[name])
    torch_update = gdn_kernels.torch_reference(namespace[UPDATE_GLOBAL])

    @functools.wraps(torch_update)
    def package(*args, **kwargs):
        raise AssertionError("the CUDA-only causal-conv1d package ran on a CPU input")

    namespace[UPDATE_GLOBAL] = package
    with pytest.raises(AssertionError, match="CUDA-only"), torch.no_grad():  # unrouted, the package runs
        plain.model.generate(prompt, **greedy)
    monkeypatch.setattr(gdn_kernels, installed, lambda: True)
    routed = tiny("qwen3_5")
    assert hasattr(namespace[UPDATE_GLOBAL], gdn_kernels._KERNEL_ATTR)
    with torch.no_grad():
        assert torch.equal(routed.model.generate(prompt, **greedy), expected)


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


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
def test_fla_conv_matches_torch_conv_on_cuda():
    adapter = load_target("tiny", tiny={"family": "qwen3_5", "seed": 0, "tokenizer": "builtin"},
                          dtype="bfloat16", device="cuda")
    assert adapter.gdn_kernels()["conv"] == FLA_CONV_NAME  # "auto" at load
    # The same weights on the CPU (float32), in the same process: transformers' conv there, call by call.
    on_cpu = tiny("qwen3_5")
    assert on_cpu.gdn_kernels()["conv"] != FLA_CONV_NAME
    cpu_ids, cpu_mask = padded_batch(256, [300, 129, 64])
    ids, mask, real = cpu_ids.cuda(), cpu_mask.cuda(), cpu_mask.bool().cuda()
    layer_ids = [0, 3, 6]
    fast = adapter.capture(ids, mask, layer_ids)[real].float()
    exact = on_cpu.capture(cpu_ids, cpu_mask, layer_ids)[cpu_mask.bool()].to(fast.device)
    assert float((fast - exact).norm() / exact.norm()) < 2e-2
    torch_conv = adapter.set_gdn_conv("torch")["conv"]
    assert torch_conv != FLA_CONV_NAME and "causal_conv1d_fn" in torch_conv
    slow = adapter.capture(ids, mask, layer_ids)[real].float()
    assert float((fast - slow).norm() / slow.norm()) < 2e-2
    assert adapter.set_gdn_conv("fla")["conv"] == FLA_CONV_NAME


def test_off_cuda_the_conv_is_transformers_torch_code_itself(monkeypatch):
    """transformers' conv is a wrapper that runs the causal-conv1d package (CUDA-only) when it is installed: a
    non-CUDA input must get the torch function behind it, a CUDA input transformers' own choice."""
    def reference(x, weight, bias=None, activation=None):
        return x

    @functools.wraps(reference)
    def wrapper(*args, **kwargs):
        raise AssertionError("the CUDA-only package ran on a CPU input")

    monkeypatch.setattr(gdn_kernels, "fla_causal_conv1d", lambda: None)  # fla absent
    assert choose_causal_conv1d(torch.device("cpu"), wrapper) is reference
    assert choose_causal_conv1d(torch.device("cpu"), wrapper, "torch") is reference
    assert choose_causal_conv1d(torch.device("cuda"), wrapper) is wrapper


def test_a_broken_fla_install_falls_back_to_the_torch_conv(monkeypatch):
    def broken(name):
        raise RuntimeError(f"{name}: Triton is broken")

    gdn_kernels.fla_causal_conv1d.cache_clear()
    monkeypatch.setattr(gdn_kernels.importlib, "import_module", broken)
    try:
        assert gdn_kernels.fla_causal_conv1d() is None
    finally:
        gdn_kernels.fla_causal_conv1d.cache_clear()
