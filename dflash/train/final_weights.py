"""The drafter's final weights, consolidated from every rank once training ends: the train stage's output, which
the export stage reads (dflash/stages/export.py).

checkpoint_dir/final/model.safetensors   the drafter's state dict at the last step
checkpoint_dir/final/checksums.json      its sha256, written before the folder takes final/'s place

final/ is replaced whole (best_checkpoint.write_weights), so a reader finds the old weights or the new ones.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from dflash.config.errors import CorruptFile
from dflash.run_files import CHECKSUMS, checksum_problem
from dflash.train.best_checkpoint import WEIGHTS, write_weights

FINAL = "final"


def final_dir(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, FINAL)


def write_final(checkpoint_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
    write_weights(final_dir(checkpoint_dir), state_dict)


def final_problem(checkpoint_dir: str) -> str | None:
    """What keeps the final weights from being read: missing, or a file that differs from its checksums.json;
    None when they are whole."""
    folder = final_dir(checkpoint_dir)
    if not all(os.path.isfile(os.path.join(folder, name)) for name in (WEIGHTS, CHECKSUMS)):
        return f"{folder} is missing"
    problem = checksum_problem(folder)
    return None if problem is None else f"{folder} is corrupt: {problem}"


def final_state_dict(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The final weights; CorruptFile when they are missing or differ from their checksums.json."""
    problem = final_problem(checkpoint_dir)
    if problem is not None:
        raise CorruptFile(f"{problem}: run the same command with the train stage, which writes them again from "
                          f"its last checkpoint (python -m dflash.train ...)")
    return load_file(os.path.join(final_dir(checkpoint_dir), WEIGHTS))
