"""Gated-DeltaNet hybrid targets (Qwen3.5 / Qwen3.6, Qwen3.5-MoE, Qwen3-Next).

`AutoModelForCausalLM` gives the text-only *ForCausalLM for these checkpoints (its decoder stack is `model.model`);
the multimodal *ForConditionalGeneration wrapper keeps it at `model.model.language_model`. Both are accepted.
Taps may sit on GDN layers as well as on full-attention layers (notes section 2).
"""

from __future__ import annotations

from torch import nn

from dflash.models.targets.base import TargetAdapter


class HybridTargetAdapter(TargetAdapter):
    """A GDN hybrid: `config.layer_types` mixes "linear_attention" (GDN) and "full_attention" layers."""

    def text_model(self) -> nn.Module:
        inner = self.model.model
        language_model = getattr(inner, "language_model", None)
        return language_model if language_model is not None else inner

    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def linear_attention_layer_ids(self) -> list[int]:
        """Ids of the GDN layers: their recurrent/conv states must be snapshotted to roll back a verify."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]
