"""One command at a time changes a run folder: an advisory lock on the folder itself (flock of its directory).

Two commands writing one folder at once (a second terminal, an evaluation started while the training runs) would
interleave their writes: checkpoints of two settings in one folder, an evaluation of a drafter half-made. A command's
rank 0 holds the lock while it runs, and the kernel releases it however the process ends, a
kill -9 included, so a lock is never left stale. Evaluations alone (their outputs go to their own eval folders) share
it: several run side by side, while a command that trains, captures or exports waits for none of them and is
refused. Nothing is written into the folder for it: a refused command leaves the folder byte for byte as it was.
The lock holds on one host: flock on a network file system (NFS, Lustre without -o flock) is local to each client,
and a file system that takes no lock at all runs unlocked.
"""

from __future__ import annotations

import fcntl
import os

from dflash.config.errors import RunFolderError


class RunFolderBusy(RunFolderError):
    """Another command holds the run folder: a restart of this job may find it free (not recorded as an ending that
    repeats, dflash/stages/job_ending.py)."""


class RunFolderLock:
    """The lock on `run_dir`, held from `take` until `release` (or the process's end); `shared` for a command that
    only evaluates."""

    def __init__(self, run_dir: str, shared: bool = False) -> None:
        self.run_dir, self.shared = run_dir, shared
        self.fd: int | None = None

    def take(self) -> None:
        """Hold the folder's lock (a no-op while held); RunFolderBusy naming the holder when another command holds it
        in a way this one cannot share."""
        if self.fd is not None:
            return
        try:
            fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)  # not inherited: a child never holds the lock
        except OSError as error:
            raise RunFolderError(f"run_dir={self.run_dir}: the folder cannot be opened ({error.strerror})") from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            what = "a command that changes it" if self.shared else "another dflash command"
            raise RunFolderBusy(f"run_dir={self.run_dir}: {what} is working in it{holder(self.run_dir)}; wait for it "
                                f"to end (or stop it), or give this command another run_dir") from None
        except OSError:  # no locks on this file system
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holder(run_dir: str) -> str:
    """' (pid 123: python -m dflash.train ...)' for a process the kernel lists as holding a lock on `run_dir`
    (/proc/locks, Linux: its device and inode), else ''."""
    try:
        status = os.stat(run_dir)
        where = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
        with open("/proc/locks", encoding="ascii") as f:
            pids = [int(fields[4]) for fields in (line.split() for line in f)
                    if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where]
        pid = next(p for p in pids if p != os.getpid())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = " ".join(part.decode(errors="replace") for part in f.read().split(b"\0") if part)
    except (OSError, ValueError, StopIteration):
        return ""
    return f" (pid {pid}: {command[:200]})"
