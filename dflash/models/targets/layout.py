"""What the static engines of dflash/inference/ read from a target: the batched regeneration decoder
(static_decode.py) and live decoding's StaticTarget (static_target.py). The layout holds the target's own HF modules
(the embedding, the decoder layers, the final norm and the LM head), the attention shapes, each layer's sliding
window and RoPE table, and the family's final logit transform, and runs them for TargetAdapter.forward over an
engine's cache (an EngineCache, engine_attention.py): `run` is the embedding and each decoder layer's own forward
with the engine's attention (engine_attention.py hands q, k and v to the engine, which writes its KV cache and
attends), `logits` the final norm, the head and the transform. The engines keep their caches, masks, attention and
CUDA graphs; no layer math is theirs.

Families: dense Llama-layout targets (llama, mistral, qwen2, qwen3; SmolLM2 included) and Gemma 2/3 text models.
Sliding-window layers (Mistral's window, Qwen2/3's window layers, Gemma's local layers) keep a full-length cache
like every layer, and their attention masks the keys outside the window. Gemma 3 looks its RoPE up per layer type
(a local base for sliding layers, a global one for full layers): one table per type. Gemma 2's soft-capped
attention logits are applied by the engines' attention, as HF's eager attention does. `layout_problem` says which
targets the engines refuse, and why; a family whose modules sit elsewhere gives its adapter a `static_layout()` of
its own.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from dflash.models.targets.engine_attention import LayerAttend
from dflash.models.targets.logit_transform import LogitTransform

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# Layer kinds whose attention the engines repeat: causal, over every earlier key or over a sliding window of them.
LAYER_KINDS = ("full_attention", "sliding_attention")
# RoPE variants whose frequencies depend on the sequence length: a position table computed once would be wrong.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def layer_window(layer: nn.Module, config) -> int | None:
    """The sliding window of a decoder layer's attention, None for full attention. Qwen and Gemma layers keep their
    own (None on full layers); Mistral's attention reads it from the config."""
    attn = layer.self_attn
    return attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)


def rope_kinds(rotary: nn.Module, config) -> tuple[str | None, ...]:
    """Per decoder layer, the key of its RoPE table: its layer type when the rotary module computes one table per
    type (Gemma 3's `rotary_emb(x, positions, layer_type)`), else None (one table for every layer)."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return tuple(config.layer_types)
    return (None,) * int(config.num_hidden_layers)


def layout_problem(adapter) -> str | None:
    """Why TargetLayout cannot run this target's layers in the static engines, or None when it can."""
    if adapter.model_type not in FAMILIES:
        return f"model_type {adapter.model_type!r} is not a family static decoding supports {FAMILIES}"
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
    # Gemma 3 keeps one rope type per layer type.
    for kind in rope_type.values() if isinstance(rope_type, dict) else [rope_type]:
        if kind in LENGTH_DEPENDENT_ROPE:
            return f"rope_type {kind!r} depends on the sequence length"
    config = adapter.config
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted(set(layer_types) - set(LAYER_KINDS))
    if other:
        return f"layer_types {other} are neither full_attention nor sliding_attention"
    for i, layer in enumerate(adapter.decoder_layers()):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            return f"decoder layer {i} has no self_attn"
        # The engines' masks are causal (a Gemma 3 embedding model's bidirectional attention is not).
        if getattr(attn, "is_causal", True) is False:
            return f"decoder layer {i} attends bidirectionally"
        if layer_types and layer_types[i] == "sliding_attention" and layer_window(layer, config) is None:
            return f"decoder layer {i} is sliding_attention without a window"
    return None


@dataclass(frozen=True)
class TargetLayout:
    """A target's modules, attention shape, per-layer windows and RoPE kinds, read once from its adapter."""

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
    # Per layer: the sliding window (None: full attention) and the key of its RoPE table (rope_kinds).
    windows: tuple[int | None, ...]
    rope_kinds: tuple[str | None, ...]
    # What the family does to hidden @ head^T (Gemma's final soft cap); the identity for most.
    logit_transform: LogitTransform = LogitTransform()
    # The attention-logit soft cap the config declares (Gemma 2): the engines' prefill then masks explicitly.
    attention_softcap: float | None = None

    @classmethod
    def of(cls, adapter) -> TargetLayout:
        text_model = adapter.text_model()
        layers = adapter.decoder_layers()
        config = adapter.config
        head_dim = int(getattr(layers[0].self_attn, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        return cls(
            embed=text_model.embed_tokens, layers=layers, norm=text_model.norm,
            head=adapter.model.get_output_embeddings(), rotary=text_model.rotary_emb,
            heads=int(config.num_attention_heads), kv_heads=int(config.num_key_value_heads), head_dim=head_dim,
            device=torch.device(adapter.device), dtype=adapter.dtype,
            windows=tuple(layer_window(layer, config) for layer in layers),
            rope_kinds=rope_kinds(text_model.rotary_emb, config), logit_transform=adapter.logit_transform,
            attention_softcap=getattr(config, "attn_logit_softcapping", None),
        )

    @property
    def mask_windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers (None: full attention), in layer order: one mask each per forward."""
        return tuple(dict.fromkeys(self.windows))

    @property
    def plain(self) -> bool:
        """Every layer plain causal attention: no window, no soft cap."""
        return self.mask_windows == (None,) and self.attention_softcap is None

    def rope_table(self, length: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Per RoPE kind (rope_kinds), cos and sin [length, head_dim] of positions 0..length-1 from the rotary
        module. The engines look their positions up in it: elementwise the numbers the rotary module gives for those
        positions."""
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        positions = torch.arange(length, device=self.device)[None]
        tables = {}
        for kind in dict.fromkeys(self.rope_kinds):
            cos, sin = self.rotary(probe, positions) if kind is None else self.rotary(probe, positions, kind)
            tables[kind] = cos[0], sin[0]
        return tables

    def run(self, ids: torch.Tensor, rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]], attend: LayerAttend,
            tap_ids: Collection[int] = (), depth: int | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The target's decoder stack over an engine's KV cache: the embedding of ids [b, t], then each decoder
        layer's own forward with the (cos, sin) of its RoPE kind from `rope` (broadcast to [b, t, head_dim]) and, as
        its attention, `attend(layer index, q, k, v, scaling, window, softcap)` (the engine writes that layer's
        cache and attends over it). The engine enters engine_attention(self.layers) around the call. Returns the
        last layer's output [b, t, H] (before the final norm: logits() takes it) and the outputs of the layers in
        `tap_ids`, by id. depth: only the first `depth` layers run (a capture that needs no deeper tap); the
        returned output is then the last of those."""
        x = self.embed(ids)
        taps: dict[int, torch.Tensor] = {}
        for index, (layer, kind) in enumerate(zip(itertools.islice(self.layers, depth), self.rope_kinds)):
            x = layer(x, position_embeddings=rope[kind], engine_attend=functools.partial(attend, index))
            if index in tap_ids:
                taps[index] = x
        return x, taps

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits of last-layer hidden states: final norm, LM head and the family's logit transform."""
        logits = self.head(self.norm(hidden))
        return logits if self.logit_transform.identity else self.logit_transform(logits)
