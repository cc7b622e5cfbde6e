"""The runner of a run: its stages (dflash/stages/) in order, on the ranks that run them, with barriers between.

A stage is skipped when its folder holds a `done.json` whose fingerprint equals the current one (the settings that
decide its output plus the fingerprint of its input stage), so rerunning a run resumes it and changing a setting
redoes exactly the stages it affects. Under a multi-process launcher the train stage runs on every rank, and so
does offline capture (each rank captures its share of the shards); rank 0 does data, export and eval while the rest
wait at a barrier. Where a stage runs on several ranks, rank 0 decides whether it is up to date and tells the others.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import traceback
from typing import Any

from omegaconf import DictConfig

from dflash.config import ConfigError
from dflash.config.errors import NothingToEvaluate
from dflash.config.command_line import adopted_overrides, default_run_line, hydra_overrides
from dflash.config.unknown_keys import override_key
from dflash.console import console_copied_to, run_log
from dflash.run_files import from_rank0, mark_done, write_text
from dflash.stages.run_lock import RunFolderLock
from dflash.stages.capture import CaptureStage
from dflash.stages.closing import closing_block, next_command_rows
from dflash.stages.command_ending import Terminated, TerminationLine, ending, ending_status, exit_command, full_error
from dflash.stages.context import RunContext, refuse_unusable_target
from dflash.stages.data import DataStage
from dflash.stages.evaluation import EvalStage
from dflash.stages.export import ExportStage
from dflash.stages.job_ending import EarlierEnding, ending_recorded, refuse_after_earlier_ending
from dflash.stages.stage import Stage
from dflash.stages.train import TrainStage
from dflash.train.third_party_output import third_party_records_to_run_log

logger = logging.getLogger(__name__)

# How long a rank other than local rank 0 waits before it ends a restart that an earlier start's error stops.
EARLIER_ENDING_WAIT_S = 60

# The stages in the order they run (a Pipeline wires one of each to the stage whose output it reads).
STAGE_CLASSES: tuple[type[Stage], ...] = (DataStage, CaptureStage, TrainStage, ExportStage, EvalStage)


class Pipeline:
    """The stages of one run: `data`, `capture`, `train`, `export` and `eval`, sharing one RunContext."""

    def __init__(self, cfg: DictConfig) -> None:
        self.context = RunContext(cfg)
        self.settings = self.context.settings
        self.data = DataStage(self.context)
        self.capture = CaptureStage(self.context, self.data)
        self.train = TrainStage(self.context, self.capture)
        self.export = ExportStage(self.context, self.train)
        self.eval = EvalStage(self.context, self.export)
        # The order they run in.
        self.stages: tuple[Stage, ...] = (self.data, self.capture, self.train, self.export, self.eval)

    @property
    def adapter(self):
        """The frozen target (loaded on first use)."""
        return self.context.target

    def run(self) -> dict[str, Any] | None:
        """The selected stages in order; the summary of the stage that measured one (eval, on rank 0), else None.
        Every stage's preflight comes first, so a bad setting or a missing file stops the command before any work
        (and before the line saying this is the CPU demo or the GPU default). Everything the run prints is also
        written to <run_dir>/logs/."""
        run = self.context
        refuse_unusable_target(self.settings)
        chosen = [stage for stage in self.stages if stage.name in selected_stages(self.settings.stages, self.stages)]
        lock = RunFolderLock(run.run_dir, shared=all(stage.shares_run_folder for stage in chosen))
        try:
            if run.rank == 0 and os.path.isdir(run.run_dir):  # before the preflight reads what another might write
                lock.take()
            return self.run_locked(lock)
        finally:
            lock.release()

    def run_locked(self, lock: RunFolderLock) -> dict[str, Any] | None:
        """`run` once the run folder is this command's (rank 0 holds `lock` from the folder's making on)."""
        run = self.context
        selected = selected_stages(self.settings.stages, self.stages)
        for stage in self.stages:
            stage.preflight(stage.name in selected)
        try:
            os.makedirs(run.run_dir, exist_ok=True)
        except OSError as error:  # a folder the schema could not judge (a special file system, another user's)
            raise ConfigError(f"run_dir={self.settings.run_dir!r}: the folder cannot be made ({error.strerror})") \
                from None
        if run.rank == 0:
            lock.take()  # a folder made just now, perhaps by a command started beside this one
        if run.world_size > 1:
            from dflash.train.engine import init_distributed

            init_distributed()
            run.barrier()  # the other ranks write nothing (their logs) until rank 0 holds the folder
        started = time.strftime("%Y%m%d-%H%M%S")
        log = os.path.join(run.run_dir, "logs", f"{started}{f'-rank{run.rank}' if run.world_size > 1 else ''}.log")
        with console_copied_to(log), third_party_records_to_run_log():
            # The CPU demo or the GPU default, said once the settings passed, where there is work to do.
            if default_run_line() is not None and not self.all_done(selected):
                print(default_run_line(), file=sys.stderr, flush=True)
            try:
                summary = self.run_stages()
            except (Exception, KeyboardInterrupt) as error:
                # The console shows it once the copy has ended (run_command, or Python's traceback): the log,
                # which holds everything the command printed, gets it here.
                run_log().write(ending(error))
                raise
            if run.rank == 0:
                rows = next_command_rows(run, selected, trained=self.train.done())
                print(closing_block(run.run_dir, self.stages, log, rows), flush=True)
        return summary

    def all_done(self, selected: list[str]) -> bool:
        """Whether every selected stage is marked done for its settings, by the done markers alone (read in order,
        so a later stage's marker is read only when every earlier one is done): a rerun that keeps everything."""
        try:
            return all(stage.done() for stage in self.stages if stage.name in selected)
        except NothingToEvaluate:  # no drafter of these settings yet: the eval stage is not done
            return False

    def run_stages(self) -> dict[str, Any] | None:
        run = self.context
        if run.world_size > 1:
            from dflash.train.engine import init_distributed

            init_distributed()
            # Every rank's preflight has read the run folder (the guard, the checkpoints) before rank 0's first
            # stage may change it (config.yaml, an older drafter moved aside).
            run.barrier()
        selected = selected_stages(self.settings.stages, self.stages)
        chosen = [stage for stage in self.stages if stage.name in selected]
        # <run_dir>/config.yaml, the settings of the run folder's stages (which the guard reads), is written before
        # they run; where each is done already (a command of other eval settings), after the stages, so that an
        # interrupted evaluation leaves the run folder as it was.
        writes_config = run.rank == 0 and (not chosen or not all(stage.records_own_config for stage in chosen))
        config_first = writes_config and not all(stage.records_own_config or stage.done() for stage in chosen)
        if run.rank == 0:
            for warning in [*self.settings.ignored(typed=command_line_keys()),
                            *(warning for stage in chosen for warning in stage.warnings())]:
                print(f"dflash: warning: {warning}", file=sys.stderr, flush=True)
            if config_first:
                write_text(os.path.join(run.run_dir, "config.yaml"), run.config_yaml())
        for stage in self.stages:
            if stage in chosen:
                if run.rank == 0:
                    print(f"[{stage.name}] {stage.describe()}", flush=True)
                if stage.every_rank or run.rank == 0:
                    if stage.barrier_before:
                        run.barrier()
                    timed(stage.name, functools.partial(run_stage, stage, run.rank))
            if stage.barrier_after:
                run.barrier()
        if writes_config and not config_first:
            write_text(os.path.join(run.run_dir, "config.yaml"), run.config_yaml())
        return next((stage.summary for stage in chosen if stage.summary is not None), None)


def command_line_keys() -> set[str] | None:
    """The dotted keys the command line set (`train.lr=1e-3`, `+eval.seed=3`), or None outside a Hydra command
    (a config composed by a test or a notebook: every key counts). Settings that an experiment or a group file set
    together are consistent; only a key someone typed is worth a warning that this combination ignores it."""
    overrides = hydra_overrides()
    if overrides is None:
        return None
    return {override_key(override) for override in overrides} - {override_key(o) for o in adopted_overrides()}


def selected_stages(named: list[str], stages: tuple[Stage | type[Stage], ...] = STAGE_CLASSES) -> list[str]:
    """The stages a command runs: those it names, and each stage that runs with one of them (Stage.runs_with)."""
    return list(named) + [s.name for s in stages if s.runs_with in named and s.name not in named]


def run_stage(stage: Stage, rank: int) -> None:
    """One stage on this rank: kept when it is up to date (its done.json holds its fingerprint), else run, and
    marked done by rank 0 with what its run recorded. Rank 0 decides whether it is up to date for every rank that
    runs it, so that no rank trains (or captures) while another keeps."""
    stage.prepare()
    if stage.every_rank:
        current = from_rank0(stage.up_to_date, f"whether {stage.out} is up to date")
    else:
        current = stage.up_to_date()
    if current:
        if stage.kept_line is not None:
            logger.info(f"[{stage.name}] {stage.kept_line}: {stage.out}")
        stage.kept()
        return
    record = stage.run()
    if record is not None and rank == 0:
        mark_done(stage.out, stage.fingerprint(), **record)


def timed(stage: str, work):
    """work() with its wall time logged (rank 0 shows it): where a run's minutes go is the first question after a
    long run."""
    started = time.perf_counter()
    result = work()
    logger.info(f"[{stage}] stage took {time.perf_counter() - started:.1f} s")
    return result


def run_command(cfg: DictConfig, stages: list[str] | None = None) -> dict[str, Any] | None:
    """What the commands run: the pipeline over `stages` (default: cfg.stages). A user error (ConfigError: a bad
    setting or a run folder that holds a drafter of other settings, found before any work; a bad prompt record or a
    corrupt checkpoint, found when it is read) ends the process with one line (exit status 2; HYDRA_FULL_ERROR=1
    shows the traceback); so does training that diverged (exit status 1), and a stop on SIGTERM (143: training
    saves its step first, another stage keeps what it had saved, command_ending.Terminated). A restarted
    start of a capture=online torchrun job whose earlier start ended in a user error or divergence stops at once with
    that status (EarlierEnding). Ctrl-C ends it with one line saying the same command resumes, the process dying of
    SIGINT (status 130) so that a shell loop running it stops too; training first saves the step in flight
    (dflash/train/stop_signal.py)."""
    from dflash.train.divergence import TrainingDiverged
    from dflash.train.stop_signal import CaptureStopped, TrainingStopped

    if stages is not None:
        cfg.stages = stages
    try:
        with TerminationLine():
            return run_role(cfg)
    except EarlierEnding as earlier:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line a node, not one a rank
            print(f"dflash: error: {earlier}", file=sys.stderr, flush=True)
        else:
            # torchrun ends a node's ranks once one of them exits: the others wait for local rank 0, whose exit
            # after its line ends them, so a rank that got here first cannot end it before it printed.
            time.sleep(EARLIER_ENDING_WAIT_S)
        sys.exit(earlier.status)
    except (ConfigError, TrainingDiverged) as error:
        if full_error():
            raise
        print(ending(error), end="", file=sys.stderr, flush=True)
        sys.exit(ending_status(error))
    except (TrainingStopped, CaptureStopped) as stopped:
        print(ending(stopped), end="", flush=True)
        exit_command(ending_status(stopped))
    except KeyboardInterrupt as interrupted:
        if full_error() and isinstance(interrupted, Terminated):
            traceback.print_exc()
            sys.exit(ending_status(interrupted))
        if full_error():
            raise
        print(ending(interrupted), end="", file=sys.stderr, flush=True)
        exit_command(ending_status(interrupted))


def run_role(cfg: DictConfig) -> dict[str, Any] | None:
    """The pipeline, or this process's role in a job some of whose ranks capture for the others (capture=online:
    the job's or every node's last ranks, dflash/extract/rank_link.py)."""
    from dflash.config import settings_from

    s = settings_from(cfg)
    c = s.capture
    # Only training streams from the capture ranks (the capture stage merely prepares, on one process): a command
    # without it, such as the data step of launch/one_node.sh or an evaluation, is one process running the pipeline.
    if c.mode != "online" or TrainStage.name not in selected_stages(s.stages):
        return Pipeline(cfg).run()
    from dflash.extract.rank_link import capture_gpus, open_link

    refuse_after_earlier_ending(s.run_dir)  # before the target loads, and before this start's ranks meet
    link = open_link(c.ranks, s.device, c.timeout_s, capture_gpus(c, s.target), c.ranks_per_node)
    if link.is_capture:
        from dflash.stages.capture_role import serve_capture

        with ending_recorded(s.run_dir, link.name(link.rank)):
            serve_capture(cfg, link)
        return None
    pipeline = Pipeline(cfg)
    pipeline.train.link = link
    try:
        with ending_recorded(s.run_dir, link.name(link.rank)):
            return pipeline.run()
    except BaseException as error:
        if link.trainer_index == 0 and not link.announced():
            # The other ranks wait for the announcement: they end naming this rank's error, not a symptom of it.
            link.announce({"failed": f"{type(error).__name__}: {error}"})
        raise
    finally:
        if link.trainer_index == 0 and not link.announced():
            link.announce(None)  # no training in this start (stages, or up to date): the capture ranks exit
