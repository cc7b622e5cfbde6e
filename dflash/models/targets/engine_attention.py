"""The static engines' attention inside the target's own HF decoder layers.

The static engines of dflash/inference/ (static_decode.py, static_target.py) run the target through
TargetAdapter.forward with an EngineCache, which runs TargetLayout.run (layout.py): each decoder layer's own forward
(norms, projections, q_norm/k_norm, RoPE, o_proj, MLP, residuals). The engines keep only the attention: they own the
KV cache and decide what a query attends over (a prefill, a decode step, a verify). While `engine_attention(layers)`
is active, those layers' attention modules call `engine_attention_forward`, registered with transformers'
AttentionInterface under ENGINE_ATTENTION, which hands q, k and v to the function TargetLayout.run passed to the
decoder layer as the keyword `engine_attend` (the engine's function, bound to the layer's index): HF's decoder
layers pass their keyword arguments on to the attention module, and that to its attention function. The name has no
mask function registered; the engines never run the model's own forward, so no mask is built for it, and their
attend functions apply their own: causal, within the layer's sliding window when it has one, with the
attention-logit soft cap when the layer passes one (Gemma 2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import AttentionInterface

from dflash.models.targets.attention_switch import attention_implementation

ENGINE_ATTENTION = "dflash_engine"

# attend(q [b, H, t, D], k and v [b, kv, t, D], scaling, sliding window or None, soft cap or None) -> context
# [b, t, H, D]: writes the layer's cache and attends over it.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int | None, float | None], torch.Tensor]
# The same with the decoder layer's index first: what an engine hands TargetLayout.run for all its layers.
LayerAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float, int | None, float | None], torch.Tensor]


class EngineCache(NamedTuple):
    """A static engine's KV cache as TargetAdapter.forward takes it (its `cache` argument) for one forward.

    rope: per RoPE kind (TargetLayout.rope_kinds), the cos and sin of the forward's positions, broadcastable to
    [b, t, head_dim]; attend: the engine's LayerAttend, which writes the layer's cache and attends over it;
    rows: the index into the last layer's output [b, t, H] that picks the rows whose logits the forward returns."""

    rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
    attend: LayerAttend
    rows: Any = ...


class AttendNotPassed(ValueError):
    """An attention module ran under ENGINE_ATTENTION without the engine's attend function: its decoder layer does
    not pass its keyword arguments on, or the call did not come from a static engine."""


def engine_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             engine_attend: Attend | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [b, H, t, D], k/v [b, kv, t, D] -> ([b, t, H, D], None).
    The attention mask and dropout HF passes are not read: the engine's attend function masks (the layer's sliding
    window, passed on), and a target is only evaluated, never trained."""
    if engine_attend is None:
        raise AttendNotPassed(f"{type(module).__name__} was called without the static engine's attend function")
    # Sinks add a logit to every softmax; the engines' attend functions have none.
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"the static engines cannot apply the attention sinks (s_aux) of {type(module).__name__}")
    # A layer that keeps its window without passing it on still masks by it in HF (its model's mask).
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    return engine_attend(query, key, value, scaling, window, kwargs.get("softcap")), None


AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)


def engine_attention(layers: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Run the attention of `layers` (the decoder layers the engine calls) with engine_attention_forward inside
    the block; the implementation each config had is restored after it, also when the block raises."""
    return attention_implementation(layers, ENGINE_ATTENTION)
