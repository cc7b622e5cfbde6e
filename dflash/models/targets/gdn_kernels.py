"""Which kernels the Gated DeltaNet (GDN) layers of a hybrid target run, and routing their causal conv1d.

transformers (5.17 .. 5.24) gives every GDN layer two kernels through globals of its modeling module:
`torch_chunk_gated_delta_rule` (flash-linear-attention's chunked kernel when `fla` is installed, else a torch
reference) and `causal_conv1d_fn` (the `causal_conv1d` package when installed, else a torch reference built on
F.conv1d). The causal-conv1d package often has no wheel for the machine, while flash-linear-attention ships a Triton
causal conv1d of its own; `set_causal_conv1d` makes the GDN layers of ONE loaded model use it.

How, without patching transformers for the whole process: each GDN layer of the model gets its own `forward`
(an instance attribute, like accelerate's hooks) that puts the chosen conv into the modeling module's
`causal_conv1d_fn` global only while that layer runs and puts the previous value back afterwards. Other models in
the process keep transformers' choice; the one caveat is a second thread running a GDN layer of the same family at
that very moment, which would get the same (numerically equivalent) conv.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CONV_GLOBAL = "causal_conv1d_fn"
CHUNK_GLOBAL = "torch_chunk_gated_delta_rule"
CONV_CHOICES = ("auto", "fla", "torch")
# Per-layer attributes: the conv a routed layer runs ((name, function) or None) and the forward its routed
# forward wraps (also the mark that a layer's forward is already wrapped).
_ROUTE_ATTR = "_dflash_causal_conv1d"
_WRAPPED_ATTR = "_dflash_forward_before_routing"
FLA_CONV_NAME = "fla.modules.causal_conv1d (Triton)"


def gdn_layers(model: nn.Module) -> list[nn.Module]:
    """The GDN (linear-attention) modules of a model: *GatedDeltaNet modules that own a depthwise `conv1d`."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet") and hasattr(m, "conv1d")]


def _namespace(layer: nn.Module) -> dict[str, Any]:
    return vars(sys.modules[type(layer).__module__])


def implementation_name(function: Any) -> str:
    """`module.name` of the kernel behind a transformers kernel global (its fallback wrapper looked through),
    marked "(torch reference)" when it is transformers' own torch code."""
    if function is None:
        return "none"
    try:
        inner = inspect.getclosurevars(function).nonlocals.get("implementation", function)
    except TypeError:  # not a plain Python function (a kernels-hub layer, a C extension)
        inner = function
    module = getattr(inner, "__module__", None) or "?"
    name = f"{module}.{getattr(inner, '__name__', type(inner).__name__)}"
    return f"{name} (torch reference)" if module.startswith("transformers.") else name


def transformers_conv(causal_conv1d: Callable) -> Callable:
    """A conv with transformers' `causal_conv1d_fn` signature (x [B, D, T] -> [B, D, T]) built on an fla-style
    `causal_conv1d(x=[B, T, D], weight=[D, W], bias, activation) -> (y [B, T, D], final_state)`."""

    def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str | None = None, seq_idx: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        packed = [k for k in ("cu_seq_lens_q", "cu_seqlens") if kwargs.get(k) is not None]
        if seq_idx is not None or packed:
            raise ValueError(f"the routed causal conv1d takes right-padded batches only, got packed-sequence "
                             f"arguments {packed or ['seq_idx']}; use set_causal_conv1d(model, 'torch')")
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"the routed causal conv1d supports activation silu/swish or none, got {activation!r}")
        # transformers' x is usually a transposed view of a contiguous [B, T, D] (transposing back costs no copy);
        # with a cache, x is the cached conv state concatenated in front, laid out [B, D, T]: then one copy.
        y, _ = causal_conv1d(x=x.transpose(1, 2).contiguous(), weight=weight, bias=bias, activation=activation)
        return y.transpose(1, 2)

    return conv


def fla_causal_conv1d() -> Callable | None:
    """flash-linear-attention's Triton causal conv1d behind transformers' `causal_conv1d_fn` signature, or None
    when fla is not installed or there is no CUDA device."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        try:  # fla releases before the module was renamed
            from fla.modules.convolution import causal_conv1d
        except ImportError:
            return None
    return transformers_conv(causal_conv1d)


def runs_on_cuda(layer: nn.Module) -> bool:
    """Whether a GDN layer's weights are on a CUDA device (only those are routed)."""
    return layer.conv1d.weight.is_cuda


def _routed_forward(layer: nn.Module, forward: Callable) -> Callable:
    namespace = _namespace(layer)

    @functools.wraps(forward)
    def routed(*args: Any, **kwargs: Any) -> Any:
        route = layer.__dict__.get(_ROUTE_ATTR)
        if route is None or not runs_on_cuda(layer):
            return forward(*args, **kwargs)
        previous = namespace[CONV_GLOBAL]
        namespace[CONV_GLOBAL] = route[1]
        try:
            return forward(*args, **kwargs)
        finally:
            namespace[CONV_GLOBAL] = previous

    return routed


def set_causal_conv1d(model: nn.Module, conv: str = "auto") -> str:
    """Choose the causal conv1d of `model`'s GDN layers; returns the name of the conv they now run.

    "fla": flash-linear-attention's Triton kernel (RuntimeError when fla or CUDA is missing or the model is not on
    CUDA); "torch": transformers' own choice (its torch reference unless the causal-conv1d package is installed);
    "auto": "fla" when the GDN layers are on CUDA and fla is importable, else "torch". Only CUDA layers are routed,
    so a model on the CPU is left exactly as loaded.
    """
    if conv not in CONV_CHOICES:
        raise ValueError(f"unknown causal conv1d choice {conv!r}; use one of {list(CONV_CHOICES)}")
    found = gdn_layers(model)
    # Only layers whose transformers module calls the conv through the global can be routed.
    layers = [layer for layer in found if CONV_GLOBAL in _namespace(layer)]
    on_cuda = bool(layers) and all(runs_on_cuda(layer) for layer in layers)
    fast = fla_causal_conv1d() if on_cuda and conv != "torch" else None
    if conv == "fla" and fast is None:
        raise RuntimeError(
            "conv 'fla' needs flash-linear-attention installed and the GDN layers on a CUDA device "
            f"({len(found)} GDN layers found, {len(layers)} calling `{CONV_GLOBAL}`, on CUDA: {on_cuda}, "
            f"CUDA available: {torch.cuda.is_available()})"
        )
    for layer in layers:
        if fast is None:
            if _ROUTE_ATTR in layer.__dict__:
                layer.__dict__[_ROUTE_ATTR] = None
            continue
        if _WRAPPED_ATTR not in layer.__dict__:
            forward = layer.forward
            layer.__dict__[_WRAPPED_ATTR] = forward
            layer.forward = _routed_forward(layer, forward)
        layer.__dict__[_ROUTE_ATTR] = (FLA_CONV_NAME, fast)
    return describe_gdn_kernels(model).get("conv", "none")


def describe_gdn_kernels(model: nn.Module) -> dict[str, str]:
    """{"conv": ..., "chunk": ...}: the causal conv1d and the chunked gated-delta-rule kernel the GDN layers of
    `model` run on a prefill (several names joined by " + " when layers differ); empty for a model without GDN."""
    convs: list[str] = []
    chunks: list[str] = []
    for layer in gdn_layers(model):
        namespace = _namespace(layer)
        route = layer.__dict__.get(_ROUTE_ATTR)
        conv = route[0] if route is not None and runs_on_cuda(layer) else implementation_name(
            namespace.get(CONV_GLOBAL))
        chunk = implementation_name(namespace.get(CHUNK_GLOBAL))
        convs += [conv] if conv not in convs else []
        chunks += [chunk] if chunk not in chunks else []
    return {"conv": " + ".join(convs), "chunk": " + ".join(chunks)} if convs else {}
