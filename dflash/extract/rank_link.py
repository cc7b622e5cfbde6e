"""One launch, two roles (capture=online, capture.transport=ranks): in one torchrun job of N ranks the last
`capture.ranks` capture and the first N - capture.ranks train.

The trainer ranks keep their job ranks 0..T-1 and make the default process group among themselves (WORLD_SIZE is
set to T before any of them reads it), so DeepSpeed's data-parallel group, the checkpoints' barriers and every
collective of the trainer see the trainer ranks only, as in a job without capture ranks. Capture ranks join no
default group. Every rank of the job also opens two point-to-point groups over the whole job, made from the
launcher's store:
  control  gloo on the CPU: trainer -> capture receive credits, capture -> trainer unit headers (small tensors);
  data     NCCL between GPUs (device=auto: one GPU per rank), else gloo through the CPU: the features, capture ->
           trainer only, in unit order per pair.
Credits and headers go on a group of their own because NCCL matches a pair's messages in the order they were
posted whatever their tag, so a credit posted ahead would hold back the features behind it.

The launcher's store (under a prefix of the start: torchrun keeps it across restarts) also carries two small records: the start (trainer rank 0 tells the capture ranks what to
stream and from which step, or that there is nothing to stream) and each capture rank's throughput counters.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash.config import ConfigError
from dflash.models.targets.placement import job_rank_devices, resolve_gpus_per_worker

START_KEY = "dflash/online/start"
_START_POLL_S = 1.0


@dataclass
class RankLink:
    """This process's place in the job and its point-to-point groups."""

    rank: int  # in the job
    world_size: int  # of the job
    trainers: int
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
    def captures(self) -> int:
        return self.world_size - self.trainers

    @property
    def is_capture(self) -> bool:
        return self.rank >= self.trainers

    @property
    def capture_index(self) -> int:
        """This capture rank's number among the capture ranks (0..captures-1)."""
        return self.rank - self.trainers

    def capture_rank(self, capture: int) -> int:
        """The job rank of capture rank number `capture`."""
        return self.trainers + capture

    def announce(self, start: dict | None) -> None:
        """Trainer rank 0: what the capture ranks stream (None: nothing, they exit)."""
        self.store.set(START_KEY, json.dumps(start))

    def announced(self) -> bool:
        return self.store.check([START_KEY])

    def wait_start(self) -> dict | None:
        """Capture ranks: the start trainer rank 0 announced. Waits as long as the trainers' data and capture
        stages take; a trainer that fails ends the job, and this rank with it."""
        while not self.announced():
            time.sleep(_START_POLL_S)
        return json.loads(self.store.get(START_KEY))

    def post_stats(self, stats: dict) -> None:
        self.store.set(f"dflash/online/stats/{self.capture_index}", json.dumps(stats))

    def capture_stats(self) -> list[dict]:
        """Every capture rank's counters (trainer rank 0, after training; each posts them once it is done)."""
        keys = [f"dflash/online/stats/{c}" for c in range(self.captures)]
        self.store.wait(keys, timedelta(seconds=self.timeout_s))
        return [json.loads(self.store.get(key)) for key in keys]


def open_link(capture_ranks: int, device_name: str, timeout_s: float, gpus_per_capture: int = 1) -> RankLink:
    """Split this torchrun job into trainer and capture ranks (module docstring), each capture rank on
    `gpus_per_capture` GPUs. ConfigError when the job has no room for both roles."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= capture_ranks:
        raise ConfigError(
            f"capture=online with capture.transport=ranks runs capture.ranks={capture_ranks} capture rank(s) and at "
            f"least one trainer rank in one job, but this job has {world_size} process(es): launch "
            f"{capture_ranks + 1} or more, e.g. torchrun --nproc_per_node {capture_ranks + 1} -m dflash.train ...")
    trainers = world_size - capture_ranks
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    devices = rank_devices(device_name, local_rank, world_size, trainers, gpus_per_capture)
    device = devices[0]
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
    # torchrun keeps its store across the restarts of a job: each start uses keys of its own, or the groups would
    # meet the addresses of the ranks of an earlier start.
    store = dist.PrefixStore(f"dflash/start{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    control = dist.ProcessGroupGloo(dist.PrefixStore("dflash/control", store), rank, world_size, timeout)
    # NCCL needs one rank per GPU: with device=auto each rank has its own (cuda:LOCAL_RANK); a device named for
    # every rank may be one GPU shared by a capture rank and a trainer rank, whose features then go by gloo.
    nccl = device.type == "cuda" and device_name == "auto"
    data = _data_group(dist.PrefixStore("dflash/data", store), rank, world_size, timeout) if nccl else control
    link = RankLink(rank, world_size, trainers, store, control, data, devices,
                    device if nccl else torch.device("cpu"), timeout_s)
    if not link.is_capture:
        os.environ["WORLD_SIZE"] = str(trainers)  # what the pipeline, DeepSpeed and the console read
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore(
            "dflash/trainers", store), rank=rank, world_size=trainers, timeout=timedelta(minutes=240))
    return link


def rank_devices(device_name: str, local_rank: int, world_size: int, trainers: int,
                 gpus_per_capture: int) -> list[torch.device]:
    """This rank's devices. device=auto with CUDA: cuda:LOCAL_RANK, or for a capture rank of more than one GPU its
    consecutive GPUs after the trainers' one each (job_rank_devices; one node only: the launcher makes every node's
    layout, launch/one_node.sh); the CPU without CUDA; a named device as named."""
    if device_name != "auto":
        return [torch.device(device_name)]
    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    if gpus_per_capture == 1:
        return [torch.device(f"cuda:{local_rank}")]
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size:
        raise ConfigError(f"capture.gpus_per_worker={gpus_per_capture} with capture.transport=ranks runs the job on "
                          "one node (launch/one_node.sh); on several nodes give each capture rank one GPU")
    return [torch.device(d) for d in job_rank_devices(local_rank, trainers, gpus_per_capture)]


def capture_gpus(capture, target: dict) -> int:
    """The GPUs of one capture rank (capture.gpus_per_worker, "auto" resolved as for capture workers), checked
    against capture.devices when it lists the capture GPUs: capture.ranks groups of that many."""
    # Off CUDA every rank runs on the CPU and capture.devices is ignored.
    listed = len(capture.devices) if capture.devices is not None and torch.cuda.is_available() else None
    gpus = resolve_gpus_per_worker(capture.gpus_per_worker, target,
                                   listed if listed is not None else capture.ranks * _given(capture.gpus_per_worker))
    if listed is not None and listed != capture.ranks * gpus:
        raise ConfigError(f"capture.devices lists {listed} GPU(s), but capture.ranks={capture.ranks} capture rank(s) "
                          f"of capture.gpus_per_worker={gpus} GPU(s) each need {capture.ranks * gpus}")
    return gpus


def _given(gpus_per_worker) -> int:
    return 1 if str(gpus_per_worker) == "auto" else int(gpus_per_worker)


def _data_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """NCCL between the GPUs of the job (features never leave the GPU memory of either side)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)
