"""The train stage's side of capture=online: the job's last ranks capture (dflash/extract/rank_link.py) and send
each trainer rank its micro-batches' features.

Trainer rank 0 announces the stream to the capture ranks: the dataset, the taps, the batch plan and the step
training resumes at (the newest checkpoint that verifies, as the loop resumes), so the capture ranks start where
the trainers do and no sample is lost or used twice across a restart. Every trainer rank then reads its
micro-batches through a LinkedFeatureSource. Rank 0 also decides, when a run starts, whether the first epoch's
features are kept for the later ones (capture.cache, feature_cache_choice.py): then the capture ranks make one
epoch. After training, `finish` closes the stream and, on rank 0, reports the capture and trainer throughputs and
the device split that would balance them.
"""

from __future__ import annotations

import logging
import os

from dflash.data.batch_plan import BatchPlan
from dflash.extract.feature_cache import FeatureCache
from dflash.extract.linked_source import LinkedFeatureSource
from dflash.extract.rank_link import RankLink
from dflash.extract.rank_stream import UnitStream
from dflash.run_files import claimed_key, read_json, write_json
from dflash.train.checkpoints import resume_step_of, verified_latest_tag
from dflash.train.capture_split import log_split, split_advice
from dflash.train.feature_cache_choice import choose_feature_cache

logger = logging.getLogger(__name__)


def resume_step(checkpoint_dir: str) -> int:
    """The global step training resumes at: that of the newest checkpoint that verifies (0 without one)."""
    return resume_step_of(checkpoint_dir, verified_latest_tag(checkpoint_dir))


def plan_record(plan: BatchPlan, group_by: str, num_anchors: int, block_size: int) -> dict:
    """What a capture rank needs to build the trainers' plan (it computes the grouping keys from the dataset)."""
    return {"num_samples": plan.num_samples, "micro_batch_size": plan.micro_batch_size,
            "world_size": plan.world_size, "grad_accum": plan.grad_accum, "seed": plan.seed,
            "group_by_length": plan.group_by_length, "lengths_digest": plan.lengths_digest, "group_by": group_by,
            "num_anchors": num_anchors, "block_size": block_size}


class RankCapture:
    """`features`: the capture stage's folder (online.json); `capture`: the capture settings."""

    def __init__(self, link: RankLink | None, capture, features: str, checkpoint_dir: str, run_dir: str) -> None:
        if link is None:
            raise RuntimeError("capture=online: this process was started without capture ranks; run the command "
                               "under torchrun (python -m dflash.train, dflash.pipeline.run_command), not "
                               "Pipeline(...).run()")
        self.link, self.capture, self.features = link, capture, features
        self.checkpoint_dir, self.run_dir = checkpoint_dir, run_dir

    def source(self, settings, rank: int, world_size: int, lengths: tuple[int, ...] | None,
               block_size: int, group_by: str) -> LinkedFeatureSource:
        """This trainer rank's source; rank 0 first announces the stream (every rank reads the announcement)."""
        info = read_json(os.path.join(self.features, "online.json"))
        plan = BatchPlan(info["num_samples"], settings.micro_batch_size, world_size, settings.grad_accum,
                         settings.seed, group_by_length=settings.group_by_length, lengths=lengths)
        if rank == 0:
            c, first_step = self.capture, resume_step(self.checkpoint_dir)
            hidden_size = int(read_json(os.path.join(self.features, "target.json"))["hidden_size"])
            cache = choose_feature_cache(c, run_dir=self.run_dir, info=info, hidden_size=hidden_size,
                                         epochs=settings.epochs, checkpoint_key=claimed_key(self.checkpoint_dir), resume_step=first_step)
            self.link.announce({
                "data": info["data"], "layer_ids": info["target_layer_ids"], "dtype": str(c.dtype),
                "batch_tokens": int(c.batch_tokens), "pack": bool(c.pack), "in_flight": int(c.in_flight),
                "epochs": 1 if cache["cache"] else settings.epochs, "first_step": first_step, "cache": cache,
                "plan": plan_record(plan, group_by, settings.num_anchors, block_size)})
        start = self.link.wait_start()
        stream = UnitStream(plan, settings.epochs)
        cache = FeatureCache(start["cache"]["dir"]) if start["cache"]["cache"] else None
        logger.info(f"[online] {self.link.captures} capture rank(s) stream to {world_size} trainer rank(s) from step "
                    f"{start['first_step']} ({int(self.capture.in_flight)} micro-batches in flight per trainer rank"
                    + ("; the first epoch only, later ones from the feature cache)" if cache is not None else ")"))
        return LinkedFeatureSource(self.link, stream, rank, start["first_step"], int(self.capture.in_flight), cache)

    def finish(self, source: LinkedFeatureSource, train_s: float, rank: int, world_size: int) -> None:
        """Close this rank's stream; rank 0 reports both throughputs and the balanced split."""
        source.close()
        if rank != 0:
            return
        stats = self.link.capture_stats()
        capture_tokens = sum(s["tokens"] for s in stats)
        # A capture rank of capture.gpus_per_worker GPUs counts as that many devices: the rates are per device.
        device_s = sum(s["capture_s"] * s["gpus"] for s in stats)
        if device_s <= 0 or source.tokens_read == 0:
            logger.info("[online] nothing was captured in this start: no throughput to report")
            return
        capture_rate, capture_devices = capture_tokens / device_s, sum(s["gpus"] for s in stats)
        trainer_rate = source.tokens_read / max(train_s - source.wait_s, 1e-9)  # per trainer rank (rank 0's)
        report = split_advice(capture_rate, trainer_rate, capture_devices, world_size)
        report.update({"capture_tokens": capture_tokens, "trainer_wait_s": source.wait_s, "train_s": train_s,
                       "capture_credit_wait_s": sum(s["credit_wait_s"] for s in stats)})
        os.makedirs(os.path.join(self.run_dir, "capture_logs"), exist_ok=True)
        write_json(os.path.join(self.run_dir, "capture_logs", "throughput.json"), report)
        logger.info(f"[online] capture {capture_rate:,.0f} tok/s per capture device ({capture_devices} on "
                    f"{self.link.captures} capture rank(s)), trainer {trainer_rate:,.0f} tok/s per rank "
                    f"({world_size}; waited {source.wait_s:.1f} s of {train_s:.1f} s for features)")
        log_split(report)
