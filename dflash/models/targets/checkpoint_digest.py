"""Which weights a target checkpoint holds, as a digest of its files: what the data stage's answers were written by.

A checkpoint trained again into the same folder keeps every setting (`target.path` names the folder, not its
contents), so the digest is what tells the data stage that its answers, and the synthetic prompts the target wrote,
came from other weights. It reads, of each of the model's files in the folder (MODEL_FILES: weights, their index,
the config and the tokenizer's files; or the .gguf file): its name, its size and three slices of SLICE bytes (its
start, middle and end; a file of at most three slices whole). Training or quantising a model again rewrites every
tensor, so the slices change; copying the folder elsewhere or touching it changes nothing, and neither do the other
files a folder gathers (notes, licences, logs, a trainer's state and results) or its subfolders.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

SLICE = 1 << 20
# The files that make the model a checkpoint folder loads: weights (and their shard index), config, tokenizer.
MODEL_FILES = re.compile(r".*\.(safetensors|gguf|pt|pth|tiktoken)|.*\.index\.json|pytorch_model.*\.bin|"
                         r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab|"
                         r"preprocessor_config|chat_template)\.json|tokenizer\.model|vocab\.txt|merges\.txt|"
                         r"chat_template\.jinja")

# (folder or file, its files' (name, size, modification time)) -> digest: the guard, the data stage and the
# evaluation each ask once per command; a file rewritten since changes the key.
_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def checkpoint_files(path: str) -> list[str]:
    """The files the digest reads: the .gguf file `path` names, or the model's files directly in the folder `path`."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        return [path]
    names = sorted(name for name in os.listdir(path)
                   if MODEL_FILES.fullmatch(name) and os.path.isfile(os.path.join(path, name)))
    return [os.path.join(path, name) for name in names]


def checkpoint_digest(path: str) -> str:
    """sha256 over the name, size and slices of each of the checkpoint's files (module docstring)."""
    files = checkpoint_files(path)
    stats = tuple((os.path.basename(f), status.st_size, status.st_mtime_ns) for f in files for status in [os.stat(f)])
    key = (os.path.realpath(os.path.expanduser(path)), stats)
    if key not in _digests:
        _digests[key] = hashlib.sha256(json.dumps([[name, size, _slices_sha256(file, size)] for file, (name, size, _)
                                                   in zip(files, stats)]).encode()).hexdigest()
    return _digests[key]


def _slices_sha256(file: str, size: int) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        if size <= 3 * SLICE:
            digest.update(f.read())
        else:
            for start in (0, (size - SLICE) // 2, size - SLICE):
                f.seek(start)
                digest.update(f.read(SLICE))
    return digest.hexdigest()
