"""Online capture: capture workers stream features to trainer ranks through a bounded spool directory.

The trainer reads `store[index]` in an order fixed in advance by its BatchPlan (dflash/train/batches.py): every
slot of every global batch of every epoch, placeholders included, is one *item* g = (epoch, step, slot), and each
item is read by exactly one rank, in increasing g on that rank. So both sides enumerate the same item stream:

* capture workers claim *chunks* of consecutive items, capture them (length-bucketed batches, the offline path)
  and write one file per item, `data/w{share}/i{g:012d}.safetensors`, a one-sample file of the format every
  captured sample has on disk (sample_format.py), written under a temp name and renamed into place;
* trainer rank r (`OnlineFeatureSource`) waits for its next item's file, reads it, records the item in its cursor
  file `ranks/r{r}` (atomically) and deletes the file.

Budget: the spool's byte budget is split into one share per worker; a worker claims a new chunk only when its
share can hold it (backpressure), so the budget is never exceeded. Liveness: every worker touches
`workers/w{id}` every few seconds. A claim (`claims/c{chunk}.{generation}`, created by an exclusive hard link)
whose owner's heartbeat is older than `stale_after_s` is taken over by a live worker, which creates the next
generation and writes the chunk's missing items into its OWN share (readers look in every share): each share has
one writer, so its budget check cannot race with another process's. An item is finished when its file exists or
its rank's cursor has passed it (the file is checked first: a consumer writes its cursor before deleting), so a
takeover never redoes a consumed item and never loses one. A worker wrongly judged dead (stalled past
`stale_after_s`) may still rename an item into place after the trainer consumed it: every writer re-reads the
item's cursor after its rename and deletes its copy when the item was consumed, and the consumer deletes every
share's copy, so no orphan file is left holding budget.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dflash.extract.capture import bytes_per_token, capture_rows
from dflash.data.feature_source import FeatureSource, Sample
from dflash.extract.feature_cache import FeatureCache
from dflash.extract.sample_format import decode_single, encode, load, sample_tensors
from dflash.extract.store import store_dtype
from dflash.run_files import atomic_write
from dflash.models.targets.base import TargetAdapter
from dflash.data.batch_plan import BatchPlan
from dflash.data.sample_sizes import sample_lengths

logger = logging.getLogger(__name__)

_POLL_S = 0.02
# A worker waiting for room polls less and less often, up to this: each poll stats every item of the chunks in
# flight, which adds up on a shared file system with many workers, while a spool full enough to wait on keeps the
# trainer busy for longer than this.
_MAX_WAIT_POLL_S = 0.32
_FILE_OVERHEAD_BYTES = 1 << 12  # safetensors header and alignment of one item file, counted generously


@dataclass(frozen=True)
class ItemStream:
    """The trainer's reads as one numbered stream: item g -> (epoch, sample index, rank)."""

    plan: BatchPlan
    epochs: int

    @property
    def items_per_epoch(self) -> int:
        return self.plan.steps_per_epoch * self.plan.global_batch_size

    @property
    def num_items(self) -> int:
        return self.epochs * self.items_per_epoch

    def describe(self) -> dict[str, int | str]:
        p = self.plan
        return {"num_samples": p.num_samples, "micro_batch_size": p.micro_batch_size, "world_size": p.world_size,
                "grad_accum": p.grad_accum, "seed": p.seed, "epochs": self.epochs,
                "group_by_length": p.group_by_length, "lengths_digest": p.lengths_digest}

    def item(self, g: int) -> tuple[int, int, int]:
        """(epoch, sample index, rank) of item g; the same dealing rule as BatchPlan.micro_batches."""
        if not 0 <= g < self.num_items:
            raise IndexError(f"item {g} out of range for a stream of {self.num_items} items")
        epoch, rest = divmod(g, self.items_per_epoch)
        step, slot = divmod(rest, self.plan.global_batch_size)
        order = _epoch_order(self.plan, epoch)
        position = step * self.plan.global_batch_size + slot
        if position < self.plan.num_samples:
            index = order[position]
        else:  # placeholder slots of the last global batch repeat the epoch's first samples
            index = order[(position - self.plan.num_samples) % self.plan.num_samples]
        per_micro = self.plan.micro_batch_size * self.plan.world_size
        rank = (slot % per_micro) // self.plan.micro_batch_size
        return epoch, index, rank


@lru_cache(maxsize=4)
def _epoch_order(plan: BatchPlan, epoch: int) -> list[int]:
    return plan.epoch_order(epoch)


def share_dir(spool: str | Path, share: int) -> Path:
    """The folder of one worker's share of the item files in a spool directory."""
    return Path(spool) / "data" / f"w{share}"


class Spool:
    """Paths and small atomic files of one spool directory."""

    def __init__(self, path: str | Path, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.path = Path(path)
        self.num_workers = num_workers
        for sub in ["claims", "workers", "ranks"]:
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        for share in range(num_workers):
            share_dir(self.path, share).mkdir(parents=True, exist_ok=True)

    def check_stream(self, stream: ItemStream) -> None:
        """Record the stream's plan in `stream.json` (the first caller) or check it matches (everyone else):
        workers and trainers that number items differently would hand samples to the wrong rank."""
        file, wanted = self.path / "stream.json", stream.describe()
        if not file.is_file():
            tmp = self.path / f".stream.json.tmp-{os.getpid()}-{threading.get_ident()}"
            tmp.write_text(json.dumps(wanted) + "\n")
            try:
                os.link(tmp, file)  # atomic, and fails when another process recorded its plan first
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        recorded = json.loads(file.read_text())
        if recorded != wanted:
            raise ValueError(
                f"spool {self.path} serves the batch plan {recorded}, this process has {wanted}: start the capture "
                "workers and the trainers with the same data, micro batch, world size, grad accum, seed and epochs "
                "(or use an empty spool folder)"
            )

    def item_path(self, share: int, g: int) -> Path:
        return share_dir(self.path, share) / f"i{g:012d}.safetensors"

    def find_item(self, g: int) -> Path | None:
        for share in range(self.num_workers):
            path = self.item_path(share, g)
            if path.is_file():
                return path
        return None

    def share_bytes(self, share: int) -> int:
        """Bytes of item files (and temp files) currently held in one worker's share."""
        total = 0
        for entry in os.scandir(share_dir(self.path, share)):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # consumed while we looked
                pass
        return total

    def remove_temps(self, writer: int) -> None:
        """Delete the half-written item files of worker `writer` (call only when it is dead or is the caller)."""
        for path in self.path.glob(f"data/w*/.*.tmp-w{writer}"):
            path.unlink(missing_ok=True)

    def cursor(self, rank: int) -> int:
        """The first item rank `rank` has not consumed yet (-1 when it has consumed none)."""
        file = self.path / "ranks" / f"r{rank}"
        return int(file.read_text()) if file.is_file() else -1

    def set_cursor(self, rank: int, g: int) -> None:
        atomic_write(self.path / "ranks" / f"r{rank}", str(g), durable=False)

    def remove_item(self, g: int) -> None:
        """Delete every share's copy of item g (two exist when a stalled worker and its taker both wrote it)."""
        for share in range(self.num_workers):
            self.item_path(share, g).unlink(missing_ok=True)

    def consumed_below(self, world_size: int) -> int:
        """An item number below which every rank has consumed everything: the lowest of the ranks' cursors."""
        return max(min(self.cursor(r) for r in range(world_size)), 0)

    def finished(self, stream: ItemStream, g: int) -> bool:
        # The file first: a consumer moves its cursor before deleting, so "no file, cursor not past" is unfinished.
        if self.find_item(g) is not None:
            return True
        return self.cursor(stream.item(g)[2]) > g

    def heartbeat(self, worker: int) -> None:
        (self.path / "workers" / f"w{worker}").touch()

    def alive(self, worker: int, stale_after_s: float) -> bool:
        file = self.path / "workers" / f"w{worker}"
        try:
            return time.time() - file.stat().st_mtime < stale_after_s
        except FileNotFoundError:
            return False

    def claim(self, chunk: int) -> tuple[int, int, int] | None:
        """(generation, owner, share) of a chunk's newest claim, or None when unclaimed.

        Generations are made one after the other (0, then the newest + 1 on a takeover), so probing 0, 1, ... finds
        the newest with a stat per generation, where listing the claims folder would grow with the run.
        """
        generation = 0
        while (self.path / "claims" / f"c{chunk:09d}.{generation}").exists():
            generation += 1
        if generation == 0:
            return None
        owner, share = (int(x) for x in (self.path / "claims" / f"c{chunk:09d}.{generation - 1}").read_text().split())
        return generation - 1, owner, share

    def try_claim(self, chunk: int, generation: int, owner: int, share: int) -> bool:
        """Create claim `generation` of `chunk` atomically, content included; False when another worker made it
        first. A hard link fails when the name exists, like O_EXCL, but never shows a reader an empty file."""
        file = self.path / "claims" / f"c{chunk:09d}.{generation}"
        tmp = self.path / "claims" / f".c{chunk:09d}.{generation}.tmp-w{owner}-{os.getpid()}"
        tmp.write_text(f"{owner} {share}\n")
        try:
            os.link(tmp, file)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()


def _write_item(spool: Spool, share: int, g: int, tensors: dict[str, torch.Tensor], writer: int) -> None:
    # The temp name carries the writer's id so that a takeover removes only a dead writer's leftovers. Serialised
    # in memory (encode): save_file may write through a temp file of its own (`.tmpXXXXXX`), which a SIGKILL would
    # leave in the share, unnamed by writer and never removed.
    atomic_write(spool.item_path(share, g), encode(tensors), tag=f"w{writer}", durable=False)


class CaptureWorker:
    """One capture process: claims chunks of the item stream and writes their items into the spool."""

    def __init__(self, adapter: TargetAdapter, dataset: Any, spool: Spool, stream: ItemStream,
                 layer_ids: list[int], *, worker: int, budget_bytes: int, chunk_items: int = 16,
                 batch_tokens: int = 8192, dtype: str = "bfloat16", stale_after_s: float = 60.0,
                 pack: bool = False) -> None:
        if not 0 <= worker < spool.num_workers:
            raise ValueError(f"worker id {worker} out of range for {spool.num_workers} workers")
        if len(dataset) != stream.plan.num_samples:
            raise ValueError(f"the dataset has {len(dataset)} samples, the batch plan {stream.plan.num_samples}")
        spool.check_stream(stream)
        self.adapter, self.spool, self.stream = adapter, spool, stream
        self.layer_ids = adapter.check_layer_ids(layer_ids)
        self.worker, self.chunk_items, self.batch_tokens, self.pack = worker, chunk_items, batch_tokens, pack
        if chunk_items < 1 or batch_tokens < 1:
            raise ValueError(f"chunk_items ({chunk_items}) and batch_tokens ({batch_tokens}) must be positive")
        self.dtype = store_dtype(dtype)
        self.share_budget = budget_bytes // spool.num_workers
        self.stale_after_s = stale_after_s
        self.table = dataset.with_format("arrow")
        self.lengths = sample_lengths(dataset).tolist()
        width = len(self.layer_ids) * adapter.hidden_size
        self.token_bytes = bytes_per_token(width, len(self.layer_ids), self.dtype)
        self.num_chunks = -(-stream.num_items // chunk_items)
        # Throughput counters: real tokens and items captured, seconds spent capturing (waits excluded).
        self.tokens_captured, self.items_captured, self.capture_s = 0, 0, 0.0
        sizes = [self.chunk_bytes(c) for c in range(self.num_chunks)]
        for c, size in enumerate(sizes):  # fail at once, not after a deadlock, when one chunk cannot fit
            if size > self.share_budget:
                raise ValueError(
                    f"chunk {c} of {chunk_items} items needs {size} bytes, more than one worker's "
                    f"share of the spool budget ({self.share_budget} = {budget_bytes} / {spool.num_workers}): "
                    "raise the budget or lower chunk_items"
                )
        # Every claim keeps room in its share for the lower chunks other workers still owe (so a dead worker's
        # chunk can always be taken over): with fewer than num_workers chunks per share, workers mostly take turns.
        if worker == 0 and sizes and self.share_budget < spool.num_workers * max(sizes):
            logger.info(f"[capture] warning: one worker's spool share ({self.share_budget} bytes) holds fewer "
                        f"than {spool.num_workers} chunks of up to {max(sizes)} bytes, so the capture workers will "
                        "often run one after another: raise capture.budget_bytes or lower capture.chunk_items")

    def chunk_items_of(self, chunk: int) -> range:
        return range(chunk * self.chunk_items, min((chunk + 1) * self.chunk_items, self.stream.num_items))

    def item_bytes(self, g: int) -> int:
        return self.lengths[self.stream.item(g)[1]] * self.token_bytes + _FILE_OVERHEAD_BYTES

    def chunk_bytes(self, chunk: int) -> int:
        return sum(self.item_bytes(g) for g in self.chunk_items_of(chunk))

    def _capture(self, chunk: int, share: int, generation: int) -> None:
        """Capture the chunk's unfinished items into `share` (finished ones are kept, never redone).

        Written only while this worker's claim (`generation`) is the chunk's newest: a worker wrongly judged dead
        (a stalled disk, a suspended process) that another has taken over from stops writing, and an item that
        was finished meanwhile is not written again after a trainer consumed it.
        """
        todo = [g for g in self.chunk_items_of(chunk) if not self.spool.finished(self.stream, g)]
        if not todo:
            return
        started = time.perf_counter()
        samples = [self.stream.item(g)[1] for g in todo]
        rows = self.table[samples]
        progress = tqdm(disable=True)
        arrays = capture_rows(self.adapter, rows, 0, self.layer_ids, self.batch_tokens, self.dtype, 0, progress,
                              self.pack)
        offsets = arrays["offsets"]
        for j, g in enumerate(todo):
            start, end = int(offsets[j]), int(offsets[j + 1])
            scales = arrays["scales"][start:end] if "scales" in arrays else None
            tensors = sample_tensors(arrays["hidden"][start:end], arrays["input_ids"][start:end],
                                     arrays["loss_mask"][start:end], torch.tensor([0, end - start]), scales,
                                     what=f"item {g}")
            claim = self.spool.claim(chunk)
            if claim is None or claim[:2] != (generation, self.worker):
                return  # taken over: the new owner writes the rest
            if self.spool.finished(self.stream, g):
                continue
            _write_item(self.spool, share, g, tensors, self.worker)
            # Stalled between the checks above and the rename, we may have written an item the trainer consumed
            # meanwhile (its cursor moved first, then it deleted the copies it saw): ours would never be read.
            if self.spool.cursor(self.stream.item(g)[2]) > g:
                self.spool.item_path(share, g).unlink(missing_ok=True)
        self.tokens_captured += int(offsets[-1])
        self.items_captured += len(todo)
        self.capture_s += time.perf_counter() - started

    def _missing_bytes(self, chunk: int) -> int:
        """Bytes of the chunk's items still to write (a taken-over chunk may be partly written)."""
        return sum(self.item_bytes(g) for g in self.chunk_items_of(chunk) if not self.spool.finished(self.stream, g))

    def _room(self, share: int, chunk: int, reserve: int = 0) -> bool:
        """Whether `share` holds the chunk's items still to write, with `reserve` bytes to spare."""
        return self.spool.share_bytes(share) + self._missing_bytes(chunk) + reserve <= self.share_budget

    def _others_unwritten(self, low: int, high: int) -> int:
        """Bytes still to write of the chunks in [low, high) that other workers claimed.

        A new chunk is claimed only if our share keeps this much free: should their owners die for good, we take
        those lower chunks over into our share, which the later items of our new chunk must then not have filled
        (the trainer reads no item of ours until the lower ones are written).
        """
        total = 0
        for c in range(low, high):
            claim = self.spool.claim(c)
            if claim is not None and claim[1] != self.worker:
                total += self._missing_bytes(c)
        return total

    def run(self) -> None:
        """Capture until every item of the stream is written or consumed."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(self.stale_after_s / 4):
                self.spool.heartbeat(self.worker)

        self.spool.heartbeat(self.worker)
        self.spool.remove_temps(self.worker)  # left by an earlier life of this worker id
        thread = threading.Thread(target=beat, daemon=True, name="spool-heartbeat")
        thread.start()
        mine: set[int] = set()  # chunks claimed in this life
        try:
            # Every chunk below the ranks' lowest cursor is consumed: start there, so that a (re)start late in a run
            # or after a resume neither checks nor claims the items already read one by one.
            low = frontier = self.spool.consumed_below(self.stream.plan.world_size) // self.chunk_items
            idle = 0  # polls in a row that found nothing to do
            while True:
                while low < self.num_chunks and all(
                        self.spool.finished(self.stream, g) for g in self.chunk_items_of(low)):
                    low += 1
                if low >= self.num_chunks:
                    return
                while frontier < self.num_chunks and self.spool.claim(frontier) is not None:
                    frontier += 1
                # Chunks claimed in an earlier life of this worker id look alive: redo them first.
                taken = self._take_over_stale(low, frontier, mine)
                if taken is True:
                    idle = 0
                    continue
                # A dead worker's chunk waits for room in our share: claiming later chunks now would fill the share
                # with items the trainer cannot reach before the missing ones, which could then never be written.
                if taken is None and frontier < self.num_chunks and \
                        self._room(self.worker, frontier, self._others_unwritten(low, frontier)):
                    if self.spool.try_claim(frontier, 0, self.worker, self.worker):
                        mine.add(frontier)
                        self._capture(frontier, self.worker, 0)
                    idle = 0
                    continue
                time.sleep(min(_POLL_S * 2 ** idle, _MAX_WAIT_POLL_S))
                idle += 1
        finally:
            stop.set()

    def _take_over_stale(self, low: int, high: int, mine: set[int]) -> bool | None:
        """Redo, into this worker's share, one chunk in [low, high) claimed by a dead worker or by this worker id in
        an earlier life (the lowest first). True when one was done, False when one waits for room in our share,
        None when there is none to take over."""
        for c in range(low, high):
            claim = self.spool.claim(c)
            if claim is None:
                continue
            generation, owner, _ = claim
            # A chunk of this life is ours to finish, unless another worker took it over meanwhile (we stalled)
            # and then died: then it is a dead worker's chunk like any other.
            if owner == self.worker and c in mine:
                continue
            if owner != self.worker and self.spool.alive(owner, self.stale_after_s):
                continue
            if all(self.spool.finished(self.stream, g) for g in self.chunk_items_of(c)):
                continue
            # The owner is dead: its half-written temp files would hold its share's budget forever.
            if owner != self.worker:
                self.spool.remove_temps(owner)
            # Like a new claim, a takeover keeps room for the lower chunks other workers still owe, and the lowest
            # waiting chunk goes first (a higher one taking the room could leave the lower one unwritable).
            if not self._room(self.worker, c, self._others_unwritten(low, c)):
                return False
            if self.spool.try_claim(c, generation + 1, self.worker, self.worker):
                mine.add(c)
                self._capture(c, self.worker, generation + 1)
                return True
        return None


class OnlineFeatureSource(FeatureSource):
    """The trainer side: a FeatureSource whose `[index]` returns this rank's next item from the spool.

    Reads must come in the order of the BatchPlan the stream was built from (the training loop's order); a
    different index raises ValueError. A resumed run starts at the step it resumes at: the session sets every
    rank's cursor there before the workers start (train/online_capture.py), and the source starts at its cursor.
    Each read blocks until the item's file exists (at most `timeout_s`); `hopeless`, when given, is polled while
    waiting and returns a reason to stop waiting (RuntimeError) or None.
    With a `cache` (feature_cache.py) the workers capture the first epoch only: its items are kept in the cache as
    they are read, and the items of later epochs are read from there.
    """

    def __init__(self, spool: Spool, stream: ItemStream, rank: int, *, timeout_s: float = 3600.0,
                 hopeless: Callable[[], str | None] | None = None, cache: FeatureCache | None = None) -> None:
        if not 0 <= rank < stream.plan.world_size:
            raise ValueError(f"rank {rank} out of range for a world of {stream.plan.world_size}")
        # With a cache the workers capture the first epoch only; the later ones are read back from the cache.
        spool.check_stream(ItemStream(stream.plan, epochs=1) if cache is not None else stream)
        self.spool, self.stream, self.rank, self.timeout_s = spool, stream, rank, timeout_s
        self.cache = cache
        self.hopeless = hopeless
        # Throughput counters: real tokens read and seconds spent waiting for features.
        self.tokens_read, self.wait_s = 0, 0.0
        self._next = self._advance(max(spool.cursor(rank), 0))

    def __len__(self) -> int:
        return self.stream.plan.num_samples

    def _advance(self, g: int) -> int:
        while g < self.stream.num_items and self.stream.item(g)[2] != self.rank:
            g += 1
        return g

    def __getitem__(self, index: int) -> Sample:
        g = self._next
        if g >= self.stream.num_items:
            raise IndexError(f"rank {self.rank} has read all {self.stream.epochs} epochs of the online stream")
        expected = self.stream.item(g)[1]
        if int(index) != expected:
            raise ValueError(
                f"online rank {self.rank}: item {g} is sample {expected}, the trainer asked for sample {index}: "
                "the trainer's batch plan (samples, micro batch, world size, grad accum, seed, epochs) differs "
                "from the capture workers'"
            )
        if self.cache is not None and g >= self.stream.items_per_epoch:
            tensors = self.cache.get(expected)
            self._next = self._advance(g + 1)
            return self._sample(tensors)
        started = time.monotonic()
        deadline = started + self.timeout_s
        while (path := self.spool.find_item(g)) is None:
            reason = self.hopeless() if self.hopeless is not None else None
            if reason is not None:
                raise RuntimeError(f"online rank {self.rank}: item {g} (sample {expected}) will not arrive: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"online rank {self.rank}: item {g} (sample {expected}) did not appear in {self.spool.path} "
                    f"within {self.timeout_s} s: are the capture workers running?"
                )
            time.sleep(_POLL_S)
        self.wait_s += time.monotonic() - started
        tensors = load(path)
        if self.cache is not None:
            self.cache.put(expected, tensors)  # before the cursor moves: a consumed item is always cached
        self.spool.set_cursor(self.rank, g + 1)
        self.spool.remove_item(g)  # after the cursor: a writer renaming a late copy now sees it consumed
        self._next = self._advance(g + 1)
        return self._sample(tensors)

    def _sample(self, tensors: dict[str, torch.Tensor]) -> Sample:
        self.tokens_read += int(tensors["input_ids"].numel())
        return decode_single(tensors)

