"""The layer math of a dense Llama-layout target (llama, mistral, qwen2, qwen3; SmolLM2 included) for the static
engines of dflash/inference/: the batched regeneration decoder (static_decode.py) and live decoding's StaticTarget
(static_target.py). A layer runs the target's own HF submodules (norms, q/k/v/o projections, q_norm/k_norm, MLP); the
attention is handed back to the engine, which owns the KV cache and decides what a query attends over (a prefill, a
decode step, a verify). A family whose layer differs gives its adapter a `static_layout()` of its own with these
methods; `TargetAdapter.static_layout_problem()` says which targets the engines refuse, and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants whose frequencies depend on the sequence length: a position table computed once would be wrong.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def layout_problem(adapter) -> str | None:
    """Why TargetLayout cannot run this target's layers in the static engines, or None when it can."""
    if adapter.model_type not in FAMILIES:
        return f"model_type {adapter.model_type!r} is not a dense family static decoding supports {FAMILIES}"
    # The static engine keeps one KV cache on one device; a target placed layer-wise over several (accelerate's
    # device map) would hand it keys from another GPU.
    placed = sorted({str(d) for d in (getattr(adapter.model, "hf_device_map", None) or {}).values()})
    if len(placed) > 1:
        return f"the target is placed over several devices {placed}"
    text_model = adapter.text_model()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(text_model, name):
            return f"{type(text_model).__name__} has no {name}"
    rope_type = getattr(text_model.rotary_emb, "rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    config = adapter.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer_types {sorted(set(layer_types))} are not all full_attention"
    for i, layer in enumerate(adapter.decoder_layers()):
        attn = getattr(layer, "self_attn", None)
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                return f"decoder layer {i} has no {name}"
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"decoder layer {i} has no self_attn with q/k/v/o projections"
        if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
            return f"decoder layer {i} has only one of q_norm/k_norm"
        # Qwen layers keep their own window (None when off); Mistral's attention reads it from the config.
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        if window is not None:
            return f"decoder layer {i} uses a sliding window ({window})"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as the llama/qwen families apply it, x * cos + [-x2, x1] * sin, written as a roll times a
    sin whose first half is negated: the same numbers, one kernel fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass(frozen=True)
class TargetLayout:
    """A dense target's modules, attention shape and layer forward, read once from its adapter."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    rotary: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, adapter) -> TargetLayout:
        text_model = adapter.text_model()
        attn = adapter.decoder_layers()[0].self_attn
        config = adapter.config
        head_dim = int(getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return cls(
            embed=text_model.embed_tokens, layers=adapter.decoder_layers(), norm=text_model.norm,
            head=adapter.model.get_output_embeddings(), rotary=text_model.rotary_emb,
            heads=int(config.num_attention_heads), kv_heads=int(config.num_key_value_heads), head_dim=head_dim,
            scaling=float(getattr(attn, "scaling", head_dim**-0.5)), device=torch.device(adapter.device),
            dtype=adapter.dtype,
        )

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed_sin [length, head_dim] (see _rotate) of positions 0..length-1. Positions are looked up in
        this table: elementwise the same numbers the rotary module gives per batch."""
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.rotary(probe, torch.arange(length, device=self.device)[None])
        half = self.head_dim // 2
        return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def project(self, attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """q [b, H, t, D], k and v [b, kv, t, D] of hidden states h [b, t, hidden], RoPE applied (cos and signed_sin
        [b, t, D], see _rotate)."""
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, signed_sin = cos[:, None], signed_sin[:, None]
        q, k = _rotate(q.transpose(1, 2), cos, signed_sin), _rotate(k.transpose(1, 2), cos, signed_sin)
        return q, k, v.transpose(1, 2)

    def run_layer(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One decoder layer on hidden states x [b, t, hidden]. attend(q, k, v) (shapes as project gives them)
        writes the layer's cache and returns the attention context [b, t, heads * head_dim]: the only part that
        differs between a prefill, a decode step and a verify."""
        attn = layer.self_attn
        q, k, v = self.project(attn, layer.input_layernorm(x), cos, signed_sin)
        x = x + attn.o_proj(attend(q, k, v))
        return x + layer.mlp(layer.post_attention_layernorm(x))
