"""Offline capture: run the frozen target over a token dataset and store the tapped hidden states.

Samples are planned into shards in dataset order (a sample never straddles two shards), and each shard's rows are
captured in forwards of at most `batch_tokens` tokens (shard_rows.py: samples laid end to end with `pack`, else
right-padded batches). Either way the target runs its decoder layers only (no LM head) and stops after the deepest
tap, and the features are copied back to their place in the shard. Every forward is checked (one row per token,
finite values, non-zero variance per tap and sample), and one sample in `check_every` is compared with a plain
single-sequence `output_hidden_states` forward (feature_checks.py), because a capture path can silently produce
wrong or all-zero states (method.md §8). Before any work the disk the run will take is printed, and the run
refuses to start when the folder's file system has less free space. The manifest is rewritten after every shard,
so an interrupted run (even by SIGKILL) resumes at the first missing shard.

Under a multi-process launcher (`rank`, `world_size` > 1) rank r captures the planned shards i with i % W == r and
records each in a sidecar `shard-NNNNN.json` next to it; rank 0 then writes the manifest from the sidecars and
removes them, so the finished store is the one a single process writes. A killed run resumes from the shards
whose sidecars exist, with any number of ranks.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dflash.extract.forward_budget import ForwardBudget
from dflash.extract.fp8 import FP8_DTYPE
from dflash.extract.shard_rows import capture_rows
from dflash.run_files import file_sha256
from dflash.extract.sidecars import (
    read_sidecar, remove_sidecars, shard_intact, sidecar_entries, sidecar_path, write_sidecar,
)
from dflash.extract.store import (
    SCHEMA_VERSION, ShardWriter, read_manifest, shard_name, store_dtype,
)
from dflash.data.sample_sizes import sample_lengths
from dflash.models.targets.base import TargetAdapter
from dflash.console import EVERY_RANK

logger = logging.getLogger(__name__)

# safetensors header and alignment of one shard, counted generously.
_SHARD_OVERHEAD_BYTES = 1 << 16


def _normalised(value: Any) -> Any:
    """JSON round trip, so tuples and lists (or int keys and str keys) compare the way they are stored."""
    return json.loads(json.dumps(value))


def plan_shards(lengths: np.ndarray, start: int, shard_tokens: int) -> list[tuple[int, int]]:
    """[(first_sample, end_sample)] from `start` on: each shard closes once it holds >= shard_tokens tokens."""
    plan, first, tokens = [], start, 0
    for i in range(start, len(lengths)):
        tokens += int(lengths[i])
        if tokens >= shard_tokens:
            plan.append((first, i + 1))
            first, tokens = i + 1, 0
    if first < len(lengths):
        plan.append((first, len(lengths)))
    return plan


def bytes_per_token(width: int, num_taps: int, dtype: torch.dtype) -> int:
    """Stored bytes of one token: features (plus fp8 scales), an int32 id and a uint8 loss-mask entry."""
    features = width * torch.empty(0, dtype=dtype).element_size()
    scales = 4 * num_taps if dtype == FP8_DTYPE else 0
    return features + scales + 4 + 1


def check_disk(out_dir: Path, store_bytes: int | None, other_bytes: int = 0) -> None:
    """Print the bytes a capture will write into `out_dir`: `store_bytes` of feature-store shards (None: no store,
    features are made during training) and `other_bytes` of the stage's other files (the frozen head, held-out
    passes); raise OSError when its file system has less free."""
    free = shutil.disk_usage(out_dir).free
    parts = [] if store_bytes is None else [f"{_gib(store_bytes)} of feature shards"]
    if other_bytes or store_bytes is None:
        parts.append(f"{_gib(other_bytes)} for the stage's other files (frozen head, held-out passes)")
    what, needed = " and ".join(parts), (store_bytes or 0) + other_bytes
    logger.info(f"[capture] will write {what} in {out_dir} ({_gib(free)} free)")
    if needed > free:
        advice = "free space or point the run at a larger disk"
        if store_bytes:
            advice = "free space, point the run at a larger disk, use capture.dtype=fp8, or use online capture"
        raise OSError(f"not enough disk in {out_dir}: it needs {needed} bytes ({_gib(needed)}): {what}; only {free} "
                      f"bytes ({_gib(free)}) are free; {advice}")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _check_resumable(manifest: dict[str, Any], expected: dict[str, Any], out_dir: Path) -> None:
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise ValueError(
                f"feature store {out_dir} was captured with {key}={manifest.get(key)!r}, this run asks for "
                f"{value!r}: use a new output folder or delete {out_dir}"
            )


def _repair_shards(
    adapter: TargetAdapter, dataset: Any, out_dir: Path, manifest: dict[str, Any], layer_ids: list[int],
    budget: ForwardBudget, dtype: torch.dtype, check_every: int, pack: bool, verify: bool = True,
) -> None:
    """Recapture (same samples, same name) each shard listed in the manifest that is missing or, with `verify`,
    whose sha256 differs from the manifest's."""
    writer, table = ShardWriter(out_dir), dataset.with_format("arrow")
    for index, entry in enumerate(manifest["shards"]):
        path = out_dir / entry["file"]
        if path.is_file() and not verify:
            continue
        actual = file_sha256(path) if path.is_file() else None
        if actual == entry["sha256"]:
            continue
        first, end = entry["first_sample"], entry["first_sample"] + entry["num_samples"]
        problem = "missing" if actual is None else f"corrupt (sha256 {actual}, manifest {entry['sha256']})"
        logger.info(f"[capture] feature shard {path} is {problem}: recapturing samples {first}..{end - 1}",
                    extra=EVERY_RANK)
        arrays = capture_rows(adapter, table[first:end], first, layer_ids, budget, dtype, check_every,
                                tqdm(disable=True), pack)
        manifest["shards"][index] = writer.write_shard(index, first_sample=first, **arrays)
        writer.write_manifest(manifest)


def _new_manifest(expected: dict[str, Any], adapter: TargetAdapter, num_samples: int) -> dict[str, Any]:
    return {
        **expected,
        "model_type": adapter.model_type,
        "num_target_layers": adapter.num_layers,
        "complete": False,
        "expected_num_samples": num_samples,
        "num_samples": 0,
        "num_tokens": 0,
        "shards": [],
    }


def missing_shards(out_dir: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's entries whose shard file is not there."""
    return [entry for entry in manifest["shards"] if not (out_dir / entry["file"]).is_file()]


def corrupt_shards(out_dir: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's entries whose shard is missing or whose sha256 differs (reads every shard)."""
    return [entry for entry in manifest["shards"] if not (out_dir / entry["file"]).is_file()
            or file_sha256(out_dir / entry["file"]) != entry["sha256"]]


def _needed_bytes(lengths: np.ndarray, work: list[tuple[int, int, int]], width: int, num_taps: int,
                  dtype: torch.dtype) -> int:
    """Disk bytes of the shards `work` [(index, first, end)]: their tokens, offsets and headers."""
    tokens = sum(int(lengths[first:end].sum()) for _, first, end in work)
    samples = sum(end - first for _, first, end in work)
    return tokens * bytes_per_token(width, num_taps, dtype) + (samples + len(work)) * 8 + \
        len(work) * _SHARD_OVERHEAD_BYTES


def _append_finished(manifest: dict[str, Any], finished: dict[int, dict[str, Any]], num_samples: int) -> bool:
    """Move the entries of `finished` (by shard index) that continue the manifest's shard list into it; True when
    any moved."""
    moved = False
    while len(manifest["shards"]) in finished:
        entry = finished.pop(len(manifest["shards"]))
        manifest["shards"].append(entry)
        manifest["num_samples"] += entry["num_samples"]
        manifest["num_tokens"] += entry["num_tokens"]
        moved = True
    manifest["complete"] = manifest["num_samples"] == num_samples
    return moved


def _capture_shards(
    adapter: TargetAdapter, table: Any, work: list[tuple[int, int, int]], writer: ShardWriter,
    on_written: Callable[[int, dict[str, Any]], None], layer_ids: list[int], budget: ForwardBudget,
    dtype: torch.dtype, check_every: int, progress: tqdm, pack: bool,
) -> None:
    """Capture and write the shards `work` [(index, first, end)] in order; `on_written(index, entry)` runs for
    each shard once it is on disk, in the same order."""
    # Shard k is written (and hashed) by a background thread while shard k+1 is captured; at most one write is
    # pending, so two shards' features are in host memory at once.
    pending: tuple[int, Future] | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        try:
            for index, first, end in work:
                arrays = capture_rows(
                    adapter, table[first:end], first, layer_ids, budget, dtype, check_every, progress, pack
                )
                if pending is not None:
                    (written, write), pending = pending, None
                    on_written(written, write.result())
                pending = (index, pool.submit(writer.write_shard, index, first_sample=first, **arrays))
            if pending is not None:
                (written, write), pending = pending, None
                on_written(written, write.result())
        finally:
            # Interrupted while a shard was being written: keep it if the write itself succeeded.
            if pending is not None and pending[1].exception() is None:
                on_written(pending[0], pending[1].result())


def capture_dataset(
    adapter: TargetAdapter,
    dataset: Any,
    out_dir: str | Path,
    layer_ids: list[int],
    *,
    batch_tokens: int,
    shard_tokens: int,
    dtype: str,
    check_every: int,
    pack: bool,
    fingerprint: dict,
    verify_existing: bool = False,
    show_progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    other_bytes: int = 0,
) -> dict[str, Any]:
    """Capture the features of `layer_ids` for every row of `dataset` (columns id, input_ids, loss_mask) into
    the store folder `out_dir`; returns the manifest.

    Resumable at shard granularity: shards already listed in a partial manifest are kept. A complete store with
    the same fingerprint returns at once; a different fingerprint (or taps, dtype, hidden size) raises ValueError.
    Samples whose index is a multiple of `check_every` (0: none) are compared with a plain forward. Raises
    OSError before any work when the remaining shards and the `other_bytes` the caller writes there after them
    will not fit on the folder's disk. With `verify_existing`, the shards already listed (complete store included)
    are hashed first and any missing or corrupt one is reported by name and recaptured. With `pack`, samples are
    laid end to end (TargetAdapter.capture_packed) instead of padded into batches; the store is the same up to the
    kernels' rounding.

    With `world_size` > 1, every rank of an initialised torch.distributed group calls this with its `rank` and
    the same arguments; `out_dir` must be one folder that every rank sees (a shared file system across nodes).
    Rank r captures the shards i with i % world_size == r; the store written is the one world_size=1 writes.
    """
    out_dir = Path(out_dir)
    layer_ids = adapter.check_layer_ids(layer_ids)
    torch_dtype = store_dtype(dtype)
    _check_arguments(dataset, check_every, batch_tokens, shard_tokens, rank, world_size)
    expected = {
        "schema_version": SCHEMA_VERSION,
        "target_layer_ids": layer_ids,
        "hidden_size": adapter.hidden_size,
        "dtype": dtype,
        "fingerprint": _normalised(fingerprint),
    }
    manifest = _existing_manifest(out_dir, expected, len(dataset))
    fresh = _new_manifest(expected, adapter, len(dataset))
    if world_size > 1:
        return _capture_ranks(
            adapter, dataset, out_dir, manifest, fresh, layer_ids, budget=ForwardBudget(batch_tokens),
            shard_tokens=shard_tokens, dtype=torch_dtype, check_every=check_every, verify_existing=verify_existing,
            show_progress=show_progress, rank=rank, world_size=world_size, pack=pack, other_bytes=other_bytes,
        )
    return _capture_alone(
        adapter, dataset, out_dir, manifest, fresh, layer_ids, budget=ForwardBudget(batch_tokens),
        shard_tokens=shard_tokens, dtype=torch_dtype, check_every=check_every, verify_existing=verify_existing,
        show_progress=show_progress, pack=pack, other_bytes=other_bytes,
    )


def _check_arguments(dataset: Any, check_every: int, batch_tokens: int, shard_tokens: int, rank: int,
                     world_size: int) -> None:
    if check_every < 0:
        raise ValueError(f"check_every must be >= 0 (0 disables the re-forward check), got {check_every}")
    if batch_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"batch_tokens ({batch_tokens}) and shard_tokens ({shard_tokens}) must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks (0..{world_size - 1})")
    if world_size > 1 and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size):
        raise ValueError(f"world_size={world_size} needs an initialised torch.distributed process group of that size "
                         "(launch with torchrun or deepspeed and call dflash.train.engine.init_distributed first)")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: nothing to capture")
    for column in ("id", "input_ids", "loss_mask"):
        if column not in dataset.column_names:
            raise ValueError(f"dataset has no {column!r} column (columns: {dataset.column_names})")


def _existing_manifest(out_dir: Path, expected: dict[str, Any], num_samples: int) -> dict[str, Any] | None:
    """The manifest of the store in out_dir (None when there is none); ValueError when it is not this capture's."""
    manifest = read_manifest(out_dir)
    if manifest is not None:
        _check_resumable(manifest, expected, out_dir)
        if manifest.get("expected_num_samples") != num_samples:
            raise ValueError(
                f"feature store {out_dir} was captured from a dataset of {manifest.get('expected_num_samples')} "
                f"samples, this one has {num_samples}: use a new output folder or delete {out_dir}"
            )
    return manifest


def _clean_leftovers(writer: ShardWriter, out_dir: Path, fresh: bool) -> None:
    """Remove the temp files of interrupted writers and, for a new store, the sidecars an older one left."""
    for path in writer.remove_stale_temps():
        logger.info(f"[capture] removed {path.name}, left by an interrupted writer")
    if fresh:
        remove_sidecars(out_dir)  # left by an older store in this folder: not this run's shards


def _save_manifest(writer: ShardWriter, manifest: dict[str, Any], out_dir: Path) -> None:
    """Write the manifest; once it is complete it lists every shard, so the sidecars go."""
    writer.write_manifest(manifest)
    if manifest["complete"]:
        remove_sidecars(out_dir)


def _capture_alone(
    adapter: TargetAdapter, dataset: Any, out_dir: Path, manifest: dict[str, Any] | None, fresh: dict[str, Any],
    layer_ids: list[int], *, budget: ForwardBudget, shard_tokens: int, dtype: torch.dtype, check_every: int,
    verify_existing: bool, show_progress: bool, pack: bool, other_bytes: int,
) -> dict[str, Any]:
    """capture_dataset in one process: `manifest` is the store's (None if new), `fresh` a new one.

    Keeps the shards the manifest lists (hashed first with `verify_existing`, missing or corrupt ones recaptured)
    and those a multi-process run of this store finished (sidecars), then captures the rest in order, writing the
    manifest after every shard.
    """
    if manifest is not None:  # listed shards that are missing (with verify_existing: or corrupt) are recaptured
        _repair_shards(adapter, dataset, out_dir, manifest, layer_ids, budget, dtype, check_every, pack,
                       verify=verify_existing)
        if manifest["complete"]:
            if other_bytes:  # the stage's other files may be what did not fit the last time
                check_disk(out_dir, 0, other_bytes)
            return manifest
    writer = ShardWriter(out_dir)
    _clean_leftovers(writer, out_dir, fresh=manifest is None)
    if manifest is None:
        manifest = fresh
    lengths = sample_lengths(dataset)
    done = int(manifest["num_samples"])
    plan = list(enumerate(plan_shards(lengths, done, shard_tokens), start=len(manifest["shards"])))
    # Shards that a multi-process run of this store finished (each with a sidecar) are kept.
    finished = sidecar_entries(out_dir, plan, verify_existing)
    work = [(index, first, end) for index, (first, end) in plan if index not in finished]
    check_disk(out_dir, _needed_bytes(lengths, work, len(layer_ids) * adapter.hidden_size, len(layer_ids), dtype),
               other_bytes)
    progress = tqdm(
        total=int(lengths.sum()), initial=int(lengths[:done].sum()) + sum(e["num_tokens"] for e in finished.values()),
        unit="tok", desc="capture", disable=not show_progress,
    )

    def record(index: int, entry: dict[str, Any]) -> None:
        finished[index] = entry
        _append_finished(manifest, finished, len(dataset))
        _save_manifest(writer, manifest, out_dir)

    if _append_finished(manifest, finished, len(dataset)):
        _save_manifest(writer, manifest, out_dir)
    try:
        _capture_shards(adapter, dataset.with_format("arrow"), work, writer, record, layer_ids, budget, dtype,
                        check_every, progress, pack)
    finally:
        progress.close()
    return manifest


def _capture_ranks(
    adapter: TargetAdapter, dataset: Any, out_dir: Path, manifest: dict[str, Any] | None, fresh: dict[str, Any],
    layer_ids: list[int], *, budget: ForwardBudget, shard_tokens: int, dtype: torch.dtype, check_every: int,
    verify_existing: bool, show_progress: bool, rank: int, world_size: int, pack: bool, other_bytes: int,
) -> dict[str, Any]:
    """capture_dataset on one of several ranks: `manifest` is the store's (None if new), `fresh` a new one.

    Every rank plans the same shards: those the manifest lists, then the rest from its last sample on. Rank r
    keeps its shards (i % world_size == r) that are listed or have a sidecar and are intact (hashed with
    `verify_existing`), captures the others and writes a sidecar after each. Rank 0 then writes the manifest of
    every shard, in order, and removes the sidecars.
    """
    if manifest is not None and not verify_existing and manifest["complete"] and \
            not missing_shards(out_dir, manifest):
        if other_bytes:  # rank 0's other files may be what did not fit the last time
            check_disk(out_dir, 0, other_bytes)
        return manifest  # else the ranks recapture the missing (or, verifying, corrupt) shards below
    dist.barrier()  # every rank has read the old manifest before rank 0 writes one
    writer = ShardWriter(out_dir)
    lengths = sample_lengths(dataset)
    listed = manifest["shards"] if manifest is not None else []
    plan = [(entry["first_sample"], entry["first_sample"] + entry["num_samples"]) for entry in listed]
    plan += plan_shards(lengths, int(manifest["num_samples"]) if manifest is not None else 0, shard_tokens)
    if rank == 0:
        _clean_leftovers(writer, out_dir, fresh=manifest is None)
        if manifest is None:
            writer.write_manifest(fresh)  # records the fingerprint, so a rerun with other settings is refused
        unfinished = [(index, first, end) for index, (first, end) in enumerate(plan)
                      if index >= len(listed) and not sidecar_path(out_dir, index).is_file()]
        check_disk(out_dir, _needed_bytes(lengths, unfinished, len(layer_ids) * adapter.hidden_size,
                                          len(layer_ids), dtype), other_bytes)
    dist.barrier()  # stale temps and sidecars are gone before any rank looks for its finished shards
    work = _rank_work(out_dir, plan, listed, rank, world_size, verify_existing)
    logger.info(f"[capture] rank {rank} of {world_size}: {len(work)} of {len(plan)} shards to capture",
                extra=EVERY_RANK)
    progress = tqdm(total=sum(int(lengths[first:end].sum()) for _, first, end in work), unit="tok",
                    desc=f"capture (rank 0 of {world_size})", disable=not show_progress or rank != 0)
    try:
        _capture_shards(adapter, dataset.with_format("arrow"), work, writer,
                        lambda index, entry: write_sidecar(out_dir, index, entry), layer_ids, budget, dtype,
                        check_every, progress, pack)
    finally:
        progress.close()
    dist.barrier()  # every rank's shards and sidecars are on disk
    if rank == 0:
        header = manifest if manifest is not None else fresh
        _write_gathered_manifest(writer, out_dir, header, plan, listed, len(dataset), world_size)
    dist.barrier()  # the manifest is in place before any rank reads it
    return read_manifest(out_dir)


def _rank_work(out_dir: Path, plan: list[tuple[int, int]], listed: list[dict[str, Any]], rank: int, world_size: int,
               verify: bool) -> list[tuple[int, int, int]]:
    """[(index, first, end)] of this rank's planned shards that neither a sidecar nor the manifest shows intact."""
    work = []
    for index, (first, end) in enumerate(plan):
        if index % world_size != rank:
            continue
        entry = read_sidecar(out_dir, index, first, end, verify)
        if entry is None and index < len(listed) and shard_intact(out_dir, listed[index], verify):
            entry = listed[index]
        if entry is None:
            work.append((index, first, end))
    return work


def _write_gathered_manifest(writer: ShardWriter, out_dir: Path, header: dict[str, Any], plan: list[tuple[int, int]],
                             listed: list[dict[str, Any]], num_samples: int, world_size: int) -> None:
    """Rank 0, once every rank is done: the manifest of every planned shard (from its sidecar, else the old
    manifest's entry), in order; then the sidecars go. RuntimeError naming a shard that no rank wrote."""
    entries = []
    for index, (first, end) in enumerate(plan):
        entry = read_sidecar(out_dir, index, first, end, verify=False)
        if entry is None and index < len(listed):
            entry = listed[index]
        if entry is None or not (out_dir / entry["file"]).is_file():
            raise RuntimeError(f"feature shard {out_dir / shard_name(index)} (samples {first}..{end - 1}) was "
                               f"not written by rank {index % world_size}")
        entries.append(entry)
    header["shards"] = entries
    header["num_samples"] = sum(entry["num_samples"] for entry in entries)
    header["num_tokens"] = sum(entry["num_tokens"] for entry in entries)
    header["complete"] = header["num_samples"] == num_samples
    writer.write_manifest(header)
    remove_sidecars(out_dir)
