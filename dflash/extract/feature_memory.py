"""The first epoch's colocated features, kept in host memory for the later epochs (capture.cache with
capture=colocated).

Colocated capture runs the frozen target once per micro-batch, every epoch, and a target's features depend on the
tokens alone: every epoch after the first recomputes what the first computed. For the GPU default that forward is
half of the step's GPU work and, without CUDA graphs, a quarter of its host work (session 34's profile). When one
epoch's features fit in host memory, the first epoch keeps each sample's rows there as it captures them, and a
later micro-batch whose samples are all kept is put together from them: one zero-filled tensor on the device and
one copy per sample, with no target forward and no host wait.

On CUDA the rows live in page-locked chunks, so the copies (device to host when kept, host to device when read) are
queued on the stream like kernels: a read of a sample is ordered after the copy that kept it, and the host never
touches the rows itself. Chunks are allocated as the first epoch fills them, CHUNK_BYTES each (a power of two:
torch's page-locked allocator rounds every request up to one). Page-locking is slow (on an H100 host a 256 MiB
chunk took ~0.17 s, ~25 s for the GPU default's 36.75 GiB), so a background thread allocates the next chunk while
the current one fills, until the epoch's expected size is reached. Nothing is written to disk: a resumed run starts
with an empty memory and keeps the samples again as it captures them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import psutil
import torch

from dflash.config.errors import ConfigError
from dflash.extract.feature_cache import cached_epochs

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 28  # 256 MiB

# The share of the host's available memory the features may take when capture.cache_budget_bytes is null: the
# rest is for the dataset's pages, the trainer's own host memory and the other processes of the machine.
MEMORY_SHARE = 0.5


class FeatureMemory:
    """Sample index -> its kept feature rows, per key ("hidden", and "target_final" when the loss needs it).

    pin_memory: page-locked chunks (training on CUDA), so every copy in and out is asynchronous; expected_bytes:
    what the epoch will keep (epoch_bytes), up to which the next chunk is allocated ahead, in the background.
    """

    def __init__(self, pin_memory: bool, chunk_bytes: int = CHUNK_BYTES, expected_bytes: int = 0) -> None:
        self.pin_memory, self.chunk_bytes, self.expected_bytes = pin_memory, chunk_bytes, expected_bytes
        self.chunks: dict[str, list[torch.Tensor]] = {}  # per key: [rows, width] views of the chunks
        self.filled: dict[str, int] = {}  # per key: rows used in its last chunk
        self.where: dict[int, dict[str, tuple[int, int]]] = {}  # sample -> key -> (chunk, first row)
        self.lengths: dict[int, int] = {}
        self._allocator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-feature-memory")
        self._next: Future | None = self._allocator.submit(self._allocate) if expected_bytes > 0 else None

    def __contains__(self, index: int) -> bool:
        return index in self.where

    def holds(self, indices: Sequence[int]) -> bool:
        return all(index in self.where for index in indices)

    @property
    def bytes(self) -> int:
        return self.chunk_bytes * sum(len(chunks) for chunks in self.chunks.values())

    def keep(self, indices: Sequence[int], lengths: Sequence[int], batch: dict[str, torch.Tensor]) -> None:
        """Keep each sample's first `length` rows of every tensor of `batch` ([rows, width, D], row i the sample
        indices[i]); a sample kept already is skipped (placeholders repeat samples)."""
        for row, (index, length) in enumerate(zip(indices, lengths)):
            if index not in self.where:
                self.where[index] = {key: self._append(key, tensor[row, :length]) for key, tensor in batch.items()}
                self.lengths[index] = length

    def forget(self, indices: Sequence[int]) -> None:
        """Read these samples back no more (their check failed): their rows stay allocated, unused."""
        for index in indices:
            self.where.pop(index, None)
            self.lengths.pop(index, None)

    def recall(self, indices: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """The kept tensors of `indices` right-padded with zeros to the longest, [rows, width, D] on `device`."""
        lengths = [self.lengths[index] for index in indices]
        batch = {}
        for key, chunks in self.chunks.items():
            padded = torch.zeros(len(indices), max(lengths), chunks[0].shape[1], dtype=chunks[0].dtype,
                                 device=device)
            for row, (index, length) in enumerate(zip(indices, lengths)):
                chunk, first = self.where[index][key]
                padded[row, :length].copy_(chunks[chunk][first : first + length], non_blocking=True)
            batch[key] = padded
        return batch

    def _append(self, key: str, rows: torch.Tensor) -> tuple[int, int]:
        """Copy `rows` [length, D] into the key's last chunk, or a new one when it is full; where they went."""
        chunks = self.chunks.setdefault(key, [])
        per_chunk = self.chunk_bytes // (rows.shape[1] * rows.element_size())
        if rows.shape[0] > per_chunk:
            raise ValueError(f"a sample of {rows.shape[0]} tokens does not fit a {self.chunk_bytes} byte chunk of "
                             f"the feature memory ({per_chunk} rows of {key!r})")
        if not chunks or self.filled[key] + rows.shape[0] > per_chunk:
            raw = self._chunk()
            size = per_chunk * rows.shape[1] * rows.element_size()
            chunks.append(raw[:size].view(rows.dtype).view(per_chunk, rows.shape[1]))
            self.filled[key] = 0
        first = self.filled[key]
        chunks[-1][first : first + rows.shape[0]].copy_(rows, non_blocking=True)
        self.filled[key] = first + rows.shape[0]
        return len(chunks) - 1, first

    def _chunk(self) -> torch.Tensor:
        """A new chunk: the one allocated ahead (else allocated now); the next one is started while the chunks
        (this one counted) stay below the expected size."""
        ahead, self._next = self._next, None
        raw = ahead.result() if ahead is not None else self._allocate()
        if self.bytes + self.chunk_bytes < self.expected_bytes:
            self._next = self._allocator.submit(self._allocate)
        return raw

    def _allocate(self) -> torch.Tensor:
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)


def epoch_bytes(tokens: int, widths: dict[str, tuple[int, torch.dtype]]) -> int:
    """Host bytes of one epoch's features: every token's row of each key (width, dtype)."""
    return tokens * sum(width * torch.empty(0, dtype=dtype).element_size() for width, dtype in widths.values())


def choose_feature_memory(mode: str, budget_bytes: int | None, needed: int, *, epochs: int, world_size: int,
                          pin_memory: bool) -> FeatureMemory | None:
    """A FeatureMemory when capture.cache (`mode`: auto | true | false) keeps the first epoch, else None; a line
    says which and why.

    needed: one epoch's bytes (epoch_bytes); epochs: of training (those the steps reach); world_size: trainer
    ranks. One rank only: each rank captures other samples every epoch, so with several its micro-batches would
    rarely be all in its own memory. It fits within budget_bytes (None: MEMORY_SHARE of the host's available
    memory) and the available memory; with mode "true" it must (else ConfigError).
    """
    off = "[train] colocated features captured every epoch"
    if mode == "false":
        return None
    if epochs < 2:
        logger.info(f"{off}: training runs one epoch, which nothing would read back")
        return None
    if world_size > 1:
        if mode == "true":
            raise ConfigError(f"capture.cache=true with capture=colocated keeps a rank's own samples, and each of "
                              f"the {world_size} trainer ranks captures other samples every epoch: set "
                              f"capture.cache=auto or false (or train on one rank)")
        logger.info(f"{off}: each of the {world_size} trainer ranks captures other samples every epoch")
        return None
    available = psutil.virtual_memory().available
    room = int(available * MEMORY_SHARE) if budget_bytes is None else min(int(budget_bytes), available)
    where = f"{MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB of host memory available" \
        if budget_bytes is None else "capture.cache_budget_bytes"
    if not cached_epochs(mode, needed, None, room, room_name=where):
        logger.info(f"{off}: one epoch's features take {needed / 2**30:.2f} GiB, more than the "
                    f"{room / 2**30:.2f} GiB of {where}")
        return None
    kind = "page-locked host memory" if pin_memory else "host memory"
    logger.info(f"[train] colocated features kept in {kind} for the later epochs: one epoch takes "
                f"{needed / 2**30:.2f} GiB (room: {room / 2**30:.2f} GiB, {where}); a micro-batch whose samples are "
                "all kept skips the target's forward")
    return FeatureMemory(pin_memory, expected_bytes=needed)
