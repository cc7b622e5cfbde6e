"""A target checked before any stage runs: its config read (a folder's config.json, a GGUF file's metadata) and
its family matched to an adapter on a meta-device model, so no weight is read and a target that cannot work is
refused in one line before the data stage spends minutes on it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

from dflash.config.target_path import is_gguf_path
from dflash.models.targets.gguf import cached_folder, is_converted

# What transformers raises on a config it rejects: a missing or unparsable file, a bad field, and its strict
# dataclasses' validators (e.g. layer_types longer than num_hidden_layers in a pruned checkpoint).
CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, StrictDataclassError)


def checkpoint_config(path: str, cache_dir: str | None = None) -> Any:
    """The HF config of a checkpoint folder or of a GGUF file (its converted folder when there is one)."""
    from transformers import AutoConfig

    path = os.path.expanduser(path)
    if not is_gguf_path(path):
        return AutoConfig.from_pretrained(path)
    converted = cached_folder(path, cache_dir)
    if is_converted(converted):
        return AutoConfig.from_pretrained(converted)
    source = Path(path).resolve()
    return AutoConfig.from_pretrained(source.parent, gguf_file=source.name)


def config_shape(config: Any) -> dict[str, Any]:
    """The sizes a drafter takes from its target (the keys of dflash/stages/shapes.target_shape but the model type),
    read from a (text) config; vocab_size None where the config does not decide it (a tiny target's tokenizer
    does), intermediate_size None where it has none."""
    heads = int(config.num_attention_heads)
    vocab = getattr(config, "vocab_size", None)
    return {
        "num_layers": int(config.num_hidden_layers),
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(vocab) if vocab is not None else None,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads),
        # None for a mixture-of-experts target without a dense MLP width (Qwen3.5-MoE): the drafter names its own.
        "intermediate_size": int(config.intermediate_size) if getattr(config, "intermediate_size", None) else None,
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", None) or 40960),
    }


def known_target_shape(kind: str, tiny: dict | None = None, cache_dir: str | None = None) -> dict[str, Any]:
    """config_shape of a smollm2 or tiny target without loading its weights: the converted checkpoint's config (the
    GGUF's metadata before its first conversion, a few seconds), or the tiny family's config, whose vocabulary its
    tokenizer decides when it is built (vocab_size None); ConfigError naming the key of a tiny spec that builds no
    target (tiny.check_tiny_spec)."""
    if kind == "tiny":
        from types import SimpleNamespace

        from dflash.models.targets.tiny import TINY_FAMILIES, check_tiny_spec

        spec = dict(tiny or {})
        check_tiny_spec(spec, cache_dir)
        return config_shape(SimpleNamespace(**{**TINY_FAMILIES[spec["family"]][1], **spec}))
    if kind != "smollm2":
        raise ValueError(f"known_target_shape: {kind!r} is neither smollm2 nor tiny")
    from dflash.models.targets import smollm2

    config = checkpoint_config(str(smollm2.cache_path(cache_dir)) if smollm2.is_cached(cache_dir)
                               else str(smollm2.gguf_path()))
    return config_shape(config.get_text_config())


def target_problem(path: str, cache_dir: str | None = None) -> str | None:
    """Why the checkpoint at `path` cannot be a target (one line naming its family and what is missing), or None."""
    from dflash.models.targets.placement import empty_model
    from dflash.models.targets.registry import UnsupportedTarget, adapter_for

    try:
        config = checkpoint_config(path, cache_dir)
    except CONFIG_ERRORS as error:
        return f"its config cannot be read: {first_line(error)}"
    try:
        model = empty_model(config, torch.bfloat16)
    except CONFIG_ERRORS as error:
        return f"transformers cannot build a causal LM of model_type {getattr(config, 'model_type', '?')!r}: " \
               f"{first_line(error)}"
    try:
        adapter_for(model)
    except UnsupportedTarget as error:
        return str(error)
    return None


def length_dependent_rope(config: Any) -> tuple[str, int] | None:
    """(rope_type, tokens) of a (text) config whose RoPE frequencies change once a forward's longest sequence
    passes `tokens` (layout.LENGTH_DEPENDENT_ROPE: longrope switches to its long factors, dynamic NTK rescales its
    base, each for every row of the forward), else None. transformers decides per forward from the longest position
    in it, so past that length a sample's hidden states would depend on the samples batched or packed beside it."""
    from dflash.models.targets.layout import LENGTH_DEPENDENT_ROPE

    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # One set of parameters, or one per layer type (Gemma 3; a type without its own set is left out, as
    # transformers leaves it): the first switch of them all.
    per_type = [v for v in parameters.values() if isinstance(v, dict)]
    switches = []
    for params in per_type if per_type else [parameters]:
        kind = params.get("rope_type", params.get("type"))
        if kind == "longrope":
            switches.append((int(params.get("original_max_position_embeddings")
                                 or getattr(config, "original_max_position_embeddings", None)
                                 or config.max_position_embeddings), kind))
        elif kind in LENGTH_DEPENDENT_ROPE:  # dynamic: grows past the config's max_position_embeddings
            switches.append((int(config.max_position_embeddings), kind))
    if not switches:
        return None
    tokens, kind = min(switches)
    return kind, tokens


def first_line(error: BaseException) -> str:
    """The first line of what went wrong: the message of the error `error` was raised from when there is one
    (huggingface_hub's validation error heads the ValueError that names the field), else of `error` itself."""
    reason = error.__cause__ or error
    lines = str(reason).strip().splitlines()
    return lines[0] if lines else type(reason).__name__
