"""The best checkpoint by held-out acceptance: chosen by the measured acceptance length, not by the loss.

checkpoint_dir/best/model.safetensors   the drafter's consolidated weights at the best evaluation
checkpoint_dir/best/best.json           {"step", "tau", "acceptance_rate"} of that evaluation
checkpoint_dir/best/checksums.json      the sha256 of both, verified by whatever reads the weights, and on resume

best/ is replaced whole: the new one is written into best.tmp/, the old best/ is renamed to best.old/, best.tmp/
to best/, and best.old/ is deleted. A kill between the two renames leaves only best.old/, which readers then take,
so there is always one complete best once one was written. The final weights (final_weights.py) are written the
same way (write_weights).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash.config.errors import CorruptFile
from dflash.run_files import checksum_problem, swap_in_dir, write_checksums

BEST = "best"
WEIGHTS = "model.safetensors"
INFO = "best.json"


def _folder(checkpoint_dir: str) -> str | None:
    """The complete best folder: best/, or best.old/ when a kill hit between the two renames of a replacement."""
    for name in (BEST, f"{BEST}.old"):
        path = os.path.join(checkpoint_dir, name)
        if os.path.exists(os.path.join(path, INFO)):
            return path
    return None


def read_best(checkpoint_dir: str, *, verify: bool = False) -> dict[str, Any] | None:
    """best.json of the best checkpoint in `checkpoint_dir`, or None when none was written; with `verify`, after
    checking its files against checksums.json (CorruptFile naming the file)."""
    folder = _folder(checkpoint_dir)
    if folder is None:
        return None
    if verify:
        _verify(folder)
    return _read_info(folder)


def _verify(folder: str) -> None:
    """CorruptFile unless `folder`'s files match its checksums.json (a folder written before them is trusted)."""
    problem = checksum_problem(folder)
    if problem is not None:
        raise CorruptFile(
            f"the best checkpoint {folder} is corrupt: {problem}. Its weights cannot be made again from the "
            f"checkpoints: move the folder aside (mv {folder} {folder}.corrupt) and rerun; the best is then chosen "
            f"among the held-out evaluations still to come, and export/ holds the final drafter")


def _read_info(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, INFO), encoding="utf-8") as f:
        return json.load(f)


def write_best(checkpoint_dir: str, state_dict: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    """Replace the best checkpoint with `state_dict` (weights) and `info` (best.json), atomically."""
    write_weights(os.path.join(checkpoint_dir, BEST), state_dict, info)


def write_weights(folder: str, state_dict: dict[str, torch.Tensor], info: dict[str, Any] | None = None) -> None:
    """Replace `folder` whole with model.safetensors (`state_dict` on the CPU), best.json (`info`, when given) and
    their checksums.json: written into <folder>.tmp, then swapped in through <folder>.old."""
    tmp = f"{folder}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, os.path.join(tmp, WEIGHTS))
    if info is not None:
        with open(os.path.join(tmp, INFO), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)
    write_checksums(tmp)  # before the folder takes the place of the old one
    swap_in_dir(tmp, folder, aside=f"{folder}.old")


def clear_best(checkpoint_dir: str) -> None:
    """Delete any best checkpoint (a run that starts from scratch must not compete with an earlier run's best)."""
    for name in (BEST, f"{BEST}.old", f"{BEST}.tmp"):
        shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)


def best_state_dict(checkpoint_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(drafter weights, best.json) of the best checkpoint in `checkpoint_dir`, or None when none was written;
    CorruptFile when its files differ from its checksums.json."""
    folder = _folder(checkpoint_dir)
    if folder is None:
        return None
    _verify(folder)
    return load_file(os.path.join(folder, WEIGHTS)), _read_info(folder)
