"""One launch, two roles (capture=online): some ranks of one torchrun job capture, the others train. Two layouts
(RankLayout):
  the job's last ranks  (capture.ranks=C, the default) the last C ranks of the job capture, the first T = N - C
                        train; on several nodes the capture ranks are the last node(s)'. One group: unit u is made
                        by capture rank u % C.
  every node's last     (capture.ranks_per_node=k) the last k local ranks of every node capture and the others
                        train; each node is a group of its own: its capture ranks make the units of its trainers
                        only, so features stay inside the node.

Each trainer has its index among the trainers (0..T-1, node after node): that is its RANK (WORLD_SIZE = T, set
before anything reads them; LOCAL_RANK stays its GPU), so DeepSpeed's data-parallel group, the checkpoints and
every collective of the trainer see the trainer ranks only, as in a job without capture ranks. Capture ranks keep
their job RANK and join no default group. Every rank of the job also opens two point-to-point groups over the
whole job, made from the launcher's store, in which ranks are job ranks:
  control  gloo on the CPU: trainer -> capture receive credits, capture -> trainer unit headers (small tensors);
  data     NCCL between GPUs (device=auto: one GPU per rank), else gloo through the CPU: the features, capture ->
           trainer only, in unit order per pair.
Credits and headers go on a group of their own because NCCL matches a pair's messages in the order they were
posted whatever their tag, so a credit posted ahead would hold back the features behind it.

The launcher's store (under a prefix of the start: torchrun keeps it across restarts) also carries two small
records: the start (trainer 0 tells the capture ranks what to stream and from which step, or that there is nothing
to stream) and each capture rank's throughput counters.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash.config import ConfigError
from dflash.models.targets.placement import job_rank_devices, resolve_gpus_per_worker

START_KEY = "dflash/online/start"
_START_POLL_S = 1.0
# The ranks of a start reach the link as far apart as their startup takes (imports, CUDA; longer on a loaded
# machine). They first meet in the store, waiting at least this long, so that capture.timeout_s, meant for a hung
# peer, need not cover that spread: the groups are made once all have arrived.
ARRIVAL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankGroup:
    """Consecutive trainers and the capture ranks that make their units (UnitStream.maker routes them)."""

    trainers: range  # trainer indices
    captures: range  # capture indices


@dataclass(frozen=True)
class RankLayout:
    """Which job rank does what: trainer t runs on job rank trainer_ranks[t], capture rank c on capture_ranks[c]."""

    trainer_ranks: tuple[int, ...]
    capture_ranks: tuple[int, ...]
    groups: tuple[RankGroup, ...]

    def group_of(self, rank: int) -> RankGroup:
        """The group of job rank `rank`."""
        if rank in self.capture_ranks:
            c = self.capture_ranks.index(rank)
            return next(group for group in self.groups if c in group.captures)
        t = self.trainer_ranks.index(rank)
        return next(group for group in self.groups if t in group.trainers)


def last_ranks_layout(world_size: int, captures: int) -> RankLayout:
    """The last `captures` ranks of the job capture for every trainer (one group)."""
    trainers = world_size - captures
    return RankLayout(tuple(range(trainers)), tuple(range(trainers, world_size)),
                      (RankGroup(range(trainers), range(captures)),))


def every_node_layout(world_size: int, local_world_size: int, per_node: int) -> RankLayout:
    """The last `per_node` local ranks of every node capture for the node's trainers (a group per node). Job ranks
    go node after node, `local_world_size` each, as torchrun numbers them."""
    nodes, local_trainers = world_size // local_world_size, local_world_size - per_node
    firsts = [node * local_world_size for node in range(nodes)]
    return RankLayout(tuple(first + j for first in firsts for j in range(local_trainers)),
                      tuple(first + j for first in firsts for j in range(local_trainers, local_world_size)),
                      tuple(RankGroup(range(node * local_trainers, (node + 1) * local_trainers),
                                      range(node * per_node, (node + 1) * per_node)) for node in range(nodes)))


@dataclass
class RankLink:
    """This process's place in the job and its point-to-point groups."""

    rank: int  # in the job
    layout: RankLayout
    store: dist.Store
    control: dist.ProcessGroup
    data: dist.ProcessGroup
    devices: list[torch.device]  # this rank's devices: one, or a capture rank's GPUs that hold the target
    wire: torch.device  # where features travel from and to: the GPU under NCCL, else the CPU
    timeout_s: float

    @property
    def device(self) -> torch.device:
        """This rank's (first) device: where its point-to-point data travels on NCCL."""
        return self.devices[0]

    @property
    def trainers(self) -> int:
        return len(self.layout.trainer_ranks)

    @property
    def captures(self) -> int:
        return len(self.layout.capture_ranks)

    @property
    def is_capture(self) -> bool:
        return self.rank in self.layout.capture_ranks

    @property
    def capture_index(self) -> int:
        """This capture rank's number among the capture ranks (0..captures-1)."""
        return self.layout.capture_ranks.index(self.rank)

    @property
    def trainer_index(self) -> int:
        """This trainer's number among the trainers (0..trainers-1): its RANK in the trainers' default group."""
        return self.layout.trainer_ranks.index(self.rank)

    @property
    def group(self) -> RankGroup:
        """The trainers and capture ranks this rank streams with."""
        return self.layout.group_of(self.rank)

    def capture_rank(self, capture: int) -> int:
        """The job rank of capture rank number `capture`."""
        return self.layout.capture_ranks[capture]

    def trainer_rank(self, trainer: int) -> int:
        """The job rank of trainer number `trainer`."""
        return self.layout.trainer_ranks[trainer]

    def name(self, rank: int) -> str:
        """Job rank `rank` as messages name it: capture ranks by job rank, trainers by their RANK."""
        if rank in self.layout.capture_ranks:
            return f"capture rank {rank}"
        trainer = self.layout.trainer_ranks.index(rank)
        return f"trainer rank {trainer}" + (f" (job rank {rank})" if trainer != rank else "")

    def announce(self, start: dict | None) -> None:
        """Trainer rank 0: what the capture ranks stream (None: nothing, they exit; {"failed": its error}: trainer
        rank 0 stopped before the stream, see `stream_start`)."""
        self.store.set(START_KEY, json.dumps(start))

    def announced(self) -> bool:
        return self.store.check([START_KEY])

    def wait_start(self) -> dict | None:
        """Capture ranks: the start trainer rank 0 announced. Waits as long as the trainers' data and capture
        stages take; a trainer that fails ends the job, and this rank with it."""
        while not self.announced():
            time.sleep(_START_POLL_S)
        return json.loads(self.store.get(START_KEY))

    def stream_start(self) -> dict | None:
        """wait_start, or None where there is no stream. RuntimeError naming trainer rank 0's error when it
        stopped before the stream started: the ranks waiting for it end with the cause, not a symptom of it."""
        try:
            start = self.wait_start()
        except dist.DistNetworkError as error:
            # Where torchrun does not hold the store (a store per start, launch/multi_node.sh), job rank 0 does,
            # and a trainer rank 0 that stopped may take it with it before the others read why.
            raise RuntimeError(f"the job's store went away while waiting for trainer rank 0 to start the feature "
                               f"stream: it most likely stopped, and its output has the error ({error})") from error
        if isinstance(start, dict) and "failed" in start:
            raise RuntimeError(f"trainer rank 0 stopped before the feature stream started: {start['failed']} "
                               f"(its own output has the whole error)")
        return start

    def post_stats(self, stats: dict) -> None:
        self.store.set(f"dflash/online/stats/{self.capture_index}", json.dumps(stats))

    def capture_stats(self) -> list[dict]:
        """Every capture rank's counters (trainer rank 0, after training; each posts them once it is done)."""
        keys = [f"dflash/online/stats/{c}" for c in range(self.captures)]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        return [json.loads(self.store.get(key)) for key in keys]


def open_link(capture_ranks: int, device_name: str, timeout_s: float, gpus_per_capture: int = 1,
              ranks_per_node: int | None = None) -> RankLink:
    """Split this torchrun job into trainer and capture ranks (module docstring): the job's last `capture_ranks`, or
    every node's last `ranks_per_node` when it is given, each capture rank on `gpus_per_capture` GPUs. ConfigError
    when the job has no room for both roles."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    layout, local_trainers = job_layout(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
                                        local_rank, capture_ranks, ranks_per_node)
    devices = rank_devices(device_name, local_rank, local_trainers, gpus_per_capture)
    device = devices[0]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = start_prefix(os.environ, one_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world)
    arrival = timedelta(seconds=max(timeout_s, ARRIVAL_TIMEOUT_S))
    store, rank, world_size = next(dist.rendezvous("env://", timeout=arrival))
    store = dist.PrefixStore(prefix, store)
    store.set(f"dflash/arrived/{rank}", "1")
    store.wait([f"dflash/arrived/{r}" for r in range(world_size)], arrival)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    control = dist.ProcessGroupGloo(dist.PrefixStore("dflash/control", store), rank, world_size, timeout)
    # NCCL needs one rank per GPU: with device=auto each rank has its own (cuda:LOCAL_RANK); a device named for
    # every rank may be one GPU shared by a capture rank and a trainer rank, whose features then go by gloo.
    nccl = device.type == "cuda" and device_name == "auto"
    data = _data_group(dist.PrefixStore("dflash/data", store), rank, world_size, timeout) if nccl else control
    link = RankLink(rank, layout, store, control, data, devices, device if nccl else torch.device("cpu"), timeout_s)
    if not link.is_capture:
        # What the pipeline, DeepSpeed, the checkpoints and the console read: this trainer among the trainers.
        os.environ.update({"RANK": str(link.trainer_index), "WORLD_SIZE": str(link.trainers)})
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore(
            "dflash/trainers", store), rank=link.trainer_index, world_size=link.trainers,
            timeout=timedelta(minutes=240), device_id=device if device.type == "cuda" else None)
    return link


# What makes torchrun give each start of a job a store of its own (made by job rank 0 on a free port), with c10d.
FRESH_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def start_prefix(env: Mapping[str, str], *, one_node: bool) -> str:
    """The store prefix of this start of the job: keys no earlier start wrote, or the groups would meet the addresses
    of an earlier start's ranks.

    Where the ranks share torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True: the default), it outlives the
    job's starts, so each start takes keys of its own, by TORCHELASTIC_RESTART_COUNT. That count is each node's
    agent's own: a restart raises it only on the node whose rank failed, so on several nodes the starts would not
    meet, and a job there that may restart is refused (ConfigError) before it opens anything; it needs a store per
    start (FRESH_STORE=1 with the c10d rendezvous, which launch/multi_node.sh sets). A store of the ranks' own is new
    at every start, and any fixed prefix is free."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "dflash/start"
    if not one_node and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ConfigError(f"capture=online on several nodes with torchrun --max-restarts needs a store per start: "
                          f"the c10d rendezvous with {FRESH_STORE}=1 in every node's environment (launch/multi_node.sh "
                          f"sets both), or --max-restarts 0. torchrun counts restarts per node, so after a restart the "
                          f"nodes' ranks would not find each other in the store they share")
    return f"dflash/start{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def job_layout(world_size: int, rank: int, local_rank: int, capture_ranks: int,
               ranks_per_node: int | None) -> tuple[RankLayout, int | None]:
    """The job's layout (the launcher's WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) and how many trainers come
    first on this rank's node: None on several nodes with the job's last ranks capturing, where nodes differ."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if ranks_per_node is None:
        _need_room(capture_ranks, world_size, f"capture.ranks={capture_ranks}", "in one job", "this job has")
        one_node = local_world_size == world_size
        return last_ranks_layout(world_size, capture_ranks), world_size - capture_ranks if one_node else None
    if world_size % local_world_size or rank % local_world_size != local_rank:
        raise ConfigError(f"capture.ranks_per_node={ranks_per_node} needs the same number of ranks on every node, "
                          f"numbered node after node (torchrun --nproc_per_node), but rank {rank} is local rank "
                          f"{local_rank} of {local_world_size} in a job of {world_size}")
    _need_room(ranks_per_node, local_world_size, f"capture.ranks_per_node={ranks_per_node}", "on every node",
               "a node of this job has")
    return every_node_layout(world_size, local_world_size, ranks_per_node), local_world_size - ranks_per_node


def _need_room(captures: int, processes: int, setting: str, where: str, has: str) -> None:
    if processes <= captures:
        raise ConfigError(
            f"capture=online runs {setting} capture rank(s) and at least one trainer rank {where}, but {has} "
            f"{processes} process(es): launch {captures + 1} or more, e.g. torchrun --nproc_per_node {captures + 1} "
            f"-m dflash.train ...")


def rank_devices(device_name: str, local_rank: int, local_trainers: int | None,
                 gpus_per_capture: int) -> list[torch.device]:
    """This rank's devices. device=auto with CUDA: cuda:LOCAL_RANK, or for a capture rank of more than one GPU its
    consecutive GPUs after the `local_trainers` trainers' one each (job_rank_devices: the launcher lists the node's
    GPUs in that order, launch/one_node.sh, launch/multi_node.sh); the CPU without CUDA; a named device as named."""
    if device_name != "auto":
        return [torch.device(device_name)]
    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    if gpus_per_capture == 1:
        return [torch.device(f"cuda:{local_rank}")]
    if local_trainers is None:
        raise ConfigError(f"capture.gpus_per_worker={gpus_per_capture} with capture=online: the job's last "
                          "capture.ranks ranks capture on several GPUs each on one node only; on several nodes set "
                          "capture.ranks_per_node (every node's last ranks capture, on as many GPUs each) or give "
                          "each capture rank one GPU")
    return [torch.device(d) for d in job_rank_devices(local_rank, local_trainers, gpus_per_capture)]


def capture_gpus(capture, target: dict) -> int:
    """The GPUs of one capture rank (capture.gpus_per_worker, "auto" resolved by the target's size), checked
    against capture.devices when it lists the capture GPUs (of a node, with capture.ranks_per_node): a group of that
    many for each capture rank."""
    ranks, setting = capture.ranks, f"capture.ranks={capture.ranks}"
    if capture.ranks_per_node is not None:
        ranks, setting = capture.ranks_per_node, f"capture.ranks_per_node={capture.ranks_per_node}"
    # Off CUDA every rank runs on the CPU and capture.devices is ignored.
    listed = len(capture.devices) if capture.devices is not None and torch.cuda.is_available() else None
    gpus = resolve_gpus_per_worker(capture.gpus_per_worker, target,
                                   listed if listed is not None else ranks * _given(capture.gpus_per_worker))
    if listed is not None and listed != ranks * gpus:
        raise ConfigError(f"capture.devices lists {listed} GPU(s), but {setting} capture rank(s) "
                          f"of capture.gpus_per_worker={gpus} GPU(s) each need {ranks * gpus}")
    return gpus


def _given(gpus_per_worker) -> int:
    return 1 if str(gpus_per_worker) == "auto" else int(gpus_per_worker)


def _data_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """NCCL between the GPUs of the job (features never leave the GPU memory of either side)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)
