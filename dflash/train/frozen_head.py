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
    """The file at `path`; a head tied to the embedding (SmolLM2, Gemma) is stored once, as embed_tokens alone."""
    tensors = {"embed_tokens": embed_weight.detach().cpu().contiguous()}
    if not tied(embed_weight, lm_head_weight):
        tensors["lm_head"] = lm_head_weight.detach().cpu().clone().contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=(logit_transform or LogitTransform()).metadata() or None)


def tied(embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> bool:
    """Whether the head is the embedding: the same storage, or equal values of the same shape and dtype (compared
    on the embedding's device, the first row first: an untied head differs there)."""
    if lm_head_weight.shape != embed_weight.shape or lm_head_weight.dtype != embed_weight.dtype:
        return False
    if lm_head_weight.data_ptr() == embed_weight.data_ptr() and lm_head_weight.stride() == embed_weight.stride():
        return True
    head = lm_head_weight.detach().to(embed_weight.device)
    return torch.equal(head[:1], embed_weight[:1]) and torch.equal(head, embed_weight)


def load_frozen_head(path: str, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) on `device` (one tensor twice for a tied head); neither requires
    grad."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"frozen embedding/lm_head file {path} is missing: run the capture stage first")
    tensors = load_file(path, device=str(device))
    return tensors["embed_tokens"], tensors.get("lm_head", tensors["embed_tokens"])


def load_logit_transform(path: str) -> LogitTransform:
    """The target's final logit transform saved with its frozen head (the identity in files written before it)."""
    with safe_open(path, framework="pt") as f:
        return LogitTransform.from_metadata(f.metadata())
