"""The train stage's side of capture=online: the job's last ranks capture (dflash/extract/rank_link.py) and send
each trainer rank its micro-batches' features.

Every rank of the job runs the same composed command, so the capture ranks read their capture and train settings
from their own RunSettings. Trainer rank 0 announces only what is decided at run time: the dataset and the taps
(the capture stage's record), the step training resumes at (the newest checkpoint that verifies, as the loop
resumes), and the epochs to capture, so the capture ranks start where the trainers do and no sample is lost or used
twice across a restart. It also announces its batch plan's fields as a check: each capture rank builds the plan
itself with loop.plan_batches, as the trainers do, and refuses to stream another one (check_same_plan). Every trainer
rank then reads its micro-batches through a LinkedFeatureSource. Rank 0 also decides, when a run starts, whether the
first epoch's features are kept for the later ones (capture.cache, feature_cache_choice.py): then the capture ranks
make one epoch. After training, `finish` closes the stream and, on rank 0, reports the capture and trainer
throughputs and the device split that would balance them.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from dflash.config import ConfigError
from dflash.config.schema import TrainSettings
from dflash.data.batch_plan import BatchPlan
from dflash.extract.feature_cache import FeatureCache
from dflash.extract.linked_source import LinkedFeatureSource
from dflash.extract.rank_link import RankLink
from dflash.extract.rank_stream import UnitStream
from dflash.run_files import claimed_key, read_json, write_json
from dflash.train.checkpoints import resume_step_of, verified_latest_tag
from dflash.train.capture_split import log_split, split_advice
from dflash.train.feature_cache_choice import choose_feature_cache
from dflash.train.loop import plan_batches

logger = logging.getLogger(__name__)


def resume_step(checkpoint_dir: str) -> int:
    """The global step training resumes at: that of the newest checkpoint that verifies (0 without one)."""
    return resume_step_of(checkpoint_dir, verified_latest_tag(checkpoint_dir))


def plan_fields(plan: BatchPlan) -> dict:
    """The fields that make two plans equal (the lengths by their digest): what a capture rank's plan is checked
    against."""
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.compare}


def check_same_plan(plan: BatchPlan, announced: dict, rank: int) -> None:
    """ConfigError naming each field in which capture rank `rank`'s plan differs from the trainers' `announced` one:
    it would capture other samples than the trainers ask for."""
    differ = []
    for key, value in plan_fields(plan).items():
        if value != announced[key]:
            name = f"train.{key}" if key in TrainSettings.__dataclass_fields__ else key
            differ.append(f"{name} (trainers {announced[key]}, this rank {value})")
    if differ:
        raise ConfigError(f"capture rank {rank} was composed with other train settings or data than the trainers: "
                          f"its batch plan differs in {'; '.join(differ)}. Run every rank with the same command "
                          "(lengths_digest: the grouping keys of the dataset's samples, from train.group_by, "
                          "train.num_anchors and drafter.block_size)")


class RankCapture:
    """`features`: the capture stage's folder (online.json); `capture`: the capture settings; `data`: the data stage's
    folder of this run, by default the `data` folder beside `features` (as in a run folder)."""

    def __init__(self, link: RankLink | None, capture, features: str, checkpoint_dir: str, run_dir: str,
                 data: str | None = None) -> None:
        if link is None:
            raise RuntimeError("capture=online: this process was started without capture ranks; run the command "
                               "under torchrun (python -m dflash.train, dflash.pipeline.run_command), not "
                               "Pipeline(...).run()")
        self.link, self.capture, self.features = link, capture, features
        self.checkpoint_dir, self.run_dir = checkpoint_dir, run_dir
        self.data = data or os.path.join(os.path.dirname(os.path.abspath(features)), "data")

    def source(self, settings: TrainSettings, rank: int, world_size: int,
               lengths: tuple[int, ...] | None) -> LinkedFeatureSource:
        """This trainer rank's source; rank 0 first announces the stream (every rank reads the announcement)."""
        # This run's data, not a "data" path in online.json: that one is stale once the run folder moved.
        info = {**read_json(os.path.join(self.features, "online.json")), "data": self.data}
        plan = plan_batches(settings, info["num_samples"], world_size, lengths)
        if rank == 0:
            c, first_step = self.capture, resume_step(self.checkpoint_dir)
            hidden_size = int(read_json(os.path.join(self.features, "target.json"))["hidden_size"])
            cache = choose_feature_cache(c, run_dir=self.run_dir, info=info, hidden_size=hidden_size,
                                         epochs=settings.epochs, checkpoint_key=claimed_key(self.checkpoint_dir),
                                         resume_step=first_step)
            self.link.announce({"data": info["data"], "layer_ids": info["target_layer_ids"],
                                "epochs": 1 if cache["cache"] else settings.epochs, "first_step": first_step,
                                "cache": cache, "plan": plan_fields(plan)})
        start = self.link.stream_start()
        if start is None:
            raise RuntimeError("trainer rank 0 announced no feature stream while this trainer rank trains")
        stream = UnitStream(plan, settings.epochs)
        decided = start["cache"]
        cache = FeatureCache(decided["dir"], decided.get("token")) if decided["cache"] else None
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
