"""The capture ranks' part of a run (capture=online): load the target on this rank's device (or layer-wise over
its capture.gpus_per_worker GPUs) while the trainer ranks run the data and capture stages, wait for trainer rank 0's
start, stream the micro-batches it names (dflash/extract/capture_sender.py), its target's layers compiled with
capture.compile, then post this rank's counters and exit.
"""

from __future__ import annotations

import logging
import os
import time

from omegaconf import DictConfig

from dflash.console import EVERY_RANK, console_copied_to
from dflash.extract.rank_link import RankLink
from dflash.stages.context import RunContext

logger = logging.getLogger(__name__)


def serve_capture(cfg: DictConfig, link: RankLink) -> None:
    """Run this capture rank until its stream is sent (or there is none to send), its console copied to
    <run_dir>/logs/<time>-capture-rank<R>.log as a trainer rank's is (and its messages shown once)."""
    context = RunContext(cfg)
    context.target_devices = [str(device) for device in link.devices]  # one GPU, or capture.gpus_per_worker of them
    started = time.strftime("%Y%m%d-%H%M%S")
    with console_copied_to(os.path.join(context.run_dir, "logs", f"{started}-capture-rank{link.rank}.log")):
        _stream(context, link)


def _stream(context: RunContext, link: RankLink) -> None:
    from dflash.data.batch_plan import BatchPlan, grouping_keys
    from dflash.data.dataset import load_dataset_dir
    from dflash.data.sample_sizes import sample_lengths
    from dflash.extract.capture_sender import CaptureSender, target_producer
    from dflash.extract.rank_stream import UnitStream
    from dflash.models.targets.compile_target import target_layers_compiled

    target = context.target  # loaded while the trainers prepare the data
    start = link.wait_start()
    if start is None:
        logger.info(f"[online] capture rank {link.rank}: nothing to stream", extra=EVERY_RANK)
        return
    dataset = load_dataset_dir(start["data"])
    p = start["plan"]
    lengths = None
    if p["group_by_length"]:
        lengths = tuple(grouping_keys(dataset, p["group_by"], p["num_anchors"], p["block_size"]).tolist())
    plan = BatchPlan(p["num_samples"], p["micro_batch_size"], p["world_size"], p["grad_accum"], p["seed"],
                     group_by_length=p["group_by_length"], lengths=lengths)
    if plan.lengths_digest != p["lengths_digest"] or len(dataset) != plan.num_samples:
        raise RuntimeError(f"capture rank {link.rank}: the dataset {start['data']} does not give the trainers' batch "
                           "plan (other samples or lengths)")
    produce = target_producer(target, dataset, start["layer_ids"], start["batch_tokens"], start["dtype"],
                              start["pack"])
    sender = CaptureSender(link, UnitStream(plan, start["epochs"]), start["first_step"], produce,
                           sample_lengths(dataset).tolist(), batch_tokens=start["batch_tokens"],
                           in_flight=start["in_flight"])
    with target_layers_compiled(target, context.settings.capture.compile):
        sender.run()
    link.post_stats({**sender.stats(), "gpus": len(link.devices)})
    logger.info(f"[online] capture rank {link.rank}: sent {sender.units_sent} micro-batches", extra=EVERY_RANK)
