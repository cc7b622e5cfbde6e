"""Files of a run folder: atomic writes, JSON, and the done-markers that let a rerun skip a stage.

Every file the project writes goes through `atomic_path` / `atomic_write`: written under a temporary name in the
same folder, fsynced, renamed over the destination, and the folder fsynced, so a reader (or a run resumed after a
crash or a power loss) finds the old file or the whole new one, never a part.

A stage's folder holds `done.json` with the fingerprint of what decided its output; a stage whose marker matches
the current fingerprint is finished and is skipped. Where several ranks act on what a run folder holds, rank 0
reads it for all of them (from_rank0).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)


def fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_done(folder: str, key: str) -> bool:
    """Whether `folder` holds a done marker for `key`; an unreadable marker counts as not done (redo the stage)."""
    path = os.path.join(folder, "done.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("fingerprint") == key
    except (OSError, ValueError, AttributeError):
        return False


def clear_done(folder: str) -> None:
    """Remove `folder`'s done marker before a stage rewrites the folder: killed halfway, the folder must not pass
    as the finished work of the settings the marker names."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, "done.json"))


def mark_done(folder: str, key: str, **info: Any) -> None:
    write_json(os.path.join(folder, "done.json"), {"fingerprint": key, **info})


def from_rank0(read: Callable[[], Any], what: str) -> Any:
    """What `read()` gives on rank 0, on every rank of the process group (a picklable object; a plain call without
    a group of several ranks). Each rank reading for itself could see the run folder at another moment: on a shared
    file system another node may still see an entry it cached before rank 0 changed it.

    An exception on rank 0 is raised on every rank, so the others do not wait in a collective until it times out:
    a ConfigError (a corrupt file named, with what to do) as itself, so that the command ends with its one line on
    every rank; anything else as a ValueError saying rank 0 could not read `what`.
    """
    import torch.distributed as dist

    from dflash.config.errors import ConfigError

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return read()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", read())]
        except ConfigError as error:
            box = [("error", error)]
        except Exception as error:  # noqa: BLE001 (re-raised below, on every rank)
            box = [("error", f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        if isinstance(value, ConfigError):
            raise value
        raise ValueError(f"rank 0 could not read {what}: {value}")
    return value


def temp_path(path: str | os.PathLike) -> str:
    """The temporary name `path` is written under: `.<name>.tmp-<pid>` in the same folder (the rename then stays on
    one file system), hidden, and unique to its writer."""
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}")


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file under `folder`, and the folders themselves, to the disk: a folder written whole and then
    renamed into place (swap_in_dir) is then complete after a power loss, as an atomic_path file is."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Inside, write the new file at the temporary path yielded; on leaving, it replaces `path` whole (an error
    inside removes it and leaves `path` as it was). The file's data is fsynced before the rename and the folder's
    entry after it, so that after a power loss `path` is the old file or the whole new one.
    """
    tmp = temp_path(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to `path` through atomic_path."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically: a reader sees the old file or the whole new one, also after a crash."""
    atomic_write(path, text)


def write_json(path: str, value: Any) -> None:
    write_text(path, json.dumps(value, indent=2))


CHECKPOINT_KEY = "fingerprint.json"
# Beside it: the settings fingerprint of the training that wrote the checkpoints, its split of the global batch and its
# command (dflash/stages/batch_split.py, dflash/config/training_command.py).
SETTINGS_KEY = "settings.json"


def claim_checkpoint_dir(directory: str, key: str, before_move: Callable[[str], None] | None = None) -> str | None:
    """Make `directory` hold checkpoints of the training run fingerprinted `key` only.

    Checkpoints written under other settings (or before checkpoints carried a fingerprint) would be resumed as if
    they were this run's: a run whose settings changed would load the old final step and export the old weights.
    They are moved aside (claim_dir), never deleted; a later run with those settings again moves them back and
    resumes.
    """
    return claim_dir(directory, key, stage="train", contents="checkpoints", keep_moved=True, before_move=before_move)


def claimed_key(directory: str) -> str | None:
    """The fingerprint of the settings whose work `directory` holds (its claim_dir marker), or None."""
    marker = read_json_or_none(os.path.join(directory, CHECKPOINT_KEY))
    return marker.get("fingerprint") if isinstance(marker, dict) else None


def claim_dir(directory: str, key: str, *, stage: str, contents: str, keep_moved: bool = False,
              before_move: Callable[[str], None] | None = None) -> str | None:
    """Make `directory` hold the work of settings fingerprinted `key` only (`contents` of stage `stage`).

    Work of other settings (its fingerprint in the folder's marker, else in a done.json; neither: unfingerprinted)
    is moved aside to `<directory>.<old key>`, and a folder moved aside earlier for `key` is moved back, so going
    back to earlier settings resumes their work. Unless `keep_moved` (trained work is never deleted), only one
    moved-aside folder is kept besides the one being restored: feature stores are large and can be captured again,
    and every settings change would add one. `before_move(old key)` runs just before the folder is moved aside (to
    put into it what must go with it in the same rename). Returns where the current folder went, or None when
    nothing moved.
    """
    marker = os.path.join(directory, CHECKPOINT_KEY)
    parent, name = os.path.split(os.path.abspath(directory))
    restore = f"{directory}.{key}"
    moved = None
    if os.path.isdir(directory) and os.listdir(directory):
        old = _folder_key(directory)
        if old == key:
            write_json(marker, {"fingerprint": key})  # a folder from before the marker: claimed as it is
            return None
        # Only folders this function made: <name>.<16 hex digits of a fingerprint> or <name>.unfingerprinted.
        ours = re.compile(re.escape(name) + r"\.([0-9a-f]{16}|unfingerprinted)")
        for stale in [] if keep_moved else os.listdir(parent):
            path = os.path.join(parent, stale)
            if ours.fullmatch(stale) and os.path.isdir(path) and os.path.abspath(path) != os.path.abspath(restore):
                logger.info(f"[{stage}] deleting {path}, {contents} of settings older than the ones moved aside now")
                shutil.rmtree(path)
        moved = f"{directory}.{old or 'unfingerprinted'}"
        if before_move is not None:
            before_move(old or "unfingerprinted")
        os.replace(directory, moved)
    elif os.path.isdir(directory):
        os.rmdir(directory)
    if os.path.isdir(restore):
        os.replace(restore, directory)  # these settings ran before: their work resumes
        logger.info(f"[{stage}] {contents} of these settings restored from {restore}")
        return moved
    os.makedirs(directory, exist_ok=True)
    write_json(marker, {"fingerprint": key})
    if moved:
        logger.info(f"[{stage}] no {contents} of these settings: the stage starts afresh")
    return moved


def _folder_key(directory: str) -> str | None:
    """The fingerprint a folder's work belongs to: its claim marker's, else its done.json's, else (a feature store
    captured partly before folders were claimed) its manifest's {"key": ...}; None if none."""
    for file in (CHECKPOINT_KEY, "done.json", "manifest.json"):
        try:
            key = read_json(os.path.join(directory, file)).get("fingerprint")
            key = key.get("key") if isinstance(key, dict) else key
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(key, str):
            return key
    return None


def swap_in_dir(new: str, target: str, aside: str) -> None:
    """Put the finished folder `new` in the place of folder `target` (same parent), so `target` is never
    half-written, also after a power loss (`new` is fsynced first, and the parent folder after the rename).
    os.replace cannot overwrite a non-empty folder: the old one goes to `aside` first, comes back if `new` cannot
    take its place, and is deleted once it has. An `aside` left by a swap killed before that delete is older than
    `target` and goes first."""
    fsync_tree(new)
    if os.path.exists(target):
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
    try:
        os.replace(new, target)
    except BaseException:
        if os.path.exists(aside) and not os.path.exists(target):
            os.replace(aside, target)
        raise
    fsync_path(os.path.dirname(os.path.abspath(target)))
    shutil.rmtree(aside, ignore_errors=True)


def settle_swap(out: str, finished: Callable[[str], bool] = lambda path: False, legacy: tuple[str, ...] = ()) -> None:
    """After a swap into `out` (swap_in_dir from a folder named by temp_path) killed midway: where `out` is missing,
    a finished new folder (`finished(path)`) takes its place, else the one set aside (`.old`) comes back (of several,
    the latest); what else
    the swap left beside `out` under those names goes. `legacy`: glob patterns of other temporary names, relative to
    `out`'s folder, treated alike."""
    parent, name = os.path.split(out)
    patterns = (f".{glob.escape(name)}.tmp-*", *legacy)
    left = sorted({path for pattern in patterns for path in glob.glob(os.path.join(glob.escape(parent), pattern))})
    if not os.path.exists(out):
        done = [path for path in left if not path.endswith(".old") and finished(path)]
        aside = [path for path in left if path.endswith(".old")]
        if done or aside:
            # Of several (a kill each time), the one renamed last: a rename sets its inode's change time.
            chosen = max(done or aside, key=lambda path: os.stat(path).st_ctime_ns)
            os.replace(chosen, out)
            left.remove(chosen)
    for path in left:
        shutil.rmtree(path, ignore_errors=True)


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_json_or_none(path: str | os.PathLike) -> Any:
    """The JSON at `path`, or None when it is not there (yet) or is being replaced at this instant."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node

OWNER_MARKER = ".made-by-dflash"


def make_owned_dir(path: str) -> None:
    """Create `path` (if needed) and mark it as a folder dflash may empty and delete (remove_owned_dir)."""
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, OWNER_MARKER)
    if not os.path.exists(marker):
        write_text(marker, "this folder is written and deleted by dflash\n")


def remove_owned_dir(path: str, run_dir: str | None = None) -> None:
    """Delete `path`, a working folder a user may name (the feature cache), only if dflash made it.

    A folder inside `run_dir` is the run's own. Elsewhere, a folder that holds anything and lacks the marker of
    make_owned_dir is someone else's (say capture.cache_dir pointed at a disk's root): ValueError, nothing
    deleted. A missing or empty folder is fine.
    """
    if not os.path.isdir(path):
        return
    inside = run_dir is not None and os.path.commonpath([os.path.abspath(path), os.path.abspath(run_dir)]) == \
        os.path.abspath(run_dir)
    if not inside and os.listdir(path) and not os.path.exists(os.path.join(path, OWNER_MARKER)):
        raise ValueError(f"{path} holds files that dflash did not write (no {OWNER_MARKER}); it would be emptied "
                         "here: name a new or empty folder for it")
    shutil.rmtree(path)


CHECKSUMS = "checksums.json"  # in a folder of weights: the sha256 of each of its files, written before it is complete


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_checksums(folder: str) -> dict[str, str]:
    """sha256 of every file under `folder` (paths relative to it), checksums.json aside."""
    sums = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative != CHECKSUMS:
                sums[relative] = file_sha256(path)
    return dict(sorted(sums.items()))


def write_checksums(folder: str) -> None:
    """`folder`/checksums.json: the sha256 of each file it holds now (written last, before the folder is complete,
    so that a reader can verify it with checksum_problem)."""
    write_text(os.path.join(folder, CHECKSUMS), json.dumps(folder_checksums(folder), indent=1))


def checksum_problem(folder: str) -> str | None:
    """What differs in `folder` from its checksums.json: a listed file missing, or of another sha256 than when it
    was written; None when every listed file matches, or when the folder has no checksums.json (written before
    folders carried one, so it cannot be checked)."""
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.exists(path):
        return None
    try:
        saved = read_json(path)
    except ValueError:
        return f"{CHECKSUMS} is unreadable"
    for name, digest in saved.items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        actual = file_sha256(file)
        if actual != digest:
            return f"{name} differs from when it was saved (sha256 {actual[:12]}..., saved {digest[:12]}...)"
    return None


def shown(path: str) -> str:
    """`path` relative to the working folder when it lies inside it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
