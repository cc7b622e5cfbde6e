"""HF `config.model_type` -> adapter class. Adding a family: one adapter file (if none fits) and one line here."""

from __future__ import annotations

from torch import nn

from dflash.models.targets.base import TargetAdapter
from dflash.models.targets.dense import DenseTargetAdapter
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


def wrap_model(model: nn.Module, tokenizer: object) -> TargetAdapter:
    """Wrap a loaded HF *ForCausalLM and its tokenizer in the adapter of its family."""
    return adapter_class(model.config.model_type)(model, tokenizer)
