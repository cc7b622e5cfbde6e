"""A GGUF file as a target: dequantised once by transformers' GGUF loader into an HF checkpoint folder, cached.

transformers dequantises a GGUF (`gguf_file=`) into float weights, but `save_pretrained` refuses a GGUF-loaded
model, so the conversion rebuilds the model from its config (without `quantization_config`), copies the state dict
and saves float32 safetensors and the tokenizer; later loads read that folder in well under a second. float32
keeps the dequantised values exact (Q4 values need more mantissa than bfloat16 has). A GGUF given by path is
cached under <cache_dir>/gguf/<name>-<key>, the key made from the file's path, size and modification time, so an
edited or replaced file is converted again. One process converts a file at a time (a lock file beside the folder):
the ranks of a job that start on a cold cache wait for the first conversion instead of repeating it. transformers'
loader parses the file three times (for the config, the weights and the tokenizer) and builds the architecture's
tensor-name map once per module of the model: during the conversion it gets one parse and one map (`parsed_once`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash.console import EVERY_RANK
from dflash.run_files import file_sha256, swap_in_dir

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/dflash"
# Written last into a converted folder: its presence means the conversion is complete.
SOURCE_FILE = "dflash_source.json"


def is_converted(folder: Path) -> bool:
    return (folder / SOURCE_FILE).is_file()


def cached_folder(source: str | os.PathLike, cache_dir: str | None = None) -> Path:
    """Where the GGUF file `source` is (or will be) converted: <cache_dir>/gguf/<name>-<key>."""
    real = os.path.realpath(os.path.expanduser(source))
    stat = os.stat(real)
    key = hashlib.sha256(f"{real}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    name = Path(real).name[: -len(".gguf")]
    return Path(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)) / "gguf" / f"{name}-{key}"


def convert_gguf_file(source: Path, target: Path) -> Path:
    """Dequantise the GGUF file `source` once into the HF checkpoint folder `target`; returns `target`."""
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if not is_converted(target):  # converted while this process waited
            # The one rank that converts says so: the others wait on the lock.
            logger.info(f"[target] converting {source.name} once into {target} (kept for later runs)",
                        extra=EVERY_RANK)
            _convert(source, target)
    return target


def _convert(source: Path, target: Path) -> None:
    """convert_gguf_file's work, under its lock."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.models.targets.base import ensure_pad_token

    with parsed_once():
        gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    ensure_pad_token(tokenizer)

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source_info = {"gguf": str(source), "gguf_sha256": file_sha256(source),
                       "transformers_version": transformers.__version__, "dtype": "float32"}
        (tmp / SOURCE_FILE).write_text(json.dumps(source_info, indent=2) + "\n")
        # Under the lock, a folder at `target` is an interrupted conversion (no completion marker): it is replaced
        # (an aside left by a process killed in the swap goes first).
        swap_in_dir(str(tmp), str(target), aside=str(target.parent / f".{target.name}.old"))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# parsed_once patches a module shared by the process: one conversion at a time holds the patch.
_PATCH = threading.Lock()


@contextmanager
def parsed_once() -> Iterator[None]:
    """Inside: one `gguf.GGUFReader` per file and one `gguf.get_tensor_name_map` per architecture and depth.

    transformers' loader imports both from the `gguf` package where it calls them, so they are replaced there for
    the duration (by a function: nothing checks isinstance against the reader class). A reader only reads its
    memory-mapped file and a name map is only looked up, so sharing them changes no result (the same weights, config
    and tokenizer files). For the architectures transformers reads through gguf's reader (llama, SmolLM2's, among
    them) it spares two parses of every metadata field (SmolLM2's 49k vocabulary entries) and ~400 maps: 28.6 ->
    11.3 s on a 2-core CPU (bench/gguf_conversion.py); for the others it changes nothing.
    """
    import gguf

    with _PATCH:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

        @functools.cache
        def shared_reader(path: str, mode: str):
            return reader_class(path, mode)

        gguf.GGUFReader = lambda path, mode="r": shared_reader(os.path.realpath(path), mode)
        gguf.get_tensor_name_map = functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
