"""Training checkpoints that never lose work: atomic, keep-last-k, with per-rank RNG state.

Layout of the checkpoint folder (shared by all ranks, e.g. a network filesystem on several nodes):
    step{N}/            one DeepSpeed tag: model, optimizer and scheduler shards, client state (global step)
    step{N}/rng_rank{r}.safetensors   the CPU (and CUDA) RNG state of rank r
    step{N}/layout.json the world size and ZeRO stage that wrote the shards
    step{N}/checksums.json  sha256 of every file of the tag, written before `complete`; a resume verifies the tag
                        and falls back to the newest older tag that verifies, naming the corrupt one
    step{N}/complete    written by rank 0 after EVERY rank finished writing step{N} (a barrier in between)
    latest              the newest complete tag, replaced atomically (temp file + os.replace) after `complete`
    latest.pending      the tag a save is making `latest`, written before its `complete` and removed after `latest`:
                        a kill between the two leaves it naming a complete tag, which a resume takes (see
                        pending_tag), so the steps of a whole checkpoint are never trained again
    step{N}_universal/  only when resuming on a different number of ranks: DeepSpeed's layout-free "universal"
                        conversion of step{N}, loaded with `checkpoint.load_universal`; deleted at the next save
    .pruned-step{N}/    a tag being deleted (renamed first, so a kill inside the delete leaves no half-deleted tag)

DeepSpeed's own `latest` is written by rank 0 as soon as rank 0 is done, with a truncating open: a kill at the
wrong moment leaves it empty or naming a tag that another rank had not finished. So DeepSpeed's is switched off and
this one is written only once the tag is whole; a reader also refuses a tag without `complete`. A run killed while
writing step{N} resumes from the previous tag; the half-written folder is deleted before it is written again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from dflash.config.errors import CorruptFile
from dflash.run_files import (atomic_path, checksum_problem, from_rank0, fsync_tree, swap_in_dir, write_checksums,
                              write_text)
from dflash.train.best_checkpoint import read_best
from dflash.train.engine import TrainEngine

logger = logging.getLogger(__name__)

COMPLETE = "complete"
LATEST = "latest"
PENDING = "latest.pending"
LAYOUT = "layout.json"
PRUNED = ".pruned-"
UNIVERSAL = "_universal"
_TAG = re.compile(r"^step(\d+)$")
_UNIVERSAL_TAG = re.compile(r"^step\d+_universal(\.tmp)?$")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def tag_for(step: int) -> str:
    return f"step{step}"


def resume_step_of(directory: str, tag: str | None) -> int:
    """The global step a run resumes at from checkpoint `tag` of `directory` (0 for None)."""
    if tag is None:
        return 0
    match = _TAG.match(tag)
    if match is None:
        raise ValueError(f"checkpoint tag {tag!r} in {directory} does not name a step")
    return int(match.group(1))


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def complete_tags(directory: str) -> list[tuple[int, str]]:
    """(step, tag) of every complete checkpoint in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _TAG.match(name)
        if match and os.path.exists(os.path.join(directory, name, COMPLETE)):
            found.append((int(match.group(1)), name))
    return sorted(found)


def latest_tag(directory: str) -> str | None:
    """The tag named by `latest`, or None when there is no checkpoint; ValueError if it names an incomplete one."""
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        tag = f.read().strip()
    if not os.path.exists(os.path.join(directory, tag, COMPLETE)):
        raise ValueError(f"{path} names checkpoint {tag!r}, which is not complete (no {COMPLETE} marker)")
    return tag


def save_checkpoint(engine: TrainEngine, directory: str, step: int, client_state: dict[str, Any], *, rank: int,
                    keep_last: int) -> None:
    """Write step{step} on every rank, then mark it complete, point `latest` at it and prune old tags (rank 0).

    keep_last: how many complete checkpoints to keep (0 keeps all).
    """
    tag = tag_for(step)
    folder = os.path.join(directory, tag)
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        if os.path.isdir(folder):  # left half-written by a killed run, or a stale copy: never mix shards
            _delete(directory, tag)
    _barrier()
    engine.save(directory, tag, client_state)
    os.makedirs(folder, exist_ok=True)
    rng_path = os.path.join(folder, f"rng_rank{rank}.safetensors")
    with atomic_path(rng_path) as tmp:
        save_file(rng_state(), tmp)
    _barrier()
    # DeepSpeed writes the shards with plain torch.save: flushed here, on every rank (each node's page cache holds
    # its own ranks' writes) and before `complete`, so a complete tag is whole after a power loss too.
    fsync_tree(folder)
    _barrier()
    if rank == 0:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        layout = {"world_size": world_size, "zero_stage": engine.zero_stage}
        if "global_batch_size" in client_state:  # read before a conversion to another rank count (resume_tag)
            layout["global_batch_size"] = client_state["global_batch_size"]
        write_text(os.path.join(folder, LAYOUT), json.dumps(layout))
        write_checksums(folder)  # before `complete`, so every complete tag has them
        pending = os.path.join(directory, PENDING)
        write_text(pending, tag)
        write_text(os.path.join(folder, COMPLETE), f"{step}\n")
        write_text(os.path.join(directory, LATEST), tag)
        os.remove(pending)
        prune_checkpoints(directory, keep_last, tag)
    _barrier()


def prune_checkpoints(directory: str, keep_last: int, current: str) -> None:
    """Delete what the newest complete tag `current` makes obsolete (rank 0, after `latest` names it): complete
    tags beyond the newest `keep_last` (0 keeps all), tags without `complete` (left by a save that was killed; every
    rank has passed the barrier, so none is being written), universal conversions, and what an earlier prune left.

    A folder is renamed to `.pruned-<name>` (atomic) before it is deleted: a kill inside the delete leaves a
    `.pruned-*` folder, which no reader takes for a checkpoint and the next prune deletes, never a half-deleted tag.
    """
    obsolete = [name for name in os.listdir(directory) if _TAG.match(name) and name != current
                and not os.path.exists(os.path.join(directory, name, COMPLETE))]
    if keep_last > 0:
        obsolete += [old for _, old in complete_tags(directory)[:-keep_last] if old != current]
    obsolete += [name for name in os.listdir(directory) if _UNIVERSAL_TAG.match(name)]
    for name in obsolete:
        _set_aside(directory, name)
    for name in os.listdir(directory):
        if name.startswith(PRUNED):
            shutil.rmtree(os.path.join(directory, name))
    with contextlib.suppress(FileNotFoundError):  # written by ds_to_universal beside its output; never read here
        os.remove(os.path.join(directory, "latest_universal"))


def _set_aside(directory: str, name: str) -> str:
    """Rename folder `name` of `directory` to `.pruned-<name>` (atomic; what a kill inside an earlier delete left
    under that name goes first); the new path."""
    aside = os.path.join(directory, PRUNED + name)
    if os.path.isdir(aside):
        shutil.rmtree(aside)
    os.replace(os.path.join(directory, name), aside)
    return aside


def _delete(directory: str, name: str) -> None:
    """Delete folder `name` of `directory`, set aside first (see prune_checkpoints)."""
    shutil.rmtree(_set_aside(directory, name))


def pending_tag(directory: str) -> str | None:
    """The complete tag a save was making `latest` when it was killed (after `complete`, before `latest`), or None.

    `latest.pending` names it; a kill before `complete` leaves it naming an incomplete tag (not taken), one after
    `latest` the tag `latest` names. `latest` written after it (a user rolling a training back by hand) wins.
    """
    path = os.path.join(directory, PENDING)
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
        written = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None
    if not _TAG.match(tag) or not os.path.exists(os.path.join(directory, tag, COMPLETE)):
        return None
    with contextlib.suppress(FileNotFoundError):
        if os.stat(os.path.join(directory, LATEST)).st_mtime_ns > written:
            return None
    return tag


def tag_problem(directory: str, tag: str) -> str | None:
    """What is wrong with complete tag `tag`: a file missing or of another sha256 than when it was saved; None
    when it verifies (or predates checksums.json, so cannot be checked)."""
    return checksum_problem(os.path.join(directory, tag))


def verified_latest_tag(directory: str) -> str | None:
    """The newest complete tag whose files verify, starting from the one `latest` names (or the one a killed save
    was making latest: pending_tag); a corrupt tag is named in a warning and the one before it is tried. `latest`
    naming a tag that is not complete (a kill while that step was saved again after a resume from an older tag), or
    missing beside complete tags, is named in a warning and the complete tags are tried, newest first. CorruptFile
    naming each tag when none verifies; None when there is no complete checkpoint."""
    tags = [t for _, t in reversed(complete_tags(directory))]
    named = pending_tag(directory)
    try:
        if named is None:
            named = latest_tag(directory)
    except ValueError as err:
        named = None
        if tags:
            logger.warning(f"[train] warning: {err}; trying the complete checkpoints, newest first")
    else:
        if named is None and tags:
            logger.warning(f"[train] warning: {os.path.join(directory, LATEST)} is missing; trying the complete "
                           f"checkpoints, newest first")
    candidates = ([named] if named is not None else []) + [t for t in tags if t != named]
    if not candidates:
        return None
    problems = []
    for candidate in candidates:
        problem = tag_problem(directory, candidate)
        if problem is None:
            if problems:
                logger.warning(f"[train] warning: {'; '.join(problems)}; resuming from {candidate} instead")
            return candidate
        problems.append(f"checkpoint {os.path.join(directory, candidate)} is corrupt: {problem}")
    raise CorruptFile(f"no checkpoint in {directory} verifies: {'; '.join(problems)}. Restore its files from a copy, "
                      f"or move {directory} aside to train from the start")


def saved_layout(directory: str, tag: str) -> dict[str, Any]:
    """layout.json of `tag`: world_size, zero_stage and (since it was recorded) global_batch_size; {} for a tag
    from before layouts were recorded."""
    path = os.path.join(directory, tag, LAYOUT)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def saved_world_size(directory: str, tag: str) -> int | None:
    """The number of ranks that wrote `tag` (None for a tag without layout.json, from before it was recorded)."""
    saved = saved_layout(directory, tag).get("world_size")
    return None if saved is None else int(saved)


def batch_mismatch(tag: str, saved: int, now: int, saved_ranks: int | None = None) -> ValueError:
    """The error for a checkpoint counted in another global batch than this run's: its data position would not
    match."""
    where = f" on {saved_ranks} rank(s)" if saved_ranks is not None else ""
    return ValueError(f"checkpoint {tag} was trained{where} with a global batch of {saved} samples, this run has {now} "
                      f"(micro_batch_size x ranks x grad_accum): the data position would not match; resume it with "
                      f"the ranks and settings it was trained with")


def resume_tag(directory: str, world_size: int, rank: int,
               global_batch_size: int | None = None) -> tuple[str | None, bool]:
    """(tag to load or None, whether it is a universal checkpoint) for a run with `world_size` ranks: the newest
    tag that verifies (verified_latest_tag); a resume also verifies the best checkpoint it carries on with.

    Saved by the same number of ranks: the tag itself. Saved by another number: ZeRO shards cannot be loaded as
    they are, so rank 0 converts the tag with DeepSpeed's ds_to_universal (into a temporary folder, renamed when
    whole) and every rank loads the conversion; the engine must then be built with `load_universal`. A tag counted
    in another global batch than `global_batch_size` (when given and recorded) is refused before any conversion.
    """
    # Rank 0 reads `latest` for everyone: on a shared file system another node may still see a directory entry
    # it cached before the folder changed (say, moved aside by claim_checkpoint_dir), and ranks that resumed
    # different steps would train apart without an error.
    def read() -> tuple[str | None, dict[str, Any]]:
        tag = verified_latest_tag(directory)
        if tag is not None:
            read_best(directory, verify=True)  # the best checkpoint it resumes with (CorruptFile on every rank)
        return tag, {} if tag is None else saved_layout(directory, tag)

    tag, layout = from_rank0(read, "the checkpoint folder")
    saved = layout.get("world_size")
    if tag is None or saved in (None, world_size):
        return tag, False
    saved_batch = layout.get("global_batch_size")
    if global_batch_size is not None and saved_batch is not None and saved_batch != global_batch_size:
        raise batch_mismatch(tag, saved_batch, global_batch_size, saved)
    universal = tag + UNIVERSAL
    target = os.path.join(directory, universal)
    if rank == 0 and not os.path.isdir(target):
        tmp = f"{target}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        workers = str(max(1, min(4, os.cpu_count() or 1)))
        done = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
             os.path.join(directory, tag), "--output_folder", tmp, "--num_extract_workers", workers,
             "--num_merge_workers", "1", "--inject_missing_state"],
            capture_output=True, text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"converting checkpoint {os.path.join(directory, tag)} to a universal checkpoint "
                               f"failed:\n{done.stderr[-3000:]}")
        for name in os.listdir(os.path.join(directory, tag)):  # the RNG files travel with it
            if name.startswith("rng_rank"):
                shutil.copy(os.path.join(directory, tag, name), os.path.join(tmp, name))
        swap_in_dir(tmp, target, aside=f"{target}.old")
    _barrier()
    return universal, True


def load_checkpoint(engine: TrainEngine, directory: str, tag: str, *, rank: int) -> dict[str, Any]:
    """Restore tag `tag` (weights, optimizer, scheduler, this rank's RNG) and return its client state.

    A rank without its own RNG file (resuming on more ranks than were saved) keeps its current RNG state: nothing
    in the loop draws from the global RNG, so results do not change.
    """
    client_state = engine.load(directory, tag)
    rng_path = os.path.join(directory, tag, f"rng_rank{rank}.safetensors")
    if os.path.exists(rng_path):
        set_rng_state(load_file(rng_path))
    return client_state
