"""Capture worker processes for online training: the entry point of one worker and the pool that runs them.

    python -m dflash.extract.online_workers SPEC.json WORKER_ID PARENT_PID

SPEC.json (written by the pipeline's train stage) names the target, the token dataset, the spool and the batch
plan; the worker loads the target on its device, runs `CaptureWorker.run()` until every item of the stream is
written or consumed, and writes its throughput to `stats/w{id}-{pid}.json` next to its log. A worker exits when
its parent (the trainer, PARENT_PID) disappears, so a killed trainer leaves no capture process behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dflash.console import EVERY_RANK
from dflash.run_files import atomic_write

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0
_STOP_GRACE_S = 10.0


def _exit_with_parent(parent: int) -> None:
    """Exit at once when the process that started us (pid `parent`, given by it) is gone: we were re-parented.

    The parent passes its pid, since reading os.getppid() here would take the new parent's for ours when the
    parent died while we started."""
    if os.getppid() != parent:
        os._exit(3)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(_PARENT_POLL_S)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def run_worker(spec: dict[str, Any], worker: int) -> dict[str, Any]:
    """Capture this worker's share of the stream described by `spec`; return its throughput counters."""
    import torch

    from dflash.data.dataset import load_dataset_dir
    from dflash.data.batch_plan import BatchPlan, grouping_keys
    from dflash.extract.online import CaptureWorker, ItemStream, Spool
    from dflash.models.targets import load_target

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    t = spec["target"]
    adapter = load_target(t["kind"], path=t["path"], dtype=t["dtype"], device=spec["device"], tiny=t["tiny"],
                          cache_dir=t["cache_dir"])
    if spec.get("compile"):  # capture.compile: a worker process only captures, so its layers stay compiled
        from dflash.models.targets.compile_target import compile_target_layers

        compile_target_layers(adapter)
    p = spec["plan"]
    dataset = load_dataset_dir(spec["data"])
    group = int(p.get("group_by_length", 0))
    keys = None
    if group:  # the trainer's keys, from the same dataset (its plan's digest is checked against ours)
        keys = tuple(grouping_keys(dataset, p["group_by"], int(p.get("num_anchors", 0)),
                                   int(p.get("block_size", 0))).tolist())
    plan = BatchPlan(p["num_samples"], p["micro_batch_size"], p["world_size"], p["grad_accum"], p["seed"],
                     group_by_length=group, lengths=keys)
    stream = ItemStream(plan, epochs=int(spec["epochs"]))
    spool = Spool(spec["spool"], num_workers=int(spec["num_workers"]))
    capture = CaptureWorker(adapter, dataset, spool, stream, list(spec["layer_ids"]),
                            worker=worker, budget_bytes=int(spec["budget_bytes"]),
                            chunk_items=int(spec["chunk_items"]), batch_tokens=int(spec["batch_tokens"]),
                            dtype=str(spec["dtype"]), stale_after_s=float(spec["stale_after_s"]),
                            pack=bool(spec.get("pack", False)))
    capture.run()
    return {"worker": worker, "tokens": capture.tokens_captured, "items": capture.items_captured,
            "capture_s": capture.capture_s}


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit("usage: python -m dflash.extract.online_workers SPEC.json WORKER_ID PARENT_PID")
    _exit_with_parent(int(argv[2]))
    spec_path, worker = Path(argv[0]), int(argv[1])
    spec = json.loads(spec_path.read_text())
    stats = run_worker(spec, worker)
    out = Path(spec["log_dir"]) / "stats" / f"w{worker}-{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(stats) + "\n")


class WorkerPool:
    """The capture processes of one online run: start, watch (restart the dead), join, and kill on failure.

    Worker w runs on the `gpus_per_worker` GPUs devices[w*g : (w+1)*g]: on CUDA the process sees only those
    (CUDA_VISIBLE_DEVICES) and loads the target on cuda:0 (g = 1) or layer-wise over cuda:0..g-1 (the spec's
    "device" is then that list); on CPU `devices` is None and every worker runs on `cpu`.
    """

    def __init__(self, spec_path: str, num_workers: int, log_dir: str, *, devices: list[int] | None = None,
                 cpu_device: str = "cpu", max_restarts: int = 3, gpus_per_worker: int = 1,
                 first_worker: int = 0) -> None:
        if devices is not None and len(devices) != num_workers * gpus_per_worker:
            raise ValueError(f"capture.devices {devices} must list {gpus_per_worker} GPU(s) per capture worker "
                             f"({num_workers} workers x {gpus_per_worker} = {num_workers * gpus_per_worker})")
        self.spec_path, self.num_workers, self.log_dir = spec_path, num_workers, Path(log_dir)
        self.devices, self.cpu_device, self.max_restarts = devices, cpu_device, max_restarts
        self.gpus_per_worker = gpus_per_worker
        self.first_worker = first_worker  # worker ids first_worker .. first_worker + num_workers - 1 (capture nodes)
        self.processes: list[subprocess.Popen | None] = [None] * num_workers
        self.restarts = [0] * num_workers
        self.failure: str | None = None
        self.all_dead = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def _start(self, worker: int) -> None:
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible_devices(worker)
        log = open(self.log_dir / f"w{self.first_worker + worker}.log", "ab")  # noqa: SIM115 (the child holds it)
        try:
            self.processes[worker] = subprocess.Popen(
                [sys.executable, "-m", "dflash.extract.online_workers", self.spec_path,
                 str(self.first_worker + worker), str(os.getpid())],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def visible_devices(self, worker: int) -> str:
        """CUDA_VISIBLE_DEVICES of `worker`: its `gpus_per_worker` consecutive entries of `devices`, e.g. "2,3".

        `devices` are indices as this process sees them; under a CUDA_VISIBLE_DEVICES of its own (a scheduler's
        mask, say "4,5,6,7") index d is that mask's d-th entry, so the worker lands on the GPU this process meant.
        """
        if self.devices is None:
            raise ValueError("this pool runs on the CPU: its workers have no GPUs")
        g = self.gpus_per_worker
        mine = self.devices[worker * g:(worker + 1) * g]
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        if parent is None or not parent.strip():
            return ",".join(str(d) for d in mine)
        visible = [entry.strip() for entry in parent.split(",")]
        outside = [d for d in mine if not 0 <= int(d) < len(visible)]
        if outside:
            raise ValueError(f"capture devices {outside} are not among the {len(visible)} GPU(s) of "
                             f"CUDA_VISIBLE_DEVICES={parent!r}")
        return ",".join(visible[int(d)] for d in mine)

    def start(self, poll_s: float = 0.5) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for worker in range(self.num_workers):
            self._start(worker)
        self._monitor = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="capture-pool")
        self._monitor.start()

    def _log_tail(self, worker: int) -> str:
        path = self.log_dir / f"w{self.first_worker + worker}.log"
        return path.read_bytes()[-2000:].decode(errors="replace") if path.exists() else ""

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            with self._lock:
                if self._stop.is_set():
                    return
                self.poll()

    def poll(self) -> None:
        """Restart every worker that died (non-zero exit) while it has restarts left; record a failure when
        every worker is dead for good (the trainer then stops waiting, see `failed`)."""
        for worker, process in enumerate(self.processes):
            if process is None or process.poll() in (None, 0):
                continue
            wid = self.first_worker + worker
            if self.restarts[worker] < self.max_restarts:
                self.restarts[worker] += 1
                logger.info(f"[online] capture worker {wid} exited with code {process.returncode}: restart "
                            f"{self.restarts[worker]}/{self.max_restarts}", extra=EVERY_RANK)
                self._start(worker)
            else:
                self.processes[worker] = None
                if self.failure is None:
                    self.failure = (f"capture worker {wid} died {self.max_restarts + 1} times (exit code "
                                    f"{process.returncode}); last log lines of {self.log_dir}/w{wid}.log:\n"
                                    f"{self._log_tail(worker)}")
        # One dead worker's chunks are taken over by the others; only all of them gone is hopeless.
        if self.failure is not None and all(p is None or p.poll() is not None for p in self.processes):
            self.all_dead = True

    def failed(self) -> str | None:
        """Why waiting for features is hopeless (every worker dead with no restart left), else None."""
        return self.failure if self.all_dead else None

    def join(self, timeout_s: float) -> None:
        """Wait for the workers to finish (they exit once every item is consumed); one still running after
        `timeout_s` is stopped and reported.

        Called once training has read every item, so a worker that died (killed, say, after its last chunk was
        taken over, and before the watcher restarted it) cost nothing: it is reported, not raised.
        """
        self._stop.set()
        with self._lock:
            deadline = time.monotonic() + timeout_s
            for worker, process in enumerate(self.processes):
                if process is None:
                    continue
                wid = self.first_worker + worker
                try:
                    code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    # Training has read every item, so the worker has nothing left to give (a restarted one may
                    # still be loading its target): stop it rather than fail a finished stage.
                    logger.info(f"[online] capture worker {wid} still ran {timeout_s:.0f} s after training ended; "
                                f"stopped (no sample was missing). Log: {self.log_dir}/w{wid}.log", extra=EVERY_RANK)
                    _stop_processes([process])
                    continue
                if code != 0:
                    logger.info(f"[online] capture worker {wid} exited with code {code}; training had read every "
                                f"item, so no sample was lost. Last lines of {self.log_dir}/w{wid}.log:\n"
                                f"{self._log_tail(worker)}", extra=EVERY_RANK)

    def kill(self) -> None:
        """Stop every worker still running: SIGTERM, then SIGKILL after a grace period."""
        self._stop.set()
        with self._lock:
            _stop_processes([p for p in self.processes if p is not None])

    def stats(self) -> list[dict[str, Any]]:
        """Throughput counters written by every worker life that finished."""
        folder = self.log_dir / "stats"
        return [json.loads(p.read_text()) for p in sorted(folder.glob("w*.json"))] if folder.is_dir() else []


def _stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to those still running, then SIGKILL to any still running after a grace period."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written; skip interpreter teardown, where native library threads sometimes abort the process
    # ("terminate called without an active exception"), which would read as a failed worker.
    os._exit(0)
