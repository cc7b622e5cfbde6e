"""The static live engine's objects (static_target.py, static_drafter.py) kept per model across prompts.

Both sides of static live decoding run fixed-shape steps over preallocated buffers, each shape captured once as a
CUDA graph (dflash/inference/cuda_graphs.py); the object holding the buffers and graphs is kept per model so a new
prompt does not capture again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

Built = TypeVar("Built")


# Per model, the static objects of live decoding by key. Weak keys: they go when the model goes (the objects hold
# the model's submodules, never the model itself).
_KEPT_PER_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_object(model: torch.nn.Module, key: Hashable, length: int, build: Callable[[], Built]) -> Built:
    """The object kept for (model, key) when its `capacity` holds `length` positions, else a new `build()` (the
    old one is dropped first, freeing its buffers and graphs)."""
    objects = _KEPT_PER_MODEL.setdefault(model, {})
    kept = objects.get(key)
    if kept is None or kept.capacity < length:
        objects.pop(key, None)
        kept = objects[key] = build()
    return kept
