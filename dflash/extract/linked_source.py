"""The trainer side of capture=online over the job's process group: a FeatureSource whose micro-batches arrive
from the capture ranks (rank_link.py, rank_stream.py).

Back-pressure is the protocol's: a capture rank sends a unit only after the trainer rank it belongs to sent it a
credit naming that unit, and a trainer rank holds `in_flight` credits: the first `in_flight` units of its stream
at the start, then one more each time it takes a unit. So at most `in_flight` micro-batches per trainer rank are
made and not yet taken, and a trainer never receives a unit it did not ask for. Per (capture rank, trainer rank)
pair everything goes in increasing unit order: credits, headers and tensors, so every message is matched by the
receive posted for it.

With a feature cache (capture.cache) the capture ranks make the first epoch only: this rank keeps each sample it
receives there, and reads the micro-batches of later epochs back from it.

A trainer rank sends each capture rank of its group (rank_link.RankGroup) a stop credit (-1) once it took its last
captured unit, and `close` (which ends the stream early or on time) takes (and drops) the units it gave credits for
and sends the stop if it was not sent yet, so no send or receive is left pending on either side.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dflash.data.feature_source import FeatureSource, Sample, collate
from dflash.extract.feature_cache import FeatureCache
from dflash.extract.rank_link import RankLink
from dflash.extract.rank_stream import UnitHeader, UnitStream, header_length
from dflash.extract.sample_format import decode_single

CREDIT, HEADER, DATA = 1, 2, 3  # tags
STOP = -1


def waited(work, what: str, peer: int, link: RankLink) -> None:
    """Wait for a point-to-point operation with job rank `peer`; a hang ends in TimeoutError and a peer that is
    gone in RuntimeError, each naming the peer (RankLink.name)."""
    try:
        work.wait()
    except RuntimeError as error:
        raise peer_error(error, what, peer, link) from error


def posted(post: Callable[[], Any], what: str, peer: int, link: RankLink) -> Any:
    """The work `post()` starts (a send or receive with job rank `peer`): posting to a peer whose connection is closed
    fails at once, in RuntimeError naming the peer as `waited` names it."""
    try:
        return post()
    except RuntimeError as error:
        raise peer_error(error, what, peer, link) from error


def peer_error(error: RuntimeError, what: str, peer: int, link: RankLink) -> Exception:
    """The error of a point-to-point operation with job rank `peer` that failed with `error`, naming the peer."""
    if "imed out" in str(error):
        return TimeoutError(f"online capture, rank {link.rank}: {what} from {link.name(peer)} did not come within "
                            f"capture.timeout_s={link.timeout_s:g} s: is rank {peer} hung?")
    return RuntimeError(f"online capture, rank {link.rank}: {what} with {link.name(peer)} failed (rank {peer} is "
                        f"gone?): {error}")


class LinkedFeatureSource(FeatureSource):
    """This trainer rank's micro-batches from `first_step` on, received from the capture ranks in plan order."""

    def __init__(self, link: RankLink, stream: UnitStream, rank: int, first_step: int, in_flight: int,
                 cache: FeatureCache | None = None) -> None:
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.link, self.stream, self.rank, self.cache = link, stream, rank, cache
        # With a cache the capture ranks make the first epoch only (its samples are kept as they arrive); the units
        # of later epochs are read back from the cache. Either way units go in increasing order.
        captured = UnitStream(stream.plan, 1).num_units if cache is not None else stream.num_units
        units = stream.trainer_units(rank, first_step)
        self.units = iter(u for u in units if u < captured)
        self.cached_units = iter(u for u in units if u >= captured)
        # (unit, header buffer, its receive, (the credit's send, its tensor)), in unit order
        self.credited: deque[tuple[int, torch.Tensor, object, object]] = deque()
        self.closed = self.stopped = False
        # Throughput counters: real tokens received and seconds spent waiting for them.
        self.tokens_read, self.wait_s = 0, 0.0
        for _ in range(in_flight):
            self._credit_next()
        self._stop_when_captured()

    def __len__(self) -> int:
        return self.stream.plan.num_samples

    def __getitem__(self, index: int) -> Sample:
        raise TypeError("the online stream hands out whole micro-batches in plan order (micro_batch), not samples")

    def _producer(self, u: int) -> int:
        """The job rank of the capture rank that makes unit u: one of this rank's group (its node's, or all)."""
        group = self.link.group
        return self.link.capture_rank(group.captures[self.stream.maker(u, len(group.captures), group.trainers)])

    def _credit_next(self) -> None:
        u = next(self.units, None)
        if u is None:
            return
        producer = self._producer(u)
        header = torch.empty(header_length(self.stream.plan.micro_batch_size), dtype=torch.int64)
        # Posted before the credit that asks for it.
        receive = posted(lambda: self.link.control.recv([header], producer, HEADER), f"the header of micro-batch {u}",
                         producer, self.link)
        value = torch.tensor([u], dtype=torch.int64)  # held until its send is done
        send = posted(lambda: self.link.control.send([value], producer, CREDIT), f"the credit of micro-batch {u}",
                      producer, self.link)
        self.credited.append((u, header, receive, (send, value)))

    def _take(self, pin_memory: bool = False) -> tuple[UnitHeader, Sample]:
        """The next credited unit's header and padded micro-batch."""
        u, header, receive, credit = self.credited.popleft()
        producer = self._producer(u)
        waited(receive, f"the header of micro-batch {u}", producer, self.link)
        waited(credit[0], f"the credit of micro-batch {u}", producer, self.link)  # taken: it was answered
        unit = UnitHeader.parse(header)
        if unit.unit != u:
            raise RuntimeError(f"online capture, rank {self.link.rank}: {self.link.name(producer)} sent micro-batch "
                               f"{unit.unit} where {u} was due")

        def recv(buffer: torch.Tensor) -> None:
            what = f"the features of micro-batch {u}"
            waited(posted(lambda: self.link.data.recv([buffer], producer, DATA), what, producer, self.link), what,
                   producer, self.link)
        keep = self.cache.put if self.cache is not None else None
        return unit, unit.receive(recv, self.link.wire, pin_memory, keep)

    def serves_ahead(self) -> bool:
        """No: units are taken in their own step. They come point to point against credits, and one taken ahead
        would put a receive between the trainer ranks' collectives of the step before, which nothing has tested."""
        return False

    def micro_batch(self, indices: Sequence[int], pin_memory: bool = False) -> Sample:
        if not self.credited:
            return self._cached(indices, pin_memory)
        started = time.monotonic()
        unit, batch = self._take(pin_memory)
        self.wait_s += time.monotonic() - started
        self._check(unit.unit, unit.indices, indices)
        self._credit_next()
        self.tokens_read += unit.tokens
        self._stop_when_captured()
        return batch

    def _cached(self, indices: Sequence[int], pin_memory: bool) -> Sample:
        """The next unit of a later epoch, from the feature cache."""
        u = next(self.cached_units, None)
        if u is None:
            raise IndexError(f"trainer rank {self.rank} has read every micro-batch of the online stream")
        self._check(u, self.stream.indices(u), indices)
        samples = [decode_single(self.cache.get(i)) for i in indices]
        self.tokens_read += sum(int(sample["input_ids"].shape[0]) for sample in samples)
        return collate(samples, pin_memory)

    def _check(self, u: int, holds: list[int], indices: Sequence[int]) -> None:
        if list(indices) != holds:
            raise ValueError(f"online rank {self.rank}: micro-batch {u} holds samples {holds}, the trainer asked for "
                             f"{list(indices)}: the trainer's batch plan (samples, micro batch, world size, grad "
                             "accum, seed, epochs) differs from the capture ranks'")

    def _stop_when_captured(self) -> None:
        """Once every unit the capture ranks make for this rank is taken (or none is left to make: a resume in a
        cached epoch), tell them it needs no more: they finish now rather than wait for the stop through the
        epochs read from the cache, longer than their receive timeout."""
        if not self.credited:
            self._stop()

    def close(self) -> None:
        """Take and drop the credited units, then tell the capture ranks of its group it needs no more."""
        if self.closed:
            return
        self.closed = True
        while self.credited:
            self._take()
        self._stop()

    def _stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        stop = torch.tensor([STOP], dtype=torch.int64)
        peers = [self.link.capture_rank(capture) for capture in self.link.group.captures]
        sends = [(peer, posted(lambda peer=peer: self.link.control.send([stop], peer, CREDIT), "the stop", peer,
                               self.link)) for peer in peers]
        for peer, send in sends:
            waited(send, "the stop", peer, self.link)
