"""What a target does to `hidden @ lm_head^T` before its logits come out: a scale, then a soft cap.

HF families that do something: Granite's `logits_scaling` (logits divided by it), Cohere's `logit_scale` and
Falcon-H1's `lm_head_multiplier` (multiplied), Gemma 2/3's `final_logit_softcapping` (cap * tanh(logits / cap)).
The drafter shares the target's head, so its logits must go through the same transform: the training loss, the
held-out replay and live decoding (whose acceptance at T > 0 compares the two distributions) all use it. A positive
scale and the cap are monotonic, so greedy argmaxes never change; probabilities do.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass
from typing import Any

import torch

# safetensors metadata keys of the frozen head file (strings only there).
SCALE_KEY = "logit_scale"
SOFTCAP_KEY = "final_logit_softcapping"


@dataclass(frozen=True)
class LogitTransform:
    """logits = softcap * tanh(scale * raw / softcap) (the tanh only when softcap is set)."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0 or (self.softcap is not None and not self.softcap > 0):
            raise ValueError(f"a logit transform needs scale > 0 and softcap > 0 or None, got {self}")

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        logits = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def derivative(self, logits: torch.Tensor) -> torch.Tensor:
        """d logits / d raw, from the transformed `logits` themselves: scale * (1 - (logits / softcap)^2)."""
        if self.softcap is None:
            return torch.full_like(logits, self.scale)
        return (1.0 - (logits / self.softcap).square()) * self.scale

    def metadata(self) -> dict[str, str]:
        """The transform as safetensors metadata (empty for the identity, so such files stay as they were)."""
        found = {}
        if self.scale != 1.0:
            found[SCALE_KEY] = repr(float(self.scale))
        if self.softcap is not None:
            found[SOFTCAP_KEY] = repr(float(self.softcap))
        return found

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None) -> LogitTransform:
        metadata = metadata or {}
        softcap = metadata.get(SOFTCAP_KEY)
        return cls(scale=float(metadata.get(SCALE_KEY, 1.0)), softcap=float(softcap) if softcap else None)


def logit_transform_of(config: Any) -> LogitTransform:
    """The transform an HF text config declares (module docstring); the identity for most families."""
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    for name in ("logit_scale", "lm_head_multiplier"):
        if getattr(config, name, None):
            scale *= float(getattr(config, name))
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


def logits_from_hidden(hidden: torch.Tensor, head: torch.Tensor,
                       transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [..., V] of final hidden states [..., H] through a target's head weight [V, H] (moved to its device
    and dtype) and its logit transform (None: the raw logits, e.g. for an argmax, which a transform never moves)."""
    raw = hidden.to(device=head.device, dtype=head.dtype) @ head.T
    return raw if transform is None else transform(raw)
