"""The target's frozen embedding and lm_head, saved once at capture so trainer ranks never load the target."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from dflash.run_files import atomic_path


def save_frozen_head(embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, path: str) -> None:
    tensors = {"embed_tokens": embed_weight.detach().cpu().contiguous(),
               "lm_head": lm_head_weight.detach().cpu().clone().contiguous()}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp)


def load_frozen_head(path: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) on `device`; neither requires grad."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"frozen embedding/lm_head file {path} is missing: run the capture stage first")
    tensors = load_file(path, device=str(device))
    return tensors["embed_tokens"], tensors["lm_head"]
