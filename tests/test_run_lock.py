"""One dflash command at a time in a run folder: a second one is refused in one line that names the first, before it
reads or writes anything there; the lock goes with the command, however it ends."""

import os
import subprocess
import sys
import time

import pytest

from dflash.config import compose
from dflash.config.errors import RunFolderError
from dflash.pipeline import Pipeline
from dflash.run_files import folder_checksums
from dflash.stages.run_lock import RunFolderLock

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
    # A command that failed let the next one in too.
    with pytest.raises(Exception) as failed:
        Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[eval]", "eval.checkpoint=step7"])).run()
    assert "another dflash command" not in str(failed.value)
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()


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
