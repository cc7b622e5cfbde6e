"""Frozen target models behind one adapter: `load_target(...)` -> TargetAdapter (see docs/targets.md)."""

from dflash.models.targets.base import TargetAdapter, resolve_dtype
from dflash.models.targets.load import load_target
from dflash.models.targets.registry import TARGET_ADAPTERS, UnsupportedTarget, adapter_class, adapter_for, wrap_model
from dflash.models.targets.tiny import build_tiny_target

__all__ = [
    "TARGET_ADAPTERS",
    "TargetAdapter",
    "UnsupportedTarget",
    "adapter_class",
    "adapter_for",
    "build_tiny_target",
    "load_target",
    "resolve_dtype",
    "wrap_model",
]
