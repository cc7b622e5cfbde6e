"""One dflash command at a time in a run folder: a second one is refused in one line that names the first, before it
reads or writes anything there; the lock goes with the command, however it ends."""

import os
import subprocess
import sys
import time

import pytest

from dflash.config import compose
from dflash.config.errors import NothingToEvaluate, RunFolderError
from dflash.pipeline import Pipeline
from dflash.run_files import folder_checksums
from dflash.stages.run_lock import RunFolderBusy, RunFolderLock

TINY = ["+experiment=tiny", "show_progress=false", "stages=[data]", "data.limit=4", "data.max_new_tokens=4"]
HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)")


@pytest.fixture
def held_elsewhere(tmp_path):
    """tmp_path/run, holding a finished data stage, locked by another process (as a running command locks it)."""
    run_dir = tmp_path / "run"
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield run_dir, holder.pid
    holder.kill()
    holder.wait()


def test_a_second_command_in_a_folder_in_use_is_refused_and_changes_nothing(held_elsewhere):
    run_dir, pid = held_elsewhere
    before = folder_checksums(run_dir)
    with pytest.raises(RunFolderError, match=rf"run_dir={run_dir}: another dflash command is working in it "
                                             rf"\(pid {pid}: .*python.* -c import fcntl.*\); wait for it to end"):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", "data.limit=3"])).run()
    assert folder_checksums(run_dir) == before  # not even the command's log


def test_the_lock_goes_with_its_command(tmp_path, held_elsewhere):
    run_dir, pid = held_elsewhere
    os.kill(pid, 9)  # a kill -9: the kernel releases the lock
    for _ in range(100):
        try:
            lock = RunFolderLock(str(run_dir))
            lock.take()
            lock.release()
            break
        except RunFolderError:
            time.sleep(0.05)
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()  # up to date, and not refused
    # A command that failed after taking the lock (nothing to evaluate: no drafter was trained) let the next one in.
    with pytest.raises(NothingToEvaluate):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[eval]"])).run()
    lock = RunFolderLock(str(run_dir))
    lock.take()
    lock.release()


def test_a_lock_is_taken_once_and_released(tmp_path):
    lock = RunFolderLock(str(tmp_path))
    lock.take()
    lock.take()  # held already: nothing more
    other = RunFolderLock(str(tmp_path))
    with pytest.raises(RunFolderError, match="another dflash command is working in it"):
        other.take()
    lock.release()
    other.take()
    other.release()


def test_the_other_ranks_write_nothing_before_rank_0_holds_the_folder(tmp_path, monkeypatch):
    # A torchrun command refused at rank 0 left rank 1's log in the busy folder: rank 1 now waits for rank 0 first.
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path / 'run'}"]))
    pipeline.context.rank, pipeline.context.world_size = 1, 2
    monkeypatch.setattr("dflash.train.engine.init_distributed", lambda: (1, 2, 1))
    seen = []

    def barrier():
        seen.append(sorted(os.listdir(tmp_path / "run")))
        raise RuntimeError("rank 0 ended: torchrun stops this rank")

    monkeypatch.setattr(pipeline.context, "barrier", barrier)
    with pytest.raises(RuntimeError, match="rank 0 ended"):
        pipeline.run()
    assert seen == [[]]  # not even its log


def test_evaluations_share_the_folder_and_a_training_waits_for_none(tmp_path):
    evaluating = RunFolderLock(str(tmp_path), shared=True)
    evaluating.take()
    beside = RunFolderLock(str(tmp_path), shared=True)
    beside.take()  # a second evaluation, side by side (T=0 and T=1 on two GPUs)
    with pytest.raises(RunFolderBusy, match="another dflash command is working in it"):
        RunFolderLock(str(tmp_path)).take()
    evaluating.release()
    beside.release()
    training = RunFolderLock(str(tmp_path))
    training.take()
    with pytest.raises(RunFolderBusy, match="a command that changes it is working in it"):
        RunFolderLock(str(tmp_path), shared=True).take()
    training.release()


def test_a_busy_folder_is_no_ending_a_restart_would_meet_again():
    # Under torchrun's restarts a recorded ending stops every later start; the other command may have ended by then.
    from dflash.config import ConfigError
    from dflash.stages.job_ending import repeats_on_restart

    assert repeats_on_restart(ConfigError("train.lr=-1")) and not repeats_on_restart(RunFolderBusy("busy"))


@pytest.mark.parametrize("stages, shared", [("[eval]", True), ("[export,eval]", False), ("[data]", False)])
def test_only_a_command_that_evaluates_alone_shares_the_folder(tmp_path, monkeypatch, stages, shared):
    taken = []
    monkeypatch.setattr(RunFolderLock, "take", lambda self: taken.append(self.shared) or (_ for _ in ()).throw(
        RuntimeError("stop")))
    (tmp_path / "run").mkdir()
    with pytest.raises(RuntimeError, match="stop"):
        Pipeline(compose(TINY + [f"run_dir={tmp_path / 'run'}", f"stages={stages}"])).run()
    assert taken == [shared]
