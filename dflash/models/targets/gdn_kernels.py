"""Which kernels the Gated DeltaNet (GDN) layers of a hybrid target run, and the choice of their causal conv1d.

transformers (5.17 and later) gives every GDN layer two kernels through globals of its modeling module:
`torch_chunk_gated_delta_rule` (flash-linear-attention's chunked kernel when `fla` is installed, else a torch
reference) and `causal_conv1d_fn` (the `causal_conv1d` package when installed, else a torch reference built on
F.conv1d). Where the `kernels` package is installed (transformers requires it from 5.25) each global is a `kernels`
function layer, an nn.Module whose forward calls the function (`function_of` looks through it); from 5.25 its
fallback wrapper already sends inputs on other devices to the torch reference, but raises on a packed row there.
The causal-conv1d package often has no wheel for the machine, while flash-linear-attention ships a Triton causal
conv1d of its own.

The conv is chosen on every call, from the input's device: `route_causal_conv1d` puts a router in front of the
modeling module's `causal_conv1d_fn` once (the global is never swapped back and forth), and
the router asks `choose_causal_conv1d` for each call: fla's Triton kernel for CUDA inputs, transformers' own conv
otherwise. So a model on the CPU computes what it computed before, a model placed over several devices gets the
right conv on each, and models on different devices in one process share no state that changes under them.
The gated-delta-rule kernels get a router of their own: fla's kernel for CUDA inputs, the torch reference
otherwise (transformers picks fla's whenever it is installed, even for a model on the CPU, where Triton fails).
So does `causal_conv1d_update`, the one-token conv of a cached decode: transformers takes it from the causal-conv1d
package (never from fla), whose kernel is CUDA-only too; CPU inputs get transformers' torch update.
Packed rows (several sequences end to end, offsets in `cu_seq_lens_q`; packed_attention.py): fla's conv and chunk
kernels take the offsets themselves; the torch references cannot, so the routers run them one sequence at a time.
`conv_choice("torch" | "fla")` overrides "auto" for the calls made inside it (a context variable: per thread,
restored on exit); HybridTargetAdapter applies its own choice around its forwards.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from dflash.models.targets.packed_attention import sequence_bounds

CONV_GLOBAL = "causal_conv1d_fn"
CHUNK_GLOBAL = "torch_chunk_gated_delta_rule"
# transformers' gated-delta-rule kernels: flash-linear-attention's Triton kernels whenever fla is installed, whatever
# device the model is on (a CPU model on a GPU machine would crash in Triton); the torch reference is `__wrapped__`.
FLA_KERNEL_GLOBALS = (CHUNK_GLOBAL, "torch_recurrent_gated_delta_rule")
# The cached decode's one-token conv: the causal-conv1d package's CUDA kernel whenever that package is installed.
UPDATE_GLOBAL = "causal_conv1d_update"
# The kernels routed per input device (_device_router): CUDA inputs run transformers' pick, others its torch reference.
DEVICE_ROUTED_GLOBALS = FLA_KERNEL_GLOBALS + (UPDATE_GLOBAL,)
CONV_CHOICES = ("auto", "fla", "torch")
FLA_CONV_NAME = "fla.modules.causal_conv1d (Triton)"
# The device type fla's Triton kernels run on.
FLA_DEVICE_TYPE = "cuda"
# On a router: the transformers conv it stands in front of (also the mark that a global is already routed).
_TORCH_CONV_ATTR = "_dflash_torch_conv"
# On a device router: the kernel transformers picked (fla's or causal-conv1d's when installed).
_KERNEL_ATTR = "_dflash_kernel"
# On a conv: it reads packed sequences' offsets (cu_seq_lens_q) itself, so the router need not split the row.
_PACKING_ATTR = "_dflash_packs"
_choice: ContextVar[str] = ContextVar("dflash_gdn_conv", default="auto")
_route_lock = threading.Lock()


def gdn_layers(model: nn.Module) -> list[nn.Module]:
    """The GDN (linear-attention) modules of a model: *GatedDeltaNet modules that own a depthwise `conv1d`."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet") and hasattr(m, "conv1d")]


def _namespace(layer: nn.Module) -> dict[str, Any]:
    return vars(sys.modules[type(layer).__module__])


def function_of(kernel: Any) -> Any:
    """The function behind a transformers kernel global: what a `kernels` function layer (an nn.Module whose
    forward calls the function, what each global is where the `kernels` package is installed) calls; `kernel`
    itself otherwise."""
    if not isinstance(kernel, nn.Module):
        return kernel
    try:
        return inspect.getclosurevars(type(kernel).forward).nonlocals.get("func", kernel)
    except TypeError:  # a forward that is not a plain Python function
        return kernel


def torch_reference(kernel: Any) -> Any:
    """transformers' own torch code behind a kernel global: its function layer and fallback wrapper looked
    through (the wrapper keeps the torch function as `__wrapped__`)."""
    return inspect.unwrap(function_of(kernel))


def implementation_name(function: Any) -> str:
    """`module.name` of the kernel behind a transformers kernel global (its function layer and fallback wrapper
    looked through), marked "(torch reference)" when it is transformers' own torch code."""
    if function is None:
        return "none"
    function = function_of(function)
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
        if seq_idx is not None:
            raise ValueError("the routed causal conv1d takes packed sequences as cu_seq_lens_q, not seq_idx")
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"the routed causal conv1d supports activation silu/swish or none, got {activation!r}")
        cu_seqlens = packed_offsets(kwargs)
        if cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"packed sequences come as one row, got a batch of {x.shape[0]}")
        # transformers' x is usually a transposed view of a contiguous [B, T, D] (transposing back costs no copy);
        # with a cache, x is the cached conv state concatenated in front, laid out [B, D, T]: then one copy.
        packing = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        y, _ = causal_conv1d(x=x.transpose(1, 2).contiguous(), weight=weight, bias=bias, activation=activation,
                             **packing)
        return y.transpose(1, 2)

    setattr(conv, _PACKING_ATTR, True)
    return conv


def packed_offsets(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The running offsets of a packed row ([N + 1]) among a GDN kernel call's keyword arguments, or None."""
    for key in ("cu_seq_lens_q", "cu_seqlens"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def conv_per_sequence(torch_conv: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      activation: str | None, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """transformers' torch conv (x [1, D, T]) run on each packed sequence alone: it has no notion of packing and
    would carry one sequence's last tokens into the next one's first outputs."""
    return torch.cat([torch_conv(x[:, :, start:end], weight, bias, activation=activation)
                      for start, end in sequence_bounds(cu_seqlens)], dim=2)


def chunk_rule_per_sequence(reference: Callable, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """transformers' torch chunked gated delta rule run on each packed sequence alone (it ignores cu_seqlens):
    inputs [1, T, heads, dim], every sequence starting from a zero state. Returns (output [1, T, ...], None)."""
    bound = inspect.signature(reference).bind(*args, **kwargs)
    call = dict(bound.arguments)
    extra = call.pop("kwargs", {})
    cu_seqlens = packed_offsets({**call, **extra})
    if call.get("initial_state") is not None or call.get("output_final_state"):
        raise ValueError("packed sequences are captured from a zero state, without final states")
    sliced = ("query", "key", "value", "g", "beta")
    outputs = []
    for start, end in sequence_bounds(cu_seqlens):
        segment = {k: (v[:, start:end] if k in sliced else v) for k, v in call.items()}
        outputs.append(reference(**segment)[0])
    return torch.cat(outputs, dim=1), None


def fla_installed() -> bool:
    """Whether flash-linear-attention can be imported (looked up without importing it)."""
    return importlib.util.find_spec("fla") is not None


def causal_conv1d_installed() -> bool:
    """Whether the causal-conv1d package can be imported: transformers then calls its CUDA-only kernels for the conv
    and the conv update, whatever the input's device."""
    return importlib.util.find_spec("causal_conv1d") is not None


@functools.cache
def fla_causal_conv1d() -> Callable | None:
    """flash-linear-attention's Triton causal conv1d behind transformers' `causal_conv1d_fn` signature, or None
    when fla is not installed. Imported on first use only (by then a CUDA input needs it)."""
    # As transformers does, any failure to import (a broken install too) falls back to the torch conv. The second
    # module is where fla releases before the rename kept it.
    for module in ("fla.modules.causal_conv1d", "fla.modules.convolution"):
        try:
            return transformers_conv(importlib.import_module(module).causal_conv1d)
        except Exception:  # noqa: BLE001
            continue
    return None


def _check_choice(conv: str) -> None:
    if conv not in CONV_CHOICES:
        raise ValueError(f"unknown causal conv1d choice {conv!r}; use one of {list(CONV_CHOICES)}")


def choose_causal_conv1d(device: torch.device, torch_conv: Callable, conv: str = "auto") -> Callable:
    """The causal conv1d for one call whose input is on `device`: fla's Triton kernel for a CUDA input when fla is
    installed (unless conv is "torch"), else `torch_conv` (transformers' own). conv "fla" raises RuntimeError
    where fla's kernel cannot run."""
    _check_choice(conv)
    on_cuda = device.type == FLA_DEVICE_TYPE
    fast = fla_causal_conv1d() if on_cuda and conv != "torch" else None
    if fast is not None:
        return fast
    if conv == "fla":
        raise RuntimeError(f"conv 'fla' needs flash-linear-attention installed and the input on a CUDA device; "
                           f"got an input on {device}, fla installed: {fla_installed()}")
    # Off CUDA transformers' torch code itself: its wrapper would pick the causal-conv1d package (CUDA-only).
    return torch_conv if on_cuda else torch_reference(torch_conv)


def _router(torch_conv: Callable) -> Callable:
    """A `causal_conv1d_fn` that runs the conv choose_causal_conv1d picks for each call."""

    # Kept out of torch.compile'd layers (compile_target): the choice reads a context variable, and fla's kernels
    # are autograd Functions launching autotuned Triton code that dynamo need not trace. The graph breaks here.
    @torch.compiler.disable
    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, **kwargs: Any) -> torch.Tensor:
        conv = choose_causal_conv1d(hidden_states.device, torch_conv, _choice.get())
        cu_seqlens = packed_offsets(kwargs)
        if cu_seqlens is not None and not hasattr(conv, _PACKING_ATTR):
            return conv_per_sequence(conv, hidden_states, weight, bias, activation, cu_seqlens)
        return conv(hidden_states, weight, bias, activation=activation, **kwargs)

    setattr(causal_conv1d_fn, _TORCH_CONV_ATTR, torch_conv)
    return causal_conv1d_fn


def _torch_conv(function: Any) -> Any:
    """transformers' conv behind a router, or `function` itself when it is not one."""
    return getattr(function, _TORCH_CONV_ATTR, function)


def _is_routed(layer: nn.Module) -> bool:
    return hasattr(_namespace(layer).get(CONV_GLOBAL), _TORCH_CONV_ATTR)


def _device_router(kernel: Callable) -> Callable:
    """`kernel` for CUDA inputs, its torch reference (what it wraps) for inputs on any other device. The input is
    the first argument (`query` of a gated-delta-rule kernel, `hidden_states` of the conv update)."""
    reference = torch_reference(kernel)
    kernel_packs = not implementation_name(kernel).endswith("(torch reference)")  # fla's kernels read cu_seqlens

    @torch.compiler.disable  # as the conv router: the graph of a compiled layer breaks here
    def device_routed(*args: Any, **kwargs: Any) -> Any:
        device = (args[0] if args else kwargs[next(iter(inspect.signature(reference).parameters))]).device
        on_kernel_device = device.type == FLA_DEVICE_TYPE
        if kwargs.get("cu_seqlens") is not None and not (on_kernel_device and kernel_packs):
            # The torch reference would ignore cu_seqlens and carry states across sequences, silently.
            return chunk_rule_per_sequence(reference, args, kwargs)
        return (kernel if on_kernel_device else reference)(*args, **kwargs)

    setattr(device_routed, _KERNEL_ATTR, kernel)
    return device_routed


def _kernel(function: Any) -> Any:
    """The kernel behind a device router, or `function` itself when it is not one."""
    return getattr(function, _KERNEL_ATTR, function)


def route_causal_conv1d(model: nn.Module) -> int:
    """Put routers in front of the GDN kernels in the modeling modules of `model`'s GDN layers (once per module):
    `causal_conv1d_fn` picks its conv per call (choose_causal_conv1d), and the gated-delta-rule kernels and the
    conv update run transformers' pick on CUDA inputs and the torch reference on others. Returns how many GDN layers
    call a routed conv. Routed also with neither fla nor causal-conv1d installed: transformers' torch code then runs
    on every device, but a packed row (cu_seq_lens_q) still goes through it one sequence at a time."""
    routed = 0
    with _route_lock:  # two loads at once must not put a router in front of a router
        for layer in gdn_layers(model):
            namespace = _namespace(layer)
            for name in DEVICE_ROUTED_GLOBALS:
                if name in namespace and not hasattr(namespace[name], _KERNEL_ATTR):
                    namespace[name] = _device_router(namespace[name])
            if CONV_GLOBAL not in namespace:  # a release that calls its conv some other way: left alone
                continue
            if not hasattr(namespace[CONV_GLOBAL], _TORCH_CONV_ATTR):
                namespace[CONV_GLOBAL] = _router(namespace[CONV_GLOBAL])
            routed += 1
    return routed


@contextmanager
def conv_choice(conv: str) -> Iterator[None]:
    """Run the GDN causal convs called inside with `conv` ("auto", "fla" or "torch"); per thread."""
    _check_choice(conv)
    token = _choice.set(conv)
    try:
        yield
    finally:
        _choice.reset(token)


def check_conv_choice(model: nn.Module, conv: str) -> None:
    """ValueError for an unknown choice; RuntimeError for "fla" unless every GDN layer of `model` is routed, on
    CUDA, and fla's kernel imports."""
    _check_choice(conv)
    if conv != "fla":
        return
    layers = gdn_layers(model)
    routed = sum(_is_routed(layer) for layer in layers)
    on_cuda = bool(layers) and all(layer.conv1d.weight.device.type == FLA_DEVICE_TYPE for layer in layers)
    if not (layers and routed == len(layers) and on_cuda and fla_causal_conv1d() is not None):
        raise RuntimeError(
            "conv 'fla' needs flash-linear-attention installed and the GDN layers on a CUDA device "
            f"({len(layers)} GDN layers found, {routed} calling a routed `{CONV_GLOBAL}`, on CUDA: {on_cuda}, "
            f"fla installed: {fla_installed()})"
        )


def describe_gdn_kernels(model: nn.Module, conv: str = "auto") -> dict[str, str]:
    """{"conv": ..., "chunk": ...}: the causal conv1d (under choice `conv`) and the chunked gated-delta-rule kernel
    the GDN layers of `model` run on a prefill, where their weights are now (several names joined by " + " when
    layers differ); empty for a model without GDN."""
    convs: list[str] = []
    chunks: list[str] = []
    for layer in gdn_layers(model):
        namespace = _namespace(layer)
        torch_conv = _torch_conv(namespace.get(CONV_GLOBAL))
        fla_runs = (_is_routed(layer) and conv != "torch" and layer.conv1d.weight.device.type == FLA_DEVICE_TYPE
                    and fla_causal_conv1d() is not None)
        name = FLA_CONV_NAME if fla_runs else implementation_name(torch_conv)
        chunk_global = namespace.get(CHUNK_GLOBAL)
        kernel = _kernel(chunk_global)
        on_reference = hasattr(chunk_global, _KERNEL_ATTR) and layer.conv1d.weight.device.type != FLA_DEVICE_TYPE
        chunk = implementation_name(torch_reference(kernel) if on_reference else kernel)
        convs += [name] if name not in convs else []
        chunks += [chunk] if chunk not in chunks else []
    return {"conv": " + ".join(convs), "chunk": " + ".join(chunks)} if convs else {}
