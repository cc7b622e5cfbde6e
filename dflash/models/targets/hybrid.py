"""Gated-DeltaNet hybrid targets (Qwen3.5 / Qwen3.6, Qwen3.5-MoE, Qwen3-Next).

`AutoModelForCausalLM` gives the text-only *ForCausalLM for these checkpoints (its decoder stack is `model.model`);
the multimodal *ForConditionalGeneration wrapper keeps it at `model.model.language_model`. Both are accepted.
Taps may sit on GDN layers as well as on full-attention layers (method.md §2).

With flash-linear-attention installed, the GDN layers' causal conv1d runs fla's Triton kernel on CUDA inputs instead
of transformers' torch fallback, chosen per call (dflash/models/targets/gdn_kernels.py); the kernels in use are
printed at load.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from dflash.models.targets.base import TargetAdapter
from dflash.models.targets.gdn_kernels import (
    check_conv_choice, conv_choice, describe_gdn_kernels, route_causal_conv1d,
)

logger = logging.getLogger(__name__)


class HybridTargetAdapter(TargetAdapter):
    """A GDN hybrid: `config.layer_types` mixes "linear_attention" (GDN) and "full_attention" layers."""

    # The causal conv1d choice this adapter's forwards run under (see set_gdn_conv).
    gdn_conv: str = "auto"

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        route_causal_conv1d(model)
        self._print_kernels()

    def text_model(self) -> nn.Module:
        inner = self.model.model
        language_model = getattr(inner, "language_model", None)
        return language_model if language_model is not None else inner

    def set_gdn_conv(self, conv: str = "auto") -> dict[str, str]:
        """Pick the GDN layers' causal conv1d for this adapter's forwards without a cache (capture,
        capture_with_final, forward_with_features): "auto" (fla's Triton kernel on CUDA inputs when fla is
        installed, else transformers' conv), "fla" (RuntimeError unless it can run on every GDN layer) or "torch"
        (transformers' own). A forward with a cache (live decoding's CachedTarget) and other calls of the model
        (e.g. model.generate) run "auto". Prints and returns the kernels the GDN layers now run
        ({"conv": ..., "chunk": ...})."""
        check_conv_choice(self.model, conv)
        self.gdn_conv = conv
        return self._print_kernels()

    def gdn_kernels(self) -> dict[str, str]:
        """{"conv": ..., "chunk": ...}: the causal conv1d and chunked gated-delta-rule kernels of a prefill."""
        return describe_gdn_kernels(self.model, self.gdn_conv)

    def _print_kernels(self) -> dict[str, str]:
        kernels = self.gdn_kernels()
        logger.info(f"[target] {self.model_type} GDN kernels: conv {kernels.get('conv')}, "
                    f"chunk {kernels.get('chunk')}")
        return kernels

    def kernels(self) -> contextlib.AbstractContextManager[None]:
        """The GDN layers' causal conv1d choice of set_gdn_conv, for the adapter's forwards without a cache."""
        return conv_choice(self.gdn_conv)

    @property
    def layer_types(self) -> list[str]:
        return list(self.config.layer_types)

    def linear_attention_layer_ids(self) -> list[int]:
        """Ids of the GDN layers: their recurrent/conv states must be snapshotted to roll back a verify."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]
