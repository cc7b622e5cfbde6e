"""Which weights a target checkpoint holds, as a digest of its files: what the data stage's answers were written by.

A checkpoint trained again into the same folder keeps every setting (`target.path` names the folder, not its
contents), so the digest is what tells the data stage that its answers, and the synthetic prompts the target wrote,
came from other weights. It reads, of each file of the folder (or of the .gguf file): its name, its size and three
slices of SLICE bytes (its start, middle and end; a file of at most three slices whole). Training or quantising a
model again rewrites every tensor, so the slices change; copying the folder elsewhere or touching it changes
nothing. Hidden files, Markdown notes and subfolders are not the weights and are left out.
"""

from __future__ import annotations

import hashlib
import json
import os

SLICE = 1 << 20

# (folder or file, its files' (name, size, modification time)) -> digest: the guard, the data stage and the
# evaluation each ask once per command; a file rewritten since changes the key.
_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def checkpoint_files(path: str) -> list[str]:
    """The files the digest reads: the .gguf file `path` names, or the files directly in the folder `path`."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        return [path]
    names = sorted(name for name in os.listdir(path)
                   if not name.startswith(".") and not name.lower().endswith(".md")
                   and os.path.isfile(os.path.join(path, name)))
    return [os.path.join(path, name) for name in names]


def checkpoint_digest(path: str) -> str:
    """sha256 over the name, size and slices of each of the checkpoint's files (module docstring)."""
    files = checkpoint_files(path)
    stats = tuple((os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)
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
