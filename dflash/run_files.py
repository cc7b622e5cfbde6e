"""Small files of a run folder: JSON written atomically, and the done-markers that let a rerun skip a stage.

A stage's folder holds `done.json` with the fingerprint of what decided its output; a stage whose marker matches
the current fingerprint is finished and is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_done(folder: str, key: str) -> bool:
    path = os.path.join(folder, "done.json")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("fingerprint") == key


def mark_done(folder: str, key: str, **info: Any) -> None:
    tmp = os.path.join(folder, "done.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"fingerprint": key, **info}, f, indent=2)
    os.replace(tmp, os.path.join(folder, "done.json"))


def write_json(path: str, value: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
