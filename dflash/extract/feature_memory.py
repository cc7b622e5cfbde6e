"""The first epoch's colocated features, kept in host memory for the later epochs (capture.cache with
capture=colocated).

Colocated capture runs the frozen target once per micro-batch, every epoch, and a target's features depend on the
tokens alone: every epoch after the first recomputes what the first computed, and for a small target that forward is
a large share of the training step. The first epoch keeps each sample's rows in host memory as it captures them, and
a later micro-batch whose samples are all kept is put together from them: one zero-filled tensor on the device and
one copy per sample, with no target forward and no host wait. When one epoch does not fit, what fits is kept, and a
micro-batch runs the target on its samples not kept only (colocated.py); the later epochs batch the kept samples
apart from the others (dflash/data/batch_plan.py, BatchPlan.kept), so that most micro-batches are kept whole.

On CUDA the rows live in page-locked chunks, so the copies (device to host when kept, host to device when read) are
queued on the stream like kernels: a read of a sample is ordered after the copy that kept it, and the host never
touches the rows itself. Chunks are each a power of two of bytes (torch's page-locked allocator rounds every request
up to one) that holds the longest sample. Page-locking is slow (about 0.15 s for 256 MiB on an H100 host) and stalls
the training thread's own CUDA calls while it runs, from any thread: one chunk allocated ahead while the last filled
still cost the GPU default's first epoch 112 steps of ~0.24 s instead of ~0.09 (session 36). So a background thread
allocates the epoch's expected chunks one after another from the start, most of them while the first step compiles
(~35 s there), and the first epoch takes them as it fills them; never while CUDA graphs record. Memory that cannot be
page-locked ends the keeping, not the run: the samples kept so far are still read back. Nothing is written to disk: a
resumed run starts with an empty memory and keeps the samples again as it captures them; `close` hands the chunks back
when training ends.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Sequence

import psutil
import torch

from dflash.config.errors import ConfigError
from dflash.extract.feature_cache import cached_epochs
from dflash.inference.cuda_graphs import RECORDING

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 28  # 256 MiB, or the power of two that holds the longest sample when that is larger

# The share of the host's available memory the features may take when capture.cache_budget_bytes is null: the
# rest is for the dataset's pages, the trainer's own host memory and the other processes of the machine.
MEMORY_SHARE = 0.5

Widths = dict[str, tuple[int, torch.dtype]]  # per key: the row's width and dtype


class FeatureMemory:
    """Sample index -> its kept feature rows, per key ("hidden", and "target_final" when the loss needs it).

    pin_memory: page-locked chunks (training on CUDA), so every copy in and out is asynchronous; chunk_bytes: each
    chunk's size (a power of two, holding the longest sample's rows of any key); expected_bytes: what the epoch will
    allocate (allocation_bytes, a bound), which a background thread allocates from the start, chunk after chunk;
    limit_bytes: the most the chunks may take (None: no limit), past which the samples are captured every epoch;
    samples: the epoch's samples, once all of them are kept (or the memory is full) the chunks allocated ahead that no
    sample took go back to the system; widths: the kept keys' rows, in the order a batch holds them (what
    prefix_that_fits counts with).
    """

    def __init__(self, pin_memory: bool, chunk_bytes: int = CHUNK_BYTES, expected_bytes: int = 0,
                 limit_bytes: int | None = None, samples: int | None = None, widths: Widths | None = None) -> None:
        self.pin_memory, self.chunk_bytes, self.limit_bytes = pin_memory, chunk_bytes, limit_bytes
        self.samples, self.widths = samples, widths
        self.only: set[int] | None = None  # keep_only's samples (None: every sample, while there is room)
        # Allocated ahead no further than the whole chunks the limit allows.
        self.expected_bytes = expected_bytes if limit_bytes is None else \
            min(expected_bytes, limit_bytes // chunk_bytes * chunk_bytes)
        self.chunks: dict[str, list[torch.Tensor]] = {}  # per key: [rows, width] views of the chunks
        self.filled: dict[str, int] = {}  # per key: rows used in its last chunk
        self.where: dict[int, dict[str, tuple[int, int]]] = {}  # sample -> key -> (chunk, first row)
        self.lengths: dict[int, int] = {}
        self.full = False  # no new chunk (the limit, or memory refused): only what fits the chunks there are is kept
        # The chunks the thread allocates ahead, handed over in order through the queue (or the error that ended it).
        self._ahead, self._taken, self._closed = self.expected_bytes // chunk_bytes, 0, False
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._allocating = threading.Lock()  # held by the thread while it allocates
        self._thread = None
        if self._ahead:
            self._thread = threading.Thread(target=self._allocate_ahead, name="dflash-feature-memory", daemon=True)
            self._thread.start()

    def holds(self, indices: Sequence[int]) -> bool:
        return all(index in self.where for index in indices)

    @property
    def allocated_bytes(self) -> int:
        return self.chunk_bytes * sum(len(chunks) for chunks in self.chunks.values())

    def prefix_that_fits(self, lengths: Sequence[int]) -> int:
        """How many samples of these token counts, kept in this order into empty chunks, fit within limit_bytes
        (all of them without a limit): the chunks are filled as `keep` fills them, key after key of `widths`."""
        if self.limit_bytes is None:
            return len(lengths)
        if not self.widths:
            raise ValueError("prefix_that_fits needs the memory's widths")
        per_chunk = {key: self.chunk_bytes // row_bytes(width, dtype) for key, (width, dtype) in self.widths.items()}
        filled, chunks = dict.fromkeys(per_chunk, None), 0
        for count, length in enumerate(lengths):
            for key, rows in per_chunk.items():
                if filled[key] is None or filled[key] + length > rows:
                    if (chunks + 1) * self.chunk_bytes > self.limit_bytes:
                        return count
                    chunks, filled[key] = chunks + 1, 0
                filled[key] += length
        return len(lengths)

    def keep_only(self, indices: Sequence[int]) -> None:
        """Keep these samples alone from now on (the plan's kept class, which later epochs batch apart): a micro-batch
        of samples outside them is captured every epoch anyway, and rows kept for them would crowd them out."""
        self.only = set(indices)
        self.samples = len(self.only)

    def keep(self, indices: Sequence[int], lengths: Sequence[int], batch: dict[str, torch.Tensor]) -> None:
        """Keep each sample's first `length` rows of every tensor of `batch` ([rows, width, D], row i the sample
        indices[i]); a sample kept already, or outside keep_only's, is skipped (placeholders repeat samples)."""
        for row, (index, length) in enumerate(zip(indices, lengths)):
            if index in self.where or (self.only is not None and index not in self.only):
                continue
            places = {}
            for key, tensor in batch.items():
                place = self._append(key, tensor[row, :length])
                if place is None:  # full: this sample and the ones after it are captured every epoch
                    return
                places[key] = place
            self.where[index], self.lengths[index] = places, length
            if len(self.where) == self.samples:  # the whole epoch: what was allocated for more is not needed
                self._stop_ahead()

    def forget(self, indices: Sequence[int]) -> None:
        """Read these samples back no more (their check failed): their rows stay allocated, unused."""
        for index in indices:
            self.where.pop(index, None)
            self.lengths.pop(index, None)

    def recall(self, indices: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
        """The kept tensors of `indices` right-padded with zeros to the longest, [rows, width, D] on `device`."""
        width = max(self.lengths[index] for index in indices)
        batch = {key: torch.zeros(len(indices), width, chunks[0].shape[1], dtype=chunks[0].dtype, device=device)
                 for key, chunks in self.chunks.items()}
        self.recall_into(batch, range(len(indices)), indices)
        return batch

    def recall_into(self, batch: dict[str, torch.Tensor], rows: Sequence[int], indices: Sequence[int]) -> None:
        """Copy the kept rows of sample indices[i] into row rows[i] of each tensor of `batch` (its first
        `length` positions; the rest is left as it is)."""
        for key, chunks in self.chunks.items():
            for row, index in zip(rows, indices):
                chunk, first = self.where[index][key]
                length = self.lengths[index]
                batch[key][row, :length].copy_(chunks[chunk][first : first + length], non_blocking=True)

    def close(self) -> None:
        """Hand every chunk back (to the system, not only to torch's page-locked cache) and stop the thread; nothing
        is kept after."""
        self.full = True
        self.chunks, self.filled, self.where, self.lengths = {}, {}, {}, {}
        self._stop_ahead()

    def _stop_ahead(self) -> None:
        """No more chunks ahead: the thread stops, and those it made that no sample took go back to the system (the
        epoch's size is a bound: the chunks' unused ends are counted at their largest)."""
        with self._allocating:
            self._closed = True
        if self._thread is not None:
            self._thread.join()
        self._ahead, self._ready = self._taken, queue.SimpleQueue()  # past these, a chunk is allocated when needed
        if self.pin_memory and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # torch's cache of free page-locked blocks, to the system

    def _append(self, key: str, rows: torch.Tensor) -> tuple[int, int] | None:
        """Copy `rows` [length, D] into the key's last chunk, or a new one when it is full; where they went (None
        when no new chunk could be had)."""
        chunks = self.chunks.setdefault(key, [])
        per_chunk = self.chunk_bytes // (rows.shape[1] * rows.element_size())
        if rows.shape[0] > per_chunk:
            raise ValueError(f"a sample of {rows.shape[0]} tokens does not fit a {self.chunk_bytes} byte chunk of "
                             f"the feature memory ({per_chunk} rows of {key!r}): size the chunks for the longest")
        if not chunks or self.filled[key] + rows.shape[0] > per_chunk:
            raw = self._chunk()
            if raw is None:
                return None
            size = per_chunk * rows.shape[1] * rows.element_size()
            chunks.append(raw[:size].view(rows.dtype).view(per_chunk, rows.shape[1]))
            self.filled[key] = 0
        first = self.filled[key]
        chunks[-1][first : first + rows.shape[0]].copy_(rows, non_blocking=True)
        self.filled[key] = first + rows.shape[0]
        return len(chunks) - 1, first

    def _chunk(self) -> torch.Tensor | None:
        """A new chunk: the next one allocated ahead (waited for when the thread has not made it yet), past those
        one allocated now; None when the limit is reached or memory is refused."""
        if self.full:
            return None
        if self.limit_bytes is not None and self.allocated_bytes + self.chunk_bytes > self.limit_bytes:
            self.full = True
            self._stop_ahead()
            logger.info(f"[train] colocated features: host memory full at its limit of "
                        f"{self.limit_bytes / 2**30:.2f} GiB with {len(self.where):,} samples kept; samples that do "
                        "not fit what is left are captured every epoch")
            return None
        try:
            if self._taken < self._ahead:
                self._taken += 1
                made = self._ready.get()
                if isinstance(made, BaseException):
                    raise made
                return made
            return self._allocate()
        except RuntimeError as error:  # page-locked memory can be refused (the system's limits, the run's growth)
            logger.warning(f"[train] no more colocated features kept in host memory ({len(self.where):,} samples "
                           f"kept; the others are captured every epoch): {error}")
            self.full = True
            self._stop_ahead()
            return None

    def _allocate_ahead(self) -> None:
        """The thread's work: the expected chunks, one after another, each put in the queue; an error ends it (and
        is put there for the chunk that would have come next)."""
        for _ in range(self._ahead):
            # Never while CUDA graphs record (capture.cuda_graphs, the held-out replay's step): a capture fails when
            # another thread calls into CUDA. Nothing a capture runs keeps a sample, which would wait for this thread.
            with self._allocating, RECORDING:
                if self._closed:
                    return
                try:
                    made = self._allocate()
                except BaseException as error:  # handed over, so that the training thread never waits for nothing
                    self._ready.put(error)
                    return
            self._ready.put(made)

    def _allocate(self) -> torch.Tensor:
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)


def row_bytes(width: int, dtype: torch.dtype) -> int:
    return width * torch.empty((), dtype=dtype).element_size()


def chunk_size(longest: int, widths: Widths) -> int:
    """CHUNK_BYTES, or the power of two that holds the longest sample's rows of the widest key when that is more."""
    widest = max(row_bytes(width, dtype) for width, dtype in widths.values())
    return max(CHUNK_BYTES, 1 << math.ceil(math.log2(longest * widest)))


def allocation_bytes(tokens: int, longest: int, widths: Widths, chunk_bytes: int) -> int:
    """Host bytes one epoch's features take in chunks: every token's row of each key (width, dtype), plus at most
    one sample's rows left unused at the end of each chunk and one chunk per key that is partly filled."""
    total = 0
    for width, dtype in widths.values():
        rows_per_chunk = chunk_bytes // row_bytes(width, dtype)
        chunks = tokens // max(rows_per_chunk - longest, 1) + 1  # each chunk but the last holds more than that
        total += chunks * chunk_bytes
    return total


def choose_feature_memory(mode: str, budget_bytes: int | None, *, tokens: int, longest: int, widths: Widths,
                          epochs: int, world_size: int, pin_memory: bool,
                          samples: int | None = None) -> FeatureMemory | None:
    """A FeatureMemory when capture.cache (`mode`: auto | true | false) keeps the first epoch, else None; a line
    says which and why.

    tokens, longest, samples: the dataset's tokens, its longest sample and its samples; widths: the kept keys' rows;
    epochs: those of training still to run (a resumed run counts from its step); world_size: trainer ranks. One rank
    only: each rank captures other samples every epoch, so with several its micro-batches would rarely be all in its
    own memory. The chunks of one epoch (allocation_bytes) fit within budget_bytes (None: MEMORY_SHARE of the host's
    available memory) and the available memory; with mode "true" they must (else ConfigError), with "auto" the
    memory keeps what fits (the first samples of the first epoch, which the later epochs batch apart: BatchPlan.kept),
    unless not one chunk per key fits.
    """
    off = "[train] colocated features captured every epoch"
    if mode == "false":
        return None
    if epochs < 2:
        logger.info(f"{off}: training has one epoch left to run, which nothing would read back")
        return None
    if world_size > 1:
        if mode == "true":
            raise ConfigError(f"capture.cache=true with capture=colocated keeps a rank's own samples, and each of "
                              f"the {world_size} trainer ranks captures other samples every epoch: set "
                              f"capture.cache=auto or false (or train on one rank)")
        logger.info(f"{off}: each of the {world_size} trainer ranks captures other samples every epoch")
        return None
    chunk_bytes = chunk_size(longest, widths)
    needed = allocation_bytes(tokens, longest, widths, chunk_bytes)
    available = psutil.virtual_memory().available
    room = int(available * MEMORY_SHARE) if budget_bytes is None else min(int(budget_bytes), available)
    where = f"{MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB of host memory available" \
        if budget_bytes is None else "capture.cache_budget_bytes"
    kind = "page-locked host memory" if pin_memory else "host memory"
    if not cached_epochs(mode, needed, None, room, room_name=where):  # auto: part of the epoch
        if room < len(widths) * chunk_bytes:
            logger.info(f"{off}: one epoch's features take {needed / 2**30:.2f} GiB, and {where} leaves "
                        f"{room / 2**30:.2f} GiB")
            return None
        logger.info(f"[train] colocated features kept in {kind} for the later epochs, in part: one epoch takes "
                    f"{needed / 2**30:.2f} GiB, more than the {room / 2**30:.2f} GiB of {where}, so about "
                    f"{room / needed:.0%} of the epoch's rows are kept, the first epoch's first samples; the later "
                    "epochs batch them apart, and a micro-batch of kept samples alone skips the target's forward")
        return FeatureMemory(pin_memory, chunk_bytes, expected_bytes=needed, limit_bytes=room, samples=samples,
                             widths=widths)
    logger.info(f"[train] colocated features kept in {kind} for the later epochs: one epoch takes "
                f"{needed / 2**30:.2f} GiB (room: {room / 2**30:.2f} GiB, {where}); a micro-batch whose samples are "
                "all kept skips the target's forward")
    return FeatureMemory(pin_memory, chunk_bytes, expected_bytes=needed, samples=samples, widths=widths)
