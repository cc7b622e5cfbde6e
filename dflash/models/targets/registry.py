"""HF `config.model_type` -> adapter class, for the families whose adapter differs from the generic one (GDN
hybrids) and the ones tested by name. Any other decoder-only causal LM of the standard layout takes the generic
adapter (dflash/models/targets/generic.py); a family it cannot take needs an adapter file and one line here."""

from __future__ import annotations

from torch import nn

from dflash.models.targets.base import TargetAdapter
from dflash.models.targets.dense import DenseTargetAdapter
from dflash.models.targets.generic import GenericTargetAdapter, UnsupportedTarget, unsupported_reason
from dflash.models.targets.hybrid import HybridTargetAdapter

TARGET_ADAPTERS: dict[str, type[TargetAdapter]] = {
    "llama": DenseTargetAdapter,
    "mistral": DenseTargetAdapter,
    "qwen2": DenseTargetAdapter,
    "qwen2_moe": DenseTargetAdapter,
    "qwen3": DenseTargetAdapter,
    "qwen3_moe": DenseTargetAdapter,
    "qwen3_5": HybridTargetAdapter,
    "qwen3_5_text": HybridTargetAdapter,
    "qwen3_5_moe": HybridTargetAdapter,
    "qwen3_5_moe_text": HybridTargetAdapter,
    "qwen3_next": HybridTargetAdapter,
}


def adapter_class(model_type: str) -> type[TargetAdapter]:
    """The adapter class registered for an HF model_type (ValueError listing the known ones otherwise)."""
    if model_type not in TARGET_ADAPTERS:
        raise ValueError(
            f"no target adapter for model_type {model_type!r}; known: {sorted(TARGET_ADAPTERS)} "
            "(register one in dflash/models/targets/registry.py)"
        )
    return TARGET_ADAPTERS[model_type]


def adapter_for(model: nn.Module) -> type[TargetAdapter]:
    """The registered adapter of `model`'s model_type, else the generic one; UnsupportedTarget when neither fits.
    `model` may live on the meta device (nothing is run)."""
    model_type = model.config.model_type
    if model_type in TARGET_ADAPTERS:
        return TARGET_ADAPTERS[model_type]
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedTarget(f"target {reason}")
    return GenericTargetAdapter


def wrap_model(model: nn.Module, tokenizer: object) -> TargetAdapter:
    """Wrap a loaded HF *ForCausalLM and its tokenizer in the adapter of its family (adapter_for)."""
    return adapter_for(model)(model, tokenizer)
