"""Activation checkpointing of the drafter's decoder layers, applied from outside the model.

Each layer's activations are recomputed in backward instead of kept, trading one extra layer forward for the
memory of its intermediates (the [queries, intermediate] MLP activations dominate at 8192 queries). The layer's
`forward` is wrapped on the instance, so parameter names and checkpoints are unchanged.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(drafter: nn.Module) -> nn.Module:
    for layer in drafter.layers:
        if getattr(layer, "_activation_checkpointed", False):
            continue
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        layer._activation_checkpointed = True
    return drafter
