"""The capture ranks' part of a run (capture=online): load the target on this rank's device (or layer-wise over
its capture.gpus_per_worker GPUs) while the trainer ranks run the data and capture stages, wait for trainer rank 0's
start, stream the micro-batches of its own batch plan from the step and for the epochs the start names
(dflash/extract/capture_sender.py), its target's layers compiled with capture.compile, then post this rank's
counters and exit. Its capture settings and batch plan come from its own settings (every rank runs the same
command); the start adds what the trainers decide at run time, and their plan, which this rank's must equal.

A stop signal (SIGTERM, SIGUSR1, Ctrl-C's SIGINT) once the stream started does not end this rank at once: the
trainers stop on the same signal (torchrun and the schedulers signal every rank) after finishing their step, which
needs this rank's features, and saving it. The rank ends once they stopped the stream or closed their connections
(CaptureStopped: exit status 143, or 130 after Ctrl-C, as theirs), or at torchrun's SIGKILL after its grace.
"""

from __future__ import annotations

import logging
import os
import time

from omegaconf import DictConfig

from dflash.console import EVERY_RANK, console_copied_to, run_log
from dflash.extract.rank_link import RankLink
from dflash.stages.command_ending import ending
from dflash.stages.context import RunContext
from dflash.train.stop_signal import CaptureStopped, StopSignal
from dflash.train.third_party_output import third_party_records_to_run_log

logger = logging.getLogger(__name__)


def serve_capture(cfg: DictConfig, link: RankLink) -> None:
    """Run this capture rank until its stream is sent (or there is none to send), its console copied to
    <run_dir>/logs/<time>-capture-rank<R>.log as a trainer rank's is (and its messages shown once)."""
    context = RunContext(cfg)
    context.target_devices = [str(device) for device in link.devices]  # one GPU, or capture.gpus_per_worker of them
    started = time.strftime("%Y%m%d-%H%M%S")
    with console_copied_to(os.path.join(context.run_dir, "logs", f"{started}-capture-rank{link.rank}.log")), \
            third_party_records_to_run_log():
        try:
            _stream(context, link)
        except Exception as error:
            run_log().write(ending(error))  # the console shows it once the copy has ended
            raise


def _stream(context: RunContext, link: RankLink) -> None:
    target = context.target  # loaded while the trainers prepare the data
    start = link.stream_start()
    if start is None:
        logger.info(f"[online] capture rank {link.rank}: nothing to stream", extra=EVERY_RANK)
        return
    # Only now: before the start a signal ends this rank at once, as it ends the trainers (no handler there yet).
    with StopSignal(ctrl_c_note=None) as stop:
        try:
            sender = _send_stream(context, link, target, start)
        except (RuntimeError, TimeoutError) as error:
            # Trainers that stopped on the signal close the connections this rank waits on: after a signal that is
            # how its stream ends, not an error.
            if stop.received is None:
                raise
            raise CaptureStopped(link.rank, stop.received, f"{type(error).__name__}: {error}") from error
        if stop.received is not None:  # the trainers, stopping on a signal, read no counters
            raise CaptureStopped(link.rank, stop.received, "they ended the stream")
    link.post_stats({**sender.stats(), "gpus": len(link.devices)})
    logger.info(f"[online] capture rank {link.rank}: sent {sender.units_sent} micro-batches", extra=EVERY_RANK)


def _send_stream(context: RunContext, link: RankLink, target, start: dict):
    """This rank's units of the stream `start` names, captured and sent; the CaptureSender that sent them."""
    from dflash.data.batch_plan import plan_lengths
    from dflash.data.dataset import load_dataset_dir
    from dflash.data.sample_sizes import sample_lengths
    from dflash.extract.capture_sender import CaptureSender, target_producer
    from dflash.extract.rank_stream import UnitStream
    from dflash.models.targets.compile_target import target_layers_compiled
    from dflash.train.loop import plan_batches
    from dflash.train.rank_capture import check_same_plan

    dataset = load_dataset_dir(start["data"])
    train, capture = context.settings.train, context.settings.capture
    lengths = plan_lengths(dataset, train, context.settings.drafter.block_size)
    # The plan deals the samples among the trainer ranks only: their number is its world size.
    plan = plan_batches(train, len(dataset), link.trainers, lengths)
    check_same_plan(plan, start["plan"], link.rank)
    produce = target_producer(target, dataset, start["layer_ids"], capture.batch_tokens, capture.dtype, capture.pack,
                              capture.check_every)
    sender = CaptureSender(link, UnitStream(plan, start["epochs"]), start["first_step"], produce,
                           sample_lengths(dataset).tolist(), batch_tokens=capture.batch_tokens,
                           in_flight=capture.in_flight)
    with target_layers_compiled(target, capture.compile):
        sender.run()
    return sender
