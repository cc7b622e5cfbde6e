"""The one on-disk form of captured samples: feature store shards and the feature cache's samples alike.

A file holds n >= 1 samples back to back (safetensors; metadata {"schema_version": "1"}):
    hidden     [tokens, K*H]  bf16, fp32 or fp8 e4m3 (the K taps side by side, in target_layer_ids order)
    input_ids  [tokens] int32
    loss_mask  [tokens] uint8
    offsets    [n+1] int64    sample j is rows offsets[j]:offsets[j+1]
    scales     [tokens, K] float32, fp8 only (one per token and tap, see fp8.py)
A store shard holds many samples; a sample of the feature cache holds one. Cached samples written before they
carried the metadata hold the same tensors, and are read the same way.

The held-out file (dflash/train/heldout.py) is not one of these: it holds what the acceptance replay needs
(greedy tokens, prompt lengths), not training samples.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from dflash.data.feature_source import Sample
from dflash.extract.fp8 import FP8_DTYPE, dequantize_fp8

SCHEMA_VERSION = 1
METADATA = {"schema_version": str(SCHEMA_VERSION)}  # one key: safetensors orders several keys arbitrarily


def sample_tensors(hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor,
                   scales: torch.Tensor | None = None, *, what: str = "samples") -> dict[str, torch.Tensor]:
    """The tensors of a file of samples, in their stored dtypes; ValueError naming `what` when the rows do not
    match the offsets, or fp8 features come without per-token scales (or other dtypes with them)."""
    num_tokens = int(offsets[-1])
    if hidden.shape[0] != num_tokens or input_ids.shape[0] != num_tokens or loss_mask.shape[0] != num_tokens:
        raise ValueError(
            f"{what}: hidden has {hidden.shape[0]} rows, input_ids {input_ids.shape[0]}, loss_mask "
            f"{loss_mask.shape[0]}, but the offsets cover {num_tokens} tokens (one row per token expected)"
        )
    if (scales is not None) != (hidden.dtype == FP8_DTYPE):
        raise ValueError(f"{what}: fp8 features need per-token scales, other dtypes none")
    tensors = {
        "hidden": hidden.contiguous(),
        "input_ids": input_ids.to(torch.int32).contiguous(),
        "loss_mask": loss_mask.to(torch.uint8).contiguous(),
        "offsets": offsets.to(torch.int64).contiguous(),
    }
    if scales is not None:
        if scales.shape[0] != num_tokens:
            raise ValueError(f"{what}: {scales.shape[0]} scale rows for {num_tokens} tokens")
        tensors["scales"] = scales.to(torch.float32).contiguous()
    return tensors


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    """The file's bytes (serialised in memory: safetensors' save_file may go through a temp file of its own)."""
    return save(tensors, metadata=METADATA)


def check_schema(metadata: dict[str, str] | None, path: object) -> None:
    """ValueError unless a file's metadata names this schema (no metadata: a cached sample written before samples
    carried it, the same tensors)."""
    version = (metadata or {}).get("schema_version", METADATA["schema_version"])
    if version != METADATA["schema_version"]:
        raise ValueError(f"{path}: feature file of schema version {version}, this code reads {SCHEMA_VERSION}: "
                         "capture the features again (rerun the capture stage, or delete the feature cache)")


def load(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file of samples, its schema checked."""
    with safe_open(str(path), framework="pt") as f:
        check_schema(f.metadata(), path)
        return {name: f.get_tensor(name) for name in f.keys()}


def decode(input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor,
           scales: torch.Tensor | None = None) -> Sample:
    """One sample from its stored rows: ids and mask as int64, fp8 features dequantised to bfloat16."""
    if scales is not None:
        hidden = dequantize_fp8(hidden, scales)
    return {"input_ids": input_ids.long(), "loss_mask": loss_mask.long(), "hidden": hidden}


def decode_single(tensors: dict[str, torch.Tensor]) -> Sample:
    """The sample of a one-sample file (a sample of the feature cache)."""
    return decode(tensors["input_ids"], tensors["loss_mask"], tensors["hidden"], tensors.get("scales"))
