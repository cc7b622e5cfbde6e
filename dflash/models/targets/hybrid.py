"""Gated-DeltaNet hybrid targets (Qwen3.5 / Qwen3.6, Qwen3.5-MoE, Qwen3-Next).

`AutoModelForCausalLM` gives the text-only *ForCausalLM for these checkpoints (its decoder stack is `model.model`);
the multimodal *ForConditionalGeneration wrapper keeps it at `model.model.language_model`. Both are accepted.
Taps may sit on GDN layers as well as on full-attention layers (notes section 2).

On CUDA with flash-linear-attention installed the GDN layers' causal conv1d runs fla's Triton kernel instead of
transformers' torch fallback (dflash/models/targets/gdn_kernels.py); the kernels in use are printed at load.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dflash.models.targets.base import TargetAdapter
from dflash.models.targets.gdn_kernels import describe_gdn_kernels, set_causal_conv1d


class HybridTargetAdapter(TargetAdapter):
    """A GDN hybrid: `config.layer_types` mixes "linear_attention" (GDN) and "full_attention" layers."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        self.set_gdn_conv("auto")

    def text_model(self) -> nn.Module:
        inner = self.model.model
        language_model = getattr(inner, "language_model", None)
        return language_model if language_model is not None else inner

    def set_gdn_conv(self, conv: str = "auto") -> dict[str, str]:
        """Pick the GDN layers' causal conv1d ("auto", "fla" or "torch", see gdn_kernels.set_causal_conv1d);
        prints and returns the kernels the GDN layers now run ({"conv": ..., "chunk": ...})."""
        set_causal_conv1d(self.model, conv)
        kernels = self.gdn_kernels()
        print(f"[target] {self.model_type} GDN kernels: conv {kernels.get('conv')}, "
              f"chunk {kernels.get('chunk')}", flush=True)
        return kernels

    def gdn_kernels(self) -> dict[str, str]:
        """{"conv": ..., "chunk": ...}: the causal conv1d and chunked gated-delta-rule kernels of a prefill."""
        return describe_gdn_kernels(self.model)

    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def linear_attention_layer_ids(self) -> list[int]:
        """Ids of the GDN layers: their recurrent/conv states must be snapshotted to roll back a verify."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]
