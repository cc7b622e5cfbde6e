"""Attention over packed sequences for capture: several sequences laid end to end in one row, no padding.

A packed capture runs the target on a single row [1, T] holding N sequences back to back, described by
`cu_seqlens` (int64 [N + 1], the running offsets). Each token must attend causally within its own sequence only,
which no dense mask does cheaply (a [T, T] block-diagonal mask makes SDPA compute every block of the row). While
`packed_attention(model)` is active, the model's attention layers run `packed_attention_forward`, registered with
transformers' AttentionInterface under PACKED_ATTENTION:
  * CUDA, bf16/fp16: FlashAttention's variable-length kernel through `torch.ops.aten._flash_attention_forward`
    (the kernel behind SDPA's flash backend; it reads `cu_seqlens` and never computes across sequences);
  * anywhere else (the CPU, float32): causal SDPA on each sequence in turn. Slow, exact, and what the CPU tests
    compare against one-sequence-at-a-time forwards.
Sliding-window layers (a Mistral-style `sliding_window`) keep their window on both paths.
A call without `cu_seq_lens_q` (an ordinary padded batch reaching a model switched to this implementation) runs
transformers' SDPA, so nothing else changes meaning. Because the name has no mask function registered,
transformers builds no attention mask for it at all: no [T, T] mask is made for a packed row.

The GDN layers of hybrid targets read the same `cu_seq_lens_q` argument (gdn_kernels.py routes it to fla's kernels
on CUDA and runs the torch references one sequence at a time elsewhere), so their recurrent and conv states restart
at every sequence boundary as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash.models.targets.attention_switch import attention_implementation

PACKED_ATTENTION = "dflash_packed"
# FlashAttention's kernels take half precision only.
FLASH_DTYPES = (torch.bfloat16, torch.float16)
# The longest sequence of the packed row being run, known on the host (packed_attention): the kernel needs it, and
# reading it from cu_seqlens would make the host wait for the device in every attention layer. A context variable
# rather than a layer argument, so compiled layers neither specialise on it nor recompile for each row.
_max_length: ContextVar[int | None] = ContextVar("dflash_packed_max_length", default=None)
# True inside packed_attention(): a call without offsets there is a layer that did not pass them on.
_packing: ContextVar[bool] = ContextVar("dflash_packing", default=False)


class OffsetsNotPassed(ValueError):
    """A decoder layer of the target called its attention without the packed row's offsets (it does not pass its
    keyword arguments on, as StableLM's layers do): the row would attend across its sequences."""


def sequence_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each sequence of a packed row, from its running offsets (read on the host)."""
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


@torch.compiler.disable  # a graph break around the kernel call: it reads a context variable (the row's max length)
def _flash_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float | None, window: int | None) -> torch.Tensor:
    max_length = _max_length.get()
    if max_length is None:  # called outside packed_attention: ask the device
        max_length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    offsets = cu_seqlens.to(torch.int32)
    # A query sees the `window` latest keys, itself included (transformers' sliding-window masks).
    sliding = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    return torch.ops.aten._flash_attention_forward(
        query, key, value, offsets, offsets, max_length, max_length, 0.0, True, False, scale=scale, **sliding,
    )[0]


@torch.compiler.disable  # a host loop over the sequences: compiled, it would specialise on their number
def _per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float | None, window: int | None) -> torch.Tensor:
    """Causal SDPA (within `window` keys when set) on each sequence of the row in turn; q/k/v and the result are
    [T, heads, dim]."""
    outputs = []
    for start, end in sequence_bounds(cu_seqlens):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [heads, L, dim]
        gqa = dict(scale=scale, enable_gqa=q.shape[0] != k.shape[0])
        if window is None or end - start <= window:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        else:
            distance = torch.arange(end - start)[:, None] - torch.arange(end - start)[None, :]
            visible = ((distance >= 0) & (distance < window)).to(q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, **gqa)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs, dim=0)


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [1, Hq, T, D], k/v [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None and _packing.get():
        raise OffsetsNotPassed(f"{type(module).__name__} was called without the packed row's offsets")
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed forward takes one row of sequences laid end to end, got a batch of "
                         f"{query.shape[0]} rows")
    unsupported = [name for name in ("s_aux", "softcap") if kwargs.get(name) is not None]
    if unsupported:  # attention sinks, soft-capped scores: a packed forward would silently differ
        raise ValueError(f"packed attention cannot apply {unsupported} of {type(module).__name__}; capture this "
                         "target unpacked (TargetAdapter.packing_problem)")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    # [1, heads, T, D] -> [T, heads, D]: a view, with the head dim still contiguous as the kernels need.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if q.is_cuda and q.dtype in FLASH_DTYPES:
        out = _flash_varlen(q, k, v, cu_seqlens, scaling, window)
    else:
        out = _per_sequence(q, k, v, cu_seqlens, scaling, window)
    return out.unsqueeze(0), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


@contextlib.contextmanager
def packed_attention(model: nn.Module, max_length: int | None = None) -> Iterator[None]:
    """Run `model`'s attention layers with packed_attention_forward inside the block, for packed rows whose
    longest sequence has `max_length` tokens (None: read from cu_seqlens on every call); the implementation each
    config had is restored after it (also when the forward raises)."""
    token, packing = _max_length.set(max_length), _packing.set(True)
    try:
        with attention_implementation(model, PACKED_ATTENTION):
            yield
    finally:
        _max_length.reset(token)
        _packing.reset(packing)
