"""Online capture on machines of their own (capture.workers=external): one supervisor per capture node.

    torchrun --nnodes K --nproc_per_node 1 --rdzv-endpoint HOST:PORT \
        -m dflash.extract.capture_node RUN_DIR/capture_logs/spec.json [--devices 0,1,2,3]
    (or srun / the deepspeed launcher with one task per node: RANK and WORLD_SIZE say which node this is)

The trainer's rank 0 writes spec.json into the shared run folder, with a fresh `session` id at every start, and
starts no worker itself. Each supervisor waits for spec.json, then runs a WorkerPool of its node's share of the
worker ids (node r of K runs ids r*n .. r*n+n-1, n = num_workers / K) on its GPUs, restarting dead workers as the
local pool does. It follows the trainer: a new session (the trainer restarted) replaces the pool, and
`done.json` of the running session (written once training has read every item) ends it. Nothing here talks to
the trainer directly: the run folder and the spool, both on shared storage, are the whole interface.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from dflash.console import EVERY_RANK
from dflash.extract.online import share_dir
from dflash.extract.online_workers import WorkerPool
from dflash.run_files import atomic_write, read_json_or_none

# By name: run as `python -m`, this module is "__main__", outside the package logger that shows its messages.
logger = logging.getLogger("dflash.extract.capture_node")

POLL_S = 1.0


def node_share(num_workers: int, node: int, nodes: int) -> tuple[int, int]:
    """(first worker id, workers) of capture node `node` of `nodes`: an equal, contiguous share."""
    if num_workers % nodes:
        raise ValueError(f"capture.num_workers={num_workers} does not split evenly over {nodes} capture nodes")
    per_node = num_workers // nodes
    return node * per_node, per_node


def node_spec(spec: dict[str, Any], spec_path: Path, node: int, devices: list[int] | None) -> Path:
    """This node's copy of the spec, whose `device` is what each of its workers sees (written next to it)."""
    gpus = int(spec["gpus_per_worker"])
    local = dict(spec, device=([f"cuda:{j}" for j in range(gpus)] if gpus > 1 else "cuda:0") if devices else "cpu")
    path = spec_path.with_name(f"spec-node{node}.json")
    atomic_write(path, json.dumps(local) + "\n")
    return path


def supervise(spec_path: Path, node: int, nodes: int, devices: list[int] | None, *, max_restarts: int = 3,
              wait_s: float = 3600.0, poll_s: float = POLL_S) -> int:
    """Run this node's workers for every session of the run until the running session is done; 0 or 1."""
    done_path = spec_path.with_name("done.json")
    pool: WorkerPool | None = None
    session = None
    running: tuple[str, int, int] = ("", 0, 0)  # the running session's spool and this node's first share, count
    waiting_since = time.monotonic()
    try:
        while True:
            spec = read_json_or_none(spec_path)
            done = read_json_or_none(done_path)
            if session is not None and done is not None and done.get("session") == session:
                pool.join(timeout_s=float(spec["stale_after_s"]) + 60.0 if spec else 120.0)
                logger.info(f"[capture-node {node}] session {session} done", extra=EVERY_RANK)
                return 0
            if spec is not None and spec.get("session") != session:
                if done is not None and done.get("session") == spec.get("session"):
                    # Started (or requeued) after the trainer finished: there is nothing left to capture.
                    logger.info(f"[capture-node {node}] session {spec['session']} is already done",
                                extra=EVERY_RANK)
                    return 0
                if pool is not None:
                    logger.info(f"[capture-node {node}] the trainer restarted: session {spec['session']}",
                                extra=EVERY_RANK)
                    pool.kill()
                    remove_shares(*running)
                first, count = node_share(int(spec["num_workers"]), node, nodes)
                gpus = int(spec["gpus_per_worker"])
                if devices is not None and len(devices) != count * gpus:
                    raise ValueError(f"capture node {node} runs {count} worker(s) x {gpus} GPU(s) but has "
                                     f"devices {devices}")
                pool = WorkerPool(str(node_spec(spec, spec_path, node, devices)), count, spec["log_dir"],
                                  devices=devices, max_restarts=max_restarts, gpus_per_worker=gpus,
                                  first_worker=first)
                pool.start()
                session = spec["session"]
                running = (spec["spool"], first, count)
                logger.info(f"[capture-node {node}] session {session}: workers {first}..{first + count - 1} on "
                            f"{devices or 'cpu'}", extra=EVERY_RANK)
            if pool is not None and pool.failed():
                logger.warning(f"[capture-node {node}] {pool.failed()}")
                return 1
            if session is None and time.monotonic() - waiting_since > wait_s:
                logger.warning(f"[capture-node {node}] no spec at {spec_path} after {wait_s:.0f} s")
                return 1
            time.sleep(poll_s)
    finally:
        if pool is not None:
            pool.kill()


def remove_shares(spool_dir: str, first: int, count: int) -> None:
    """Delete the item files of workers first..first+count-1 in the spool of a session that ended (the trainer
    restarted into a new one, and these workers are stopped): nobody reads them any more, and they would hold up
    to a spool budget of disk until the trainer's finish()."""
    for worker in range(first, first + count):
        shutil.rmtree(share_dir(spool_dir, worker), ignore_errors=True)


def visible_gpus() -> list[int] | None:
    import torch

    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", type=Path, help="RUN_DIR/capture_logs/spec.json (it may not exist yet)")
    parser.add_argument("--devices", default=None, help="comma list of this node's capture GPUs (default: all)")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--wait-s", type=float, default=3600.0, help="how long to wait for the trainer's spec")
    args = parser.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")] if args.devices else visible_gpus()
    node, nodes = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return supervise(args.spec.resolve(), node, nodes, devices, max_restarts=args.max_restarts,
                     wait_s=args.wait_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
