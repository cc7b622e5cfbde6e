"""Switching a module tree's attention implementation for the length of a block.

transformers' attention modules look their attention function up by name on their config at every call, so a
registered function (packed_attention.py, engine_attention.py) takes effect by renaming the implementation on each
config the modules read, and the old names come back when the block ends, also when it raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


def attention_configs(model: nn.Module) -> list[Any]:
    """Every distinct config object the model's modules read their attention implementation from."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Inside the block, every attention module of `model` runs the attention function registered as `name`."""
    with contextlib.ExitStack() as restore:
        for config in attention_configs(model):
            # The internal attribute: the public setter would also rewrite sub-configs (a VLM's vision tower).
            restore.callback(setattr, config, "_attn_implementation_internal", config._attn_implementation_internal)
            config._attn_implementation_internal = name
        yield
