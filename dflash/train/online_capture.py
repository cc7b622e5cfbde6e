"""The train stage's side of online capture (capture.mode=online).

Rank 0 empties the spool (external workers: makes a new session folder in it), decides whether the first
epoch's features are cached for the later ones, writes the workers' spec and starts the capture workers; every
rank then reads its items through an OnlineFeatureSource. After training, `finish` joins the workers, checks that
every produced item was read, and reports the capture and trainer throughputs with the device split that would
balance them.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from typing import Callable

import torch
from omegaconf import DictConfig

from dflash.data.batch_plan import BatchPlan
from dflash.extract.feature_cache import FeatureCache
from dflash.extract.online import ItemStream, OnlineFeatureSource, Spool
from dflash.extract.online_workers import WorkerPool
from dflash.models.targets.placement import resolve_gpus_per_worker
from dflash.run_files import (
    OWNER_MARKER, claimed_key, container, make_owned_dir, read_json, remove_owned_dir, write_json,
)
from dflash.train.capture_split import log_split, split_advice
from dflash.train.checkpoints import latest_tag, resume_step_of
from dflash.train.feature_cache_choice import choose_feature_cache

logger = logging.getLogger(__name__)


def owned_or_new(path: str, run_dir: str) -> None:
    """ValueError when `path` holds files dflash did not write (remove_owned_dir would refuse to empty it later)."""
    inside = os.path.commonpath([os.path.abspath(path), os.path.abspath(run_dir)]) == os.path.abspath(run_dir)
    if not inside and os.path.isdir(path) and os.listdir(path) and \
            not os.path.exists(os.path.join(path, OWNER_MARKER)):
        raise ValueError(f"capture.spool_dir {path} holds files that dflash did not write (no {OWNER_MARKER}): "
                         "name a new or empty folder for the spool")


class OnlineCapture:
    """`checkpoint_key`: the fingerprint of the checkpoints training resumes from (Pipeline.checkpoint_fingerprint);
    None reads it from the checkpoint folder's marker (claim_checkpoint_dir writes it before training starts)."""

    def __init__(self, cfg: DictConfig, run_dir: str, dirs: dict[str, str], device: torch.device,
                 barrier: Callable[[], None], checkpoint_key: str | None = None) -> None:
        self.cfg, self.run_dir, self.dirs, self.device, self.barrier = cfg, run_dir, dirs, device, barrier
        self._checkpoint_key = checkpoint_key

    @property
    def checkpoint_key(self) -> str | None:
        if self._checkpoint_key is not None:
            return self._checkpoint_key
        return claimed_key(self.dirs["checkpoints"])

    @property
    def spool_dir(self) -> str:
        return os.path.abspath(str(self.cfg.capture.spool_dir))

    @property
    def external(self) -> bool:
        """capture.workers=external: capture nodes run the workers (capture_node.py); the trainer starts none."""
        return str(self.cfg.capture.get("workers", "local")) == "external"

    @property
    def done_path(self) -> str:
        """Written after training: tells the capture nodes' supervisors that this session is over."""
        return os.path.join(self.run_dir, "capture_logs", "done.json")

    def source(self, settings, rank: int, world_size: int, pools: list,
               lengths: tuple[int, ...] | None = None) -> OnlineFeatureSource:
        """This rank's OnlineFeatureSource; rank 0 first empties the spool and starts the capture workers (appended
        to `pools` as soon as they run, so the caller stops them whatever happens next). `lengths`: every sample's
        token count when settings.group_by_length (the trainer's plan is built from the same)."""
        c = self.cfg.capture
        info = read_json(os.path.join(self.dirs["features"], "online.json"))
        plan = BatchPlan(info["num_samples"], settings.micro_batch_size, world_size, settings.grad_accum,
                         settings.seed, group_by_length=settings.group_by_length, lengths=lengths)
        stream = ItemStream(plan, epochs=settings.epochs)
        devices, g, num_workers = self.worker_layout()
        log_dir = os.path.join(self.run_dir, "capture_logs")
        if rank == 0:
            self.start_session(settings, info, plan, stream, devices, g, num_workers, log_dir, pools)
        self.barrier()
        spool_dir = read_json(os.path.join(log_dir, "spec.json"))["spool"]
        cache = None
        decided = read_json(os.path.join(log_dir, "cache.json"))
        if decided["cache"]:
            cache = FeatureCache(decided["dir"])
        return OnlineFeatureSource(Spool(spool_dir, num_workers), stream, rank, timeout_s=float(c.timeout_s),
                                   hopeless=pools[0].failed if pools else None, cache=cache)

    def worker_layout(self) -> tuple[list[int] | None, int, int]:
        """(capture GPUs or None off CUDA, GPUs per worker, number of workers). More than one GPU per worker places
        a target too large for one GPU layer-wise across them."""
        c = self.cfg.capture
        devices = [int(d) for d in c.devices] if c.devices is not None and self.device.type == "cuda" else None
        if self.external:  # the capture nodes' GPUs are theirs to count; the schema asked for an int
            g = int(c.get("gpus_per_worker", 1))
        else:
            g = resolve_gpus_per_worker(c.get("gpus_per_worker", 1), container(self.cfg.target),
                                        len(devices)) if devices else 1
        num_workers = int(c.num_workers) if c.num_workers is not None else len(devices) // g if devices else 1
        return devices, g, num_workers

    def start_session(self, settings, info: dict, plan: BatchPlan, stream: ItemStream, devices: list[int] | None,
                      g: int, num_workers: int, log_dir: str, pools: list) -> None:
        """Rank 0: a fresh spool, the feature cache decided, the workers' spec written and (local workers) the
        workers started. Consumed items are gone, so every start streams afresh from the step training resumes
        at."""
        c = self.cfg.capture
        spool_dir, session = self.spool_dir, uuid.uuid4().hex[:12]
        if self.external:
            # Workers of an earlier start may still be writing into their session folder until their capture
            # node sees this start's spec: leave it (finish() removes it) and stream through a new one.
            owned_or_new(spool_dir, self.run_dir)
            make_owned_dir(spool_dir)
            spool_dir = os.path.join(spool_dir, f"session-{session}")
            for stale in (self.done_path, os.path.join(log_dir, "spec.json")):
                if os.path.exists(stale):
                    os.remove(stale)
        else:
            remove_owned_dir(spool_dir, self.run_dir)
        make_owned_dir(spool_dir)
        shutil.rmtree(os.path.join(log_dir, "stats"), ignore_errors=True)
        os.makedirs(log_dir, exist_ok=True)
        resume_step = self.resume_step()
        hidden_size = int(read_json(os.path.join(self.dirs["features"], "target.json"))["hidden_size"])
        use_cache = choose_feature_cache(c, run_dir=self.run_dir, info=info, hidden_size=hidden_size,
                                         epochs=settings.epochs, checkpoint_key=self.checkpoint_key, resume_step=resume_step,
                                         spool=(spool_dir, int(c.budget_bytes)))["cache"]
        spool = Spool(spool_dir, num_workers)
        spool.check_stream(ItemStream(plan, epochs=1) if use_cache else stream)
        first = resume_step * plan.global_batch_size
        if first:
            for r in range(plan.world_size):  # items before `first` count as consumed: the workers skip them
                spool.set_cursor(r, first)
        spec = self.worker_spec(settings, info, plan, devices, g, num_workers, spool_dir, log_dir, session,
                                epochs=1 if use_cache else settings.epochs)
        spec_path = os.path.join(log_dir, "spec.json")
        write_json(spec_path, spec)
        if self.external:
            logger.info(f"[online] waiting for {num_workers} external capture worker(s): start them on the capture "
                        f"node(s) with `python -m dflash.extract.capture_node {spec_path}` (docs/capture.md); "
                        f"spool {spool_dir}")
            return
        pool = WorkerPool(spec_path, num_workers, log_dir, devices=devices, max_restarts=int(c.max_restarts),
                          gpus_per_worker=g)
        pools.append(pool)
        pool.start()
        logger.info(f"[online] {num_workers} capture worker(s) on {devices or spec['device']} -> spool "
                    f"{spool_dir} (budget {int(c.budget_bytes) / 2**30:.2f} GiB); logs in {log_dir}")

    def worker_spec(self, settings, info: dict, plan: BatchPlan, devices: list[int] | None, g: int,
                    num_workers: int, spool_dir: str, log_dir: str, session: str, *, epochs: int) -> dict:
        """What a capture worker process reads (online_workers.run_worker): target, data, plan and spool."""
        c, t = self.cfg.capture, self.cfg.target
        return {
            "target": {"kind": str(t.kind), "path": t.path, "dtype": str(t.dtype), "tiny": container(t.tiny),
                       "cache_dir": t.cache_dir},
            "device": ([f"cuda:{j}" for j in range(g)] if g > 1 else "cuda:0") if devices else str(self.device),
            "data": info["data"], "spool": spool_dir, "log_dir": log_dir, "num_workers": num_workers,
            "session": session, "gpus_per_worker": g,
            "plan": {"num_samples": plan.num_samples, "micro_batch_size": plan.micro_batch_size,
                     "world_size": plan.world_size, "grad_accum": plan.grad_accum, "seed": plan.seed,
                     "group_by_length": plan.group_by_length,
                     # The workers compute the same grouping keys from the dataset (batch_plan.grouping_keys).
                     "group_by": str(self.cfg.train.group_by),
                     "num_anchors": settings.num_anchors, "block_size": int(self.cfg.drafter.block_size)},
            "epochs": epochs, "layer_ids": info["target_layer_ids"], "dtype": str(c.dtype),
            "batch_tokens": int(c.batch_tokens), "budget_bytes": int(c.budget_bytes),
            "chunk_items": int(c.chunk_items), "stale_after_s": float(c.stale_after_s), "threads": c.threads,
            "compile": bool(c.get("compile", False)), "pack": bool(c.get("pack", False)),
        }

    @staticmethod
    def _external_stats(log_dir: str, num_workers: int, wait_s: float) -> list[dict]:
        """The throughput counters of external workers (each writes its own once its stream is done)."""
        folder = os.path.join(log_dir, "stats")
        deadline = time.monotonic() + wait_s
        while True:
            names = os.listdir(folder) if os.path.isdir(folder) else []
            if len({name.split("-")[0] for name in names if name.endswith(".json")}) >= num_workers \
                    or time.monotonic() > deadline:
                return [read_json(os.path.join(folder, name)) for name in sorted(names) if name.endswith(".json")]
            time.sleep(0.5)

    def resume_step(self) -> int:
        """The global step training resumes at (0 without a checkpoint)."""
        return resume_step_of(self.dirs["checkpoints"], latest_tag(self.dirs["checkpoints"]))

    def finish(self, source: OnlineFeatureSource, pool, train_s: float, world_size: int) -> None:
        """Join the capture workers, remove the (now empty) spool and report both throughputs and the device
        split that would balance them (rank 0)."""
        c = self.cfg.capture
        log_dir = os.path.join(self.run_dir, "capture_logs")
        spec = read_json(os.path.join(log_dir, "spec.json"))
        if pool is not None:
            pool.join(timeout_s=float(c.stale_after_s) + 60.0)
        spool_dir = spec["spool"]
        leftover = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(spool_dir, "data")) for f in files]
        if leftover:
            raise RuntimeError(f"the spool {spool_dir} still holds {len(leftover)} item files after training, "
                               f"e.g. {leftover[0]}: features were produced that no trainer rank read")
        if pool is None:  # external workers: tell their supervisors, then wait for the workers' counters
            write_json(self.done_path, {"session": spec["session"]})
            stats = self._external_stats(log_dir, int(spec["num_workers"]), float(c.stale_after_s))
        else:
            stats = pool.stats()
        # Every session's folder with it (external workers): their capture nodes moved on to this session.
        remove_owned_dir(self.spool_dir, self.run_dir)
        capture_tokens = sum(s["tokens"] for s in stats)
        capture_s = sum(s["capture_s"] for s in stats)
        if capture_s <= 0 or source.tokens_read == 0:
            # A start that resumed at the last step (killed while exporting, say) streamed nothing to measure.
            logger.info("[online] nothing was captured in this start: no throughput to report")
            return
        # Worker-seconds measure one worker, which holds pool.gpus_per_worker GPUs: the rate per device divides.
        gpus = int(spec["gpus_per_worker"])
        capture_rate = capture_tokens / capture_s / gpus
        trainer_rate = source.tokens_read / max(train_s - source.wait_s, 1e-9)  # per trainer rank (rank 0's)
        capture_devices = int(spec["num_workers"]) * gpus
        report = split_advice(capture_rate, trainer_rate, capture_devices, world_size)
        report.update({"capture_tokens": capture_tokens, "trainer_wait_s": source.wait_s, "train_s": train_s})
        write_json(os.path.join(self.run_dir, "capture_logs", "throughput.json"), report)
        logger.info(f"[online] capture {capture_rate:,.0f} tok/s per capture device ({capture_devices}), trainer "
                    f"{trainer_rate:,.0f} tok/s per rank ({world_size}; waited {source.wait_s:.1f} s of "
                    f"{train_s:.1f} s for features)")
        log_split(report)
