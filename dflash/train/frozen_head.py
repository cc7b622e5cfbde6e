"""The target's frozen embedding and lm_head, saved once at capture so trainer ranks never load the target; the
file's metadata holds the target's final logit transform (none for most targets)."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.models.targets.logit_transform import LogitTransform
from dflash.run_files import atomic_path


def save_frozen_head(embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, path: str,
                     logit_transform: LogitTransform | None = None) -> None:
    tensors = {"embed_tokens": embed_weight.detach().cpu().contiguous(),
               "lm_head": lm_head_weight.detach().cpu().clone().contiguous()}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=(logit_transform or LogitTransform()).metadata() or None)


def load_frozen_head(path: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) on `device`; neither requires grad."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"frozen embedding/lm_head file {path} is missing: run the capture stage first")
    tensors = load_file(path, device=str(device))
    return tensors["embed_tokens"], tensors["lm_head"]


def load_logit_transform(path: str) -> LogitTransform:
    """The target's final logit transform saved with its frozen head (the identity in files written before it)."""
    with safe_open(path, framework="pt") as f:
        return LogitTransform.from_metadata(f.metadata())
