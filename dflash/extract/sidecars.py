"""Sidecars: the manifest entries of a multi-process capture's shards, until rank 0 lists them in the manifest.

Rank r writes `shard-NNNNN.json` next to each shard it finished; a run that resumes (with any number of ranks)
keeps the shards whose sidecars exist and are intact.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dflash.extract.store import shard_name
from dflash.run_files import atomic_write, file_sha256
from dflash.console import EVERY_RANK

logger = logging.getLogger(__name__)


def sidecar_path(out_dir: Path, index: int) -> Path:
    """Where shard `index`'s sidecar goes: next to the shard, same name, .json."""
    return out_dir / shard_name(index).replace(".safetensors", ".json")


def write_sidecar(out_dir: Path, index: int, entry: dict[str, Any]) -> None:
    """Record shard `index`'s manifest entry next to it (atomically), once the shard itself is in place."""
    # atomic_write's temp names are those ShardWriter removes at the next start when a writer was killed.
    atomic_write(sidecar_path(out_dir, index), json.dumps(entry))


def remove_sidecars(out_dir: Path) -> None:
    """Remove every sidecar in out_dir (once the manifest lists their shards, or when they are another store's)."""
    for path in sorted(out_dir.glob("shard-*.json")):
        path.unlink()


def shard_intact(out_dir: Path, entry: dict[str, Any], verify: bool) -> bool:
    """Whether an entry's shard exists (with `verify`: and has the entry's sha256); says what is wrong if not."""
    path = out_dir / entry["file"]
    if not path.is_file():
        logger.info(f"[capture] feature shard {path} is missing: recapturing it", extra=EVERY_RANK)
        return False
    if verify:
        actual = file_sha256(path)
        if actual != entry["sha256"]:
            logger.info(f"[capture] feature shard {path} is corrupt (sha256 {actual}, recorded {entry['sha256']}): "
                        "recapturing it", extra=EVERY_RANK)
            return False
    return True


def read_sidecar(out_dir: Path, index: int, first: int, end: int, verify: bool) -> dict[str, Any] | None:
    """Shard `index`'s entry when its sidecar exists, covers samples first..end-1 and its shard is intact."""
    path = sidecar_path(out_dir, index)
    if not path.is_file():
        return None
    with open(path) as f:
        entry = json.load(f)
    # A sidecar planned with another shard_tokens covers other samples: its shard is recaptured.
    if (entry.get("file"), entry.get("first_sample"), entry.get("num_samples")) != (shard_name(index), first,
                                                                                   end - first):
        return None
    return entry if shard_intact(out_dir, entry, verify) else None


def sidecar_entries(out_dir: Path, plan: list[tuple[int, tuple[int, int]]],
                    verify: bool) -> dict[int, dict[str, Any]]:
    """{index: entry} of the planned shards [(index, (first, end))] that a sidecar shows finished and intact."""
    finished = {}
    for index, (first, end) in plan:
        entry = read_sidecar(out_dir, index, first, end, verify)
        if entry is not None:
            finished[index] = entry
    return finished
