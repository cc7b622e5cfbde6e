"""A capture rank of capture=online over the job's process group: it captures its micro-batch units in order and
sends each to the trainer rank it belongs to once that rank gave it a credit (linked_source.py has the protocol).

Several units are captured together, up to `batch_tokens` tokens a forward, through the offline capture's own
code (capture_rows: packed or padded, the per-batch self-checks), so the features equal the offline store's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dflash.extract.linked_source import CREDIT, DATA, HEADER, STOP, posted, waited
from dflash.extract.rank_link import RankLink
from dflash.extract.rank_stream import UnitStream, encode_unit
from dflash.extract.sample_format import sample_tensors

if TYPE_CHECKING:
    from dflash.models.targets.base import TargetAdapter

# Sample indices -> each sample's stored tensors (sample_format.sample_tensors), in that order.
Producer = Callable[[list[int]], list[dict[str, torch.Tensor]]]


def target_producer(adapter: "TargetAdapter", dataset: Any, layer_ids: list[int], batch_tokens: int, dtype: str,
                    pack: bool, check_every: int = 0) -> Producer:
    """The target's features of dataset rows, as offline capture makes them: one sample in `check_every` (0: none)
    of those it captures, counted in the order it captures them, is compared with a plain forward of it alone."""
    from tqdm.auto import tqdm

    from dflash.extract.shard_rows import capture_rows
    from dflash.extract.forward_budget import ForwardBudget
    from dflash.extract.store import store_dtype

    table, feature_dtype = dataset.with_format("arrow"), store_dtype(dtype)
    layer_ids = adapter.check_layer_ids(layer_ids)
    budget = ForwardBudget(batch_tokens)  # halved for every later unit where a forward runs out of memory

    captured = 0

    def produce(indices: list[int]) -> list[dict[str, torch.Tensor]]:
        nonlocal captured
        arrays = capture_rows(adapter, table[indices], captured, layer_ids, budget, feature_dtype, check_every,
                              tqdm(disable=True), pack)
        captured += len(indices)
        offsets, samples = arrays["offsets"], []
        for j in range(len(indices)):
            start, end = int(offsets[j]), int(offsets[j + 1])
            scales = arrays["scales"][start:end] if "scales" in arrays else None
            samples.append(sample_tensors(arrays["hidden"][start:end], arrays["input_ids"][start:end],
                                          arrays["loss_mask"][start:end], torch.tensor([0, end - start]), scales,
                                          what=f"sample {indices[j]}"))
        return samples
    return produce


class CaptureSender:
    """Capture rank `link.capture_index`'s units of `stream` from `first_step` on: its share of the units of the
    trainer ranks of its group (link.group). Trainers are named by their index among the trainers."""

    def __init__(self, link: RankLink, stream: UnitStream, first_step: int, produce: Producer, lengths: list[int],
                 *, batch_tokens: int, in_flight: int) -> None:
        self.link, self.stream, self.produce, self.lengths = link, stream, produce, lengths
        group = link.group
        self.units = stream.capture_units(group.captures.index(link.capture_index), len(group.captures), first_step,
                                          group.trainers)
        self.batch_tokens, self.in_flight = batch_tokens, in_flight
        self.credits = {t: self._post_credit(t) for t in group.trainers}  # each trainer's next credit
        self.stopped: set[int] = set()
        self.sent: dict[int, deque] = {t: deque() for t in group.trainers}  # sends in flight, per trainer
        # Throughput counters: tokens captured and seconds spent capturing (waits for credits excluded).
        self.tokens_captured, self.units_sent, self.capture_s, self.wait_s = 0, 0, 0.0, 0.0

    def _post_credit(self, trainer: int) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(1, dtype=torch.int64)
        peer = self.link.trainer_rank(trainer)
        return buffer, posted(lambda: self.link.control.recv([buffer], peer, CREDIT), "the next credit", peer,
                              self.link)

    def _credit(self, trainer: int, what: str) -> int:
        """The next credit of `trainer` (a unit number, or STOP); a new receive is posted behind a unit's credit."""
        buffer, receive = self.credits[trainer]
        started = time.monotonic()
        waited(receive, what, self.link.trainer_rank(trainer), self.link)
        self.wait_s += time.monotonic() - started
        value = int(buffer[0])
        if value == STOP:
            self.stopped.add(trainer)
        else:
            self.credits[trainer] = self._post_credit(trainer)
        return value

    def _batches(self):
        """This rank's units in order, grouped into captures of about batch_tokens tokens."""
        batch, tokens = [], 0
        for u in self.units:
            if len(self.stopped) == len(self.credits):
                break
            if self.stream.trainer_of(u) in self.stopped:
                continue
            indices = self.stream.indices(u)
            batch.append((u, indices))
            tokens += sum(self.lengths[i] for i in indices)
            if tokens >= self.batch_tokens:
                yield batch
                batch, tokens = [], 0
        if batch:
            yield batch

    def run(self) -> None:
        """Capture and send every unit (or until every trainer stopped), then take each trainer's stop."""
        for batch in self._batches():
            started = time.perf_counter()
            samples = self.produce([i for _, indices in batch for i in indices])
            self.capture_s += time.perf_counter() - started
            self.tokens_captured += sum(int(s["input_ids"].shape[0]) for s in samples)
            for u, indices in batch:
                unit_samples, samples = samples[:len(indices)], samples[len(indices):]
                self._send(u, indices, unit_samples)
        for trainer in self.credits:
            if trainer not in self.stopped and self._credit(trainer, "the stop") != STOP:
                raise RuntimeError(f"online capture, rank {self.link.rank}: trainer rank {trainer} asked for more "
                                   "micro-batches than its stream holds")
        for trainer, sends in self.sent.items():
            while sends:
                waited(sends.popleft()[0], "a micro-batch's send", self.link.trainer_rank(trainer), self.link)

    def _send(self, u: int, indices: list[int], samples: list[dict[str, torch.Tensor]]) -> None:
        trainer = self.stream.trainer_of(u)
        if trainer in self.stopped:
            return
        credit = self._credit(trainer, f"the credit of micro-batch {u}")
        if credit == STOP:
            return
        if credit != u:
            raise RuntimeError(f"online capture, rank {self.link.rank}: trainer rank {trainer} asked for micro-batch "
                               f"{credit} where {u} was due: the trainer's batch plan differs from this rank's")
        header, *tensors = encode_unit(u, indices, samples)
        tensors = [t.to(self.link.wire) for t in tensors]
        peer = self.link.trainer_rank(trainer)
        what = f"micro-batch {u}"
        works = [posted(lambda: self.link.control.send([header], peer, HEADER), what, peer, self.link)]
        works += [posted(lambda t=t: self.link.data.send([t], peer, DATA), what, peer, self.link) for t in tensors]
        sends = self.sent[trainer]
        sends.extend((work, [header, *tensors]) for work in works)
        # A credit for u means the trainer took every unit of its more than in_flight units before: those are done.
        while len(sends) > len(works) * (self.in_flight + 1):
            waited(sends.popleft()[0], "a micro-batch's send", peer, self.link)
        self.units_sent += 1

    def stats(self) -> dict:
        return {"tokens": self.tokens_captured, "units": self.units_sent, "capture_s": self.capture_s,
                "credit_wait_s": self.wait_s}
