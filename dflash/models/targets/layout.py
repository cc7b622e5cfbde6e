"""What the static engines of dflash/inference/ read from a dense Llama-layout target (llama, mistral, qwen2, qwen3;
SmolLM2 included): the batched regeneration decoder (static_decode.py) and live decoding's StaticTarget
(static_target.py). The engines run the target's own HF modules: the embedding, each decoder layer's forward (its
attention through engine_attention.py, which hands q, k and v to the engine's KV cache), the final norm and the LM
head; the layout holds those modules, the attention shapes and the RoPE table. `layout_problem` says which targets
the engines refuse, and why; a family whose modules sit elsewhere gives its adapter a `static_layout()` of its own.
"""

from __future__ import annotations

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
        if attn is None:
            return f"decoder layer {i} has no self_attn"
        # The engines' attention sees every cached key. Qwen layers keep their own window (None when off);
        # Mistral's attention reads it from the config.
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        if window is not None:
            return f"decoder layer {i} uses a sliding window ({window})"
    return None


@dataclass(frozen=True)
class TargetLayout:
    """A dense target's modules and attention shape, read once from its adapter."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    rotary: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
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
            device=torch.device(adapter.device), dtype=adapter.dtype,
        )

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, head_dim] of positions 0..length-1 from the rotary module. The engines look their
        positions up in it: elementwise the numbers the rotary module gives for those positions."""
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.rotary(probe, torch.arange(length, device=self.device)[None])
        return cos[0], sin[0]
