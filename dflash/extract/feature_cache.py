"""The first epoch's online features, kept on disk for the later epochs (capture.cache).

Online capture runs the target for every sample of every epoch, because stored features can take terabytes. When
the disk does hold one epoch, capturing it once is enough: each trainer rank writes the samples it receives in the
first epoch into a shared folder, one file per sample (in the one format of captured samples, sample_format.py),
and every later epoch reads them back while the capture ranks have already stopped.
A file is written atomically (run_files.atomic_write), so a reader never sees half of one; a killed run keeps what
it wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dflash.config.errors import ConfigError
from dflash.extract.sample_format import encode, load
from dflash.run_files import atomic_write


# Left free on the cache's disk for what else the run writes there: checkpoints (optimizer state included), logs.
DISK_MARGIN_FRACTION = 0.05


# The file naming the run a cache folder was prepared for (trainer rank 0 writes it, every trainer rank checks it).
TOKEN_FILE = "run.token"


class FeatureCache:
    """Sample index -> its stored tensors ("hidden", "input_ids", "loss_mask", "offsets", optional "scales").

    `token`: the run's, written into the folder when trainer rank 0 prepared it (write_token); a rank that finds
    another (or none) does not see that folder, and reading its samples would read another run's: ConfigError."""

    def __init__(self, path: str | Path, token: str | None = None) -> None:
        self.path = Path(path)
        # Checked before the folder is made: a refused rank leaves no empty folder of its own behind.
        if token is not None and (found := self.token()) != token:
            held = f"no {TOKEN_FILE}" if found is None else f"the {TOKEN_FILE} of another run"
            raise ConfigError(
                f"capture.cache_dir {self.path}: this trainer rank does not see the feature cache trainer rank 0 "
                f"prepared for this run ({held} there): trainer ranks on several nodes need a folder on a file "
                f"system they all share; name one with capture.cache_dir, or set capture.cache=false")
        self.path.mkdir(parents=True, exist_ok=True)

    def token(self) -> str | None:
        file = self.path / TOKEN_FILE
        return file.read_text(encoding="utf-8").strip() if file.is_file() else None

    def write_token(self, token: str) -> None:
        atomic_write(self.path / TOKEN_FILE, token)

    def file(self, index: int) -> Path:
        return self.path / f"s{int(index):010d}.safetensors"

    def __contains__(self, index: int) -> bool:
        return self.file(index).is_file()

    def put(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep sample `index` (a no-op when it is kept already: placeholders repeat samples)."""
        file = self.file(index)
        if file.is_file():
            return
        atomic_write(file, encode({name: t.contiguous() for name, t in tensors.items()}))

    def get(self, index: int) -> dict[str, torch.Tensor]:
        file = self.file(index)
        if not file.is_file():
            raise FileNotFoundError(
                f"feature cache {self.path} has no sample {index}: the first epoch did not write it (a cache from "
                "another run? trainer ranks on several nodes with a capture.cache_dir that is not on a file system "
                "they share?). Delete the cache folder and the run's checkpoints, then train again"
            )
        return load(file)


def cached_epochs(mode: str, estimated_bytes: int, budget_bytes: int | None, free_bytes: int,
                  room_name: str = "its budget; the free disk less a margin for checkpoints") -> bool:
    """Whether to keep the first epoch: mode "true" (must fit, else ConfigError), "false", or "auto" (if it fits).

    It fits when the estimate is within `budget_bytes` (None: no budget of its own) and within `free_bytes`, the
    room the cache may use (the disk's, cache_room; the host memory's for colocated features, feature_memory.py),
    which the error names as `room_name`.
    """
    if mode not in ("auto", "true", "false"):
        raise ConfigError(f"capture.cache={mode!r}: expected auto, true or false")
    room = free_bytes if budget_bytes is None else min(int(budget_bytes), free_bytes)
    fits = estimated_bytes <= room
    if mode == "true" and not fits:
        raise ConfigError(f"capture.cache=true: one epoch of features takes {estimated_bytes / 2**30:.2f} GiB, more "
                         f"than the {room / 2**30:.2f} GiB the cache may use ({room_name})")
    return mode == "true" or (mode == "auto" and fits)


def cache_room(cache_dir: str) -> int:
    """Bytes the cache may fill on its disk: the free space less DISK_MARGIN_FRACTION of the disk."""
    usage = shutil.disk_usage(cache_dir)
    return max(usage.free - int(DISK_MARGIN_FRACTION * usage.total), 0)
