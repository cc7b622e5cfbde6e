"""A capture=online torchrun job that may restart (--max-restarts) ends at its first start on an error a restart
would meet again (a user error, a corrupt file, divergence): the rank that meets it records it in the run folder
under torchrun's run id, and every later start of that job stops before its ranks meet or the target loads, with
the same status. torch restarts a job on any failure; without the record each start would load the target (minutes
at 27B) and fail again."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys

from dflash.config import ConfigError
from dflash.run_files import read_json_or_none, write_json
from dflash.stages.command_ending import ending_status

logger = logging.getLogger(__name__)

# Where a rank of a torchrun job that may restart records the error that ended it when a restart would meet it again.
ENDING_FILE = os.path.join("logs", "job-ending.json")


def repeats_on_restart(error: BaseException) -> bool:
    """Whether a restart of the job would end in `error` again: a user error (a setting, a corrupt file) or
    divergence, not a peer that is gone or a crash. Nor a stop on a signal: torchrun sends SIGTERM to the ranks
    left when it restarts the job after a rank died, and that restart must go on (a stop that torchrun was sent
    itself ends the job without a restart)."""
    from dflash.stages.run_lock import RunFolderBusy
    from dflash.train.divergence import TrainingDiverged

    return isinstance(error, (ConfigError, TrainingDiverged)) and not isinstance(error, RunFolderBusy)


def restartable_job() -> str | None:
    """This torchrun job's run id (TORCHELASTIC_RUN_ID) where torchrun may restart it and the id is the launch's
    own (--standalone: a new one each launch; launch/multi_node.sh passes one); else None."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    return run_id if restarts > 0 and run_id not in ("", "none") else None


@contextlib.contextmanager
def ending_recorded(run_dir: str, who: str):
    """Inside: an error that a restart of this job would meet again is recorded in <run_dir>/ENDING_FILE (its job,
    `who` met it, its status) as it ends this rank, so that the restarted start stops at once
    (refuse_after_earlier_ending). Recorded first: once the other ranks end, torchrun stops this one."""
    try:
        yield
    except BaseException as error:
        job = restartable_job()
        if job is not None and repeats_on_restart(error):
            record = {"job": job, "command": this_command(),
                      "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "rank": who,
                      "status": ending_status(error), "error": " ".join(f"{type(error).__name__}: {error}".split())}
            try:
                os.makedirs(os.path.join(run_dir, os.path.dirname(ENDING_FILE)), exist_ok=True)
                write_json(os.path.join(run_dir, ENDING_FILE), record)
            except OSError as problem:  # the error that ends the rank is the one to show
                logger.warning(f"the ending of this rank could not be recorded for torchrun's restarts: {problem}")
        raise


class EarlierEnding(Exception):
    """An earlier start of this torchrun job ended with an error that a restart meets again."""

    def __init__(self, record: dict, path: str) -> None:
        super().__init__(f"an earlier start of this job (torchrun run {record['job']}, restart {record['restart']}) "
                         f"ended on {record['rank']} with {record['error']}; a restart would end the same way, so "
                         f"this one stops before any work (exit status {record['status']}; recorded in {path}: "
                         f"delete it to launch the same command under the same run id again)")
        self.status = int(record["status"])


def refuse_after_earlier_ending(run_dir: str) -> None:
    """EarlierEnding where <run_dir>/ENDING_FILE names this job. Called before the ranks meet, and a rank records
    only after they met (ending_recorded): a record of this job and command is an earlier start's, on every node (a
    restart count would not tell: torchrun counts restarts per node). Another launch has another run id, or runs
    another command."""
    job, path = restartable_job(), os.path.join(run_dir, ENDING_FILE)
    record = read_json_or_none(path) if job is not None else None
    # A launch of another command under the same run id (a fixed command in one SLURM allocation) is not a restart.
    if record is not None and record.get("job") == job and record.get("command") == this_command():
        raise EarlierEnding(record, path)


def this_command() -> str:
    """This process's command line (a restart runs the same one), as a short digest."""
    return hashlib.sha256("\0".join(sys.argv).encode()).hexdigest()[:16]
