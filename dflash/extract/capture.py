"""Offline capture: run the frozen target over a token dataset and store the tapped hidden states.

Samples are planned into shards in dataset order (a sample never straddles two shards). Inside a shard, with
`pack` (capture.pack), consecutive samples are laid end to end in runs of at most `batch_tokens`
tokens, each run one `TargetAdapter.capture_packed` forward with no padding at all; otherwise samples are sorted by
length and grouped into right-padded batches of at most `batch_tokens` padded tokens for `TargetAdapter.capture`.
Either way the target runs its decoder layers only (no LM head) and stops after the deepest tap, and the features
are copied back to their place in the shard. Every batch is checked (one row per token, finite values,
non-zero variance per tap and sample), and one sample in `check_every` is compared with a plain single-sequence
`output_hidden_states` forward, because capture paths have silently produced wrong or all-zero states before
(notes section 8). Before any work the disk the run will take is printed, and the run refuses to start when the
folder's file system has less free space. The manifest is rewritten after every shard, so an interrupted run
(even by SIGKILL) resumes at the first missing shard.

Under a multi-process launcher (`rank`, `world_size` > 1) rank r captures the planned shards i with i % W == r and
records each in a sidecar `shard-NNNNN.json` next to it; rank 0 then writes the manifest from the sidecars and
removes them, so the finished store is the one a single process writes. A killed run resumes from the shards
whose sidecars exist, with any number of ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dflash.extract.fp8 import FP8_DTYPE, quantize_fp8
from dflash.host_copy import host_to_device
from dflash.extract.store import (
    SCHEMA_VERSION, ShardWriter, file_sha256, read_manifest, shard_name, store_dtype,
)
from dflash.data.sample_sizes import sample_lengths
from dflash.models.targets.base import TargetAdapter

# Relative L2 error allowed between captured features and a plain forward of the same sample: batching and
# padding change the kernels' summation order (large in bfloat16), a wrong tap or zero states give ~1.
CROSSCHECK_RTOL = 0.05
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


def check_disk(out_dir: Path, needed: int) -> None:
    """Print the bytes a capture will write into `out_dir`; raise OSError when its file system has less free."""
    free = shutil.disk_usage(out_dir).free
    print(f"[capture] the feature store will take {needed / 2**30:.2f} GiB more in {out_dir} "
          f"({free / 2**30:.2f} GiB free)")
    if needed > free:
        raise OSError(
            f"not enough disk for the feature store in {out_dir}: it needs {needed} bytes "
            f"({needed / 2**30:.2f} GiB), only {free} bytes ({free / 2**30:.2f} GiB) are free; free space, "
            "point the run at a larger disk, use capture.dtype=fp8, or use online capture"
        )


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices by length (longest first) so that batch size x longest length <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
    batches: list[list[int]] = []
    for j in order:
        # Sorted by decreasing length: a batch's first index is its longest sample.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def check_features(features: torch.Tensor, lengths: list[int], ids: list[str], layer_ids: list[int]) -> None:
    """Raise ValueError naming the sample and tap on a shape mismatch, a non-finite value or zero variance."""
    raise_on_bad_features(feature_flags(features, lengths, layer_ids).cpu(), ids, layer_ids)


def feature_flags(features: torch.Tensor, lengths: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[b, taps, 2] float on the features' device: (all finite, variance) of each sample's real rows per tap.

    Nothing here waits for the device: the caller decides when to look (raise_on_bad_features), so a colocated
    trainer can launch its step before the target's forward has finished. The shape is checked at once.
    """
    b, t, width = features.shape
    if b != len(lengths) or t < max(lengths) or width % len(layer_ids):
        raise ValueError(
            f"captured features have shape {tuple(features.shape)} for {len(lengths)} samples of up to "
            f"{max(lengths)} tokens and {len(layer_ids)} taps (one row per token expected)"
        )
    sizes = host_to_device(torch.tensor(lengths), features.device)
    sample = torch.arange(b, device=features.device).repeat_interleave(t)
    real = (torch.arange(t, device=features.device)[None, :] < sizes[:, None]).flatten()
    return _sample_flags(features.reshape(b * t, width), sample, real, sizes, len(layer_ids))


def packed_feature_flags(features: torch.Tensor, lengths: list[int], layer_ids: list[int]) -> torch.Tensor:
    """feature_flags of a packed row: `features` [T, K*H] holds samples of `lengths` end to end; returns
    [samples, taps, 2] (all finite, variance) on the features' device, without waiting for it."""
    t, width = features.shape
    if t != sum(lengths) or width % len(layer_ids):
        raise ValueError(
            f"captured features have shape {tuple(features.shape)} for {len(lengths)} packed samples of "
            f"{sum(lengths)} tokens and {len(layer_ids)} taps (one row per token expected)"
        )
    sizes = host_to_device(torch.tensor(lengths), features.device)
    # Sample index of every token; output_size spares a device-to-host read of the total.
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=features.device), sizes, output_size=t)
    return _sample_flags(features, sample, None, sizes, len(layer_ids))


def _sample_flags(rows: torch.Tensor, sample: torch.Tensor, real: torch.Tensor | None, sizes: torch.Tensor,
                  num_taps: int) -> torch.Tensor:
    """[samples, taps, 2]: (all finite, variance) per sample and tap of `rows` [N, K*H], where row i belongs to
    sample `sample[i]` and counts only where `real[i]` (None: every row); `sizes` [samples] counts the real rows."""
    hidden = rows.shape[1] // num_taps
    count = sizes.float() * hidden

    def per_sample(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(sizes), device=rows.device).index_add_(0, sample, values)

    finite, var = [], []
    for k in range(num_taps):
        # One tap at a time keeps the float32 temporaries at 1/K of the rows.
        x = rows[:, k * hidden:(k + 1) * hidden].float()
        bad = (~torch.isfinite(x)).any(dim=1)
        if real is not None:  # padding: neither checked nor counted
            bad &= real
            x = torch.where(real[:, None], x, 0.0)
        finite.append(per_sample(bad.float()) == 0)
        mean = per_sample(x.sum(dim=1)) / count
        spread = (x - mean[sample, None]).pow(2).sum(dim=1)
        var.append(per_sample(spread if real is None else torch.where(real, spread, 0.0)) / count)
    return torch.stack([torch.stack(finite, dim=1).float(), torch.stack(var, dim=1)], dim=2)


def raise_on_bad_features(flags: torch.Tensor, ids: list[str], layer_ids: list[int]) -> None:
    """ValueError naming the first sample and tap whose flags (feature_flags, on the CPU) show a problem."""
    # One test for the whole batch (per-element indexing would be ~5 operators per sample, tap and flag); the
    # first bad flag in (sample, tap, flag) order is the one named. `not > 0` also catches NaN.
    bad = ~(flags > 0)
    if not bool(bad.any()):
        return
    first = int(bad.flatten().nonzero()[0])
    row, rest = divmod(first, flags.shape[1] * flags.shape[2])
    k, which = divmod(rest, flags.shape[2])
    if which == 0:
        raise ValueError(f"sample {ids[row]!r}: tap {layer_ids[k]} has non-finite hidden states")
    raise ValueError(f"sample {ids[row]!r}: tap {layer_ids[k]} has zero variance (all-constant states)")


def crosscheck_sample(
    adapter: TargetAdapter, input_ids: list[int], features: torch.Tensor, layer_ids: list[int], sample_id: str
) -> None:
    """Compare one sample's captured features [T, K*H] with HF `output_hidden_states[L+1]` of a plain forward.

    Taps on the last layer are skipped: HF's last hidden state is taken after the final norm.
    """
    hidden = adapter.hidden_size
    ids = torch.tensor([input_ids], device=adapter.device)
    with torch.no_grad():
        states = adapter.text_model()(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    for k, layer_id in enumerate(layer_ids):
        if layer_id >= adapter.num_layers - 1:
            continue
        ref = states[layer_id + 1][0].float()
        got = features[:, k * hidden:(k + 1) * hidden].to(ref.device).float()
        error = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        if not error <= CROSSCHECK_RTOL:
            raise ValueError(
                f"sample {sample_id!r}: tap {layer_id} differs from output_hidden_states[{layer_id + 1}] of a plain "
                f"forward (relative error {error:.3g} > {CROSSCHECK_RTOL}): the capture hooks are wrong"
            )


def _check_resumable(manifest: dict[str, Any], expected: dict[str, Any], out_dir: Path) -> None:
    for key, value in expected.items():
        if manifest.get(key) != value:
            raise ValueError(
                f"feature store {out_dir} was captured with {key}={manifest.get(key)!r}, this run asks for "
                f"{value!r}: use a new output folder or delete {out_dir}"
            )


def capture_rows(
    adapter: TargetAdapter,
    rows: Any,
    first_sample: int,
    layer_ids: list[int],
    batch_tokens: int,
    dtype: torch.dtype,
    check_every: int,
    progress: tqdm,
    pack: bool = False,
) -> dict[str, torch.Tensor]:
    """Capture one shard's rows (an Arrow table slice) -> ShardWriter.write_shard's tensors (hidden, input_ids,
    loss_mask, offsets, and scales for fp8). Sample `first_sample + j` is crosschecked when divisible by
    `check_every` (0: never). pack: samples laid end to end (capture_packed) instead of padded batches."""
    sample_ids = [str(i) for i in rows["id"].to_pylist()]
    lengths = pc.list_value_length(rows["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64)
    mask_lengths = pc.list_value_length(rows["loss_mask"]).to_numpy(zero_copy_only=False).astype(np.int64)
    for j in range(len(sample_ids)):
        if lengths[j] != mask_lengths[j]:
            raise ValueError(
                f"sample {sample_ids[j]!r}: {lengths[j]} input_ids but {mask_lengths[j]} loss_mask entries"
            )
        if lengths[j] == 0:
            raise ValueError(f"sample {sample_ids[j]!r} has no tokens")
    flat_ids = torch.from_numpy(pc.list_flatten(rows["input_ids"]).to_numpy(zero_copy_only=False).astype(np.int64))
    flat_mask = torch.from_numpy(pc.list_flatten(rows["loss_mask"]).to_numpy(zero_copy_only=False).astype(np.uint8))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(np.cumsum(lengths))
    num_tokens = int(offsets[-1])
    hidden = torch.empty(num_tokens, len(layer_ids) * adapter.hidden_size, dtype=dtype)
    scales = torch.empty(num_tokens, len(layer_ids), dtype=torch.float32) if dtype == FP8_DTYPE else None
    if pack:
        _capture_packed_rows(adapter, flat_ids, lengths, offsets, sample_ids, first_sample, layer_ids,
                             batch_tokens, check_every, progress, hidden, scales)
        return _shard_arrays(hidden, flat_ids, flat_mask, offsets, scales)
    pad_id = adapter.tokenizer.pad_token_id

    for batch in length_batches(lengths.tolist(), batch_tokens):
        batch_lengths = [int(lengths[j]) for j in batch]
        width = max(batch_lengths)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, j in enumerate(batch):
            input_ids[row, :lengths[j]] = flat_ids[offsets[j]:offsets[j + 1]]
            attention_mask[row, :lengths[j]] = 1
        features = adapter.capture(input_ids.to(adapter.device), attention_mask.to(adapter.device), layer_ids)
        check_features(features, batch_lengths, [sample_ids[j] for j in batch], layer_ids)
        for row, j in enumerate(batch):
            # Compared before the cast to the stored dtype: the check is about the capture path, not rounding.
            if check_every and (first_sample + j) % check_every == 0:
                crosscheck_sample(
                    adapter, flat_ids[offsets[j]:offsets[j + 1]].tolist(), features[row, :lengths[j]],
                    layer_ids, sample_ids[j],
                )
        if scales is not None:
            q, batch_scales = quantize_fp8(features.flatten(0, 1), len(layer_ids))
            features = q.view(features.shape).cpu()
            batch_scales = batch_scales.view(*features.shape[:2], -1).cpu()
            for row, j in enumerate(batch):
                scales[offsets[j]:offsets[j + 1]] = batch_scales[row, :lengths[j]]
        else:
            features = features.to(dtype).cpu()
        for row, j in enumerate(batch):
            hidden[offsets[j]:offsets[j + 1]] = features[row, :lengths[j]]
        progress.update(sum(batch_lengths))
    return _shard_arrays(hidden, flat_ids, flat_mask, offsets, scales)


def _shard_arrays(hidden: torch.Tensor, flat_ids: torch.Tensor, flat_mask: torch.Tensor, offsets: torch.Tensor,
                  scales: torch.Tensor | None) -> dict[str, torch.Tensor]:
    arrays = {"hidden": hidden, "input_ids": flat_ids, "loss_mask": flat_mask, "offsets": offsets}
    if scales is not None:
        arrays["scales"] = scales
    return arrays


def packed_runs(lengths: np.ndarray, batch_tokens: int) -> list[tuple[int, int]]:
    """[(first, end)]: consecutive samples laid end to end, at most `batch_tokens` tokens per run (a longer sample
    runs alone). Dataset order is kept, so a run's features land in one contiguous slice of the shard."""
    runs, first, tokens = [], 0, 0
    for j, length in enumerate(lengths.tolist()):
        if j > first and tokens + length > batch_tokens:
            runs.append((first, j))
            first, tokens = j, 0
        tokens += length
    if first < len(lengths):
        runs.append((first, len(lengths)))
    return runs


def _capture_packed_rows(
    adapter: TargetAdapter, flat_ids: torch.Tensor, lengths: np.ndarray, offsets: torch.Tensor,
    sample_ids: list[str], first_sample: int, layer_ids: list[int], batch_tokens: int, check_every: int,
    progress: tqdm, hidden: torch.Tensor, scales: torch.Tensor | None,
) -> None:
    """capture_rows' packed path: each run of samples goes through TargetAdapter.capture_packed (no padding at
    all) and its features fill hidden[start:stop] directly."""
    for first, end in packed_runs(lengths, batch_tokens):
        start, stop = int(offsets[first]), int(offsets[end])
        run_lengths = lengths[first:end].tolist()
        features = adapter.capture_packed(host_to_device(flat_ids[start:stop], adapter.device), run_lengths,
                                          layer_ids)
        flags = packed_feature_flags(features, run_lengths, layer_ids)
        raise_on_bad_features(flags.cpu(), sample_ids[first:end], layer_ids)
        for j in range(first, end):
            if check_every and (first_sample + j) % check_every == 0:
                crosscheck_sample(adapter, flat_ids[offsets[j]:offsets[j + 1]].tolist(),
                                  features[int(offsets[j]) - start:int(offsets[j + 1]) - start], layer_ids,
                                  sample_ids[j])
        if scales is not None:
            q, run_scales = quantize_fp8(features, len(layer_ids))
            hidden[start:stop] = q.cpu()
            scales[start:stop] = run_scales.cpu()
        else:
            hidden[start:stop] = features.to(hidden.dtype).cpu()
        progress.update(stop - start)


def _repair_shards(
    adapter: TargetAdapter, dataset: Any, out_dir: Path, manifest: dict[str, Any], layer_ids: list[int],
    batch_tokens: int, dtype: torch.dtype, check_every: int, pack: bool,
) -> None:
    """Hash every shard listed in the manifest; recapture (same samples, same name) each missing or corrupt one."""
    writer, table = ShardWriter(out_dir), dataset.with_format("arrow")
    for index, entry in enumerate(manifest["shards"]):
        path = out_dir / entry["file"]
        actual = file_sha256(path) if path.is_file() else None
        if actual == entry["sha256"]:
            continue
        first, end = entry["first_sample"], entry["first_sample"] + entry["num_samples"]
        problem = "missing" if actual is None else f"corrupt (sha256 {actual}, manifest {entry['sha256']})"
        print(f"[capture] feature shard {path} is {problem}: recapturing samples {first}..{end - 1}")
        arrays = capture_rows(adapter, table[first:end], first, layer_ids, batch_tokens, dtype, check_every,
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


def _check_listed_shards(out_dir: Path, manifest: dict[str, Any]) -> None:
    for entry in manifest["shards"]:
        if not (out_dir / entry["file"]).is_file():
            raise FileNotFoundError(
                f"feature shard {out_dir / entry['file']} listed in the manifest is missing: rerun with "
                f"verify_existing=True (capture.verify_existing=true) to recapture it, or delete {out_dir}"
            )


def _needed_bytes(lengths: np.ndarray, work: list[tuple[int, int, int]], width: int, num_taps: int,
                  dtype: torch.dtype) -> int:
    """Disk bytes of the shards `work` [(index, first, end)]: their tokens, offsets and headers."""
    tokens = sum(int(lengths[first:end].sum()) for _, first, end in work)
    samples = sum(end - first for _, first, end in work)
    return tokens * bytes_per_token(width, num_taps, dtype) + (samples + len(work)) * 8 + \
        len(work) * _SHARD_OVERHEAD_BYTES


# Sidecars: shard entries of a multi-process capture, until rank 0 lists them in the manifest -------------------

def _sidecar(out_dir: Path, index: int) -> Path:
    return out_dir / shard_name(index).replace(".safetensors", ".json")


def write_sidecar(out_dir: Path, index: int, entry: dict[str, Any]) -> None:
    """Record shard `index`'s manifest entry next to it (atomically), once the shard itself is in place."""
    path = _sidecar(out_dir, index)
    # ShardWriter's temp-name pattern, so a killed writer's leftover is removed at the next start.
    tmp = out_dir / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(entry, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_sidecars(out_dir: Path) -> None:
    for path in sorted(out_dir.glob("shard-*.json")):
        path.unlink()


def _shard_intact(out_dir: Path, entry: dict[str, Any], verify: bool) -> bool:
    """Whether an entry's shard exists (with `verify`: and has the entry's sha256); says what is wrong if not."""
    path = out_dir / entry["file"]
    if not path.is_file():
        print(f"[capture] feature shard {path} is missing: recapturing it")
        return False
    if verify:
        actual = file_sha256(path)
        if actual != entry["sha256"]:
            print(f"[capture] feature shard {path} is corrupt (sha256 {actual}, recorded {entry['sha256']}): "
                  "recapturing it")
            return False
    return True


def read_sidecar(out_dir: Path, index: int, first: int, end: int, verify: bool) -> dict[str, Any] | None:
    """Shard `index`'s entry when its sidecar exists, covers samples first..end-1 and its shard is intact."""
    path = _sidecar(out_dir, index)
    if not path.is_file():
        return None
    with open(path) as f:
        entry = json.load(f)
    # A sidecar planned with another shard_tokens covers other samples: its shard is recaptured.
    if (entry.get("file"), entry.get("first_sample"), entry.get("num_samples")) != (shard_name(index), first,
                                                                                   end - first):
        return None
    return entry if _shard_intact(out_dir, entry, verify) else None


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
    on_written: Callable[[int, dict[str, Any]], None], layer_ids: list[int], batch_tokens: int,
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
                    adapter, table[first:end], first, layer_ids, batch_tokens, dtype, check_every, progress, pack
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
    batch_tokens: int = 8192,
    shard_tokens: int = 1 << 20,
    dtype: str = "bfloat16",
    check_every: int = 1000,
    verify_existing: bool = False,
    fingerprint: dict,
    show_progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    pack: bool = False,
) -> dict[str, Any]:
    """Capture the features of `layer_ids` for every row of `dataset` (columns id, input_ids, loss_mask) into
    the store folder `out_dir`; returns the manifest.

    Resumable at shard granularity: shards already listed in a partial manifest are kept. A complete store with
    the same fingerprint returns at once; a different fingerprint (or taps, dtype, hidden size) raises ValueError.
    Samples whose index is a multiple of `check_every` (0: none) are compared with a plain forward. Raises
    OSError before any work when the remaining shards will not fit on the folder's disk. With `verify_existing`,
    the shards already listed (complete store included) are hashed first and any missing or corrupt one is
    reported by name and recaptured. With `pack`, samples are laid end to end (TargetAdapter.capture_packed)
    instead of padded into batches; the store is the same up to the kernels' rounding.

    With `world_size` > 1, every rank of an initialised torch.distributed group calls this with its `rank` and
    the same arguments; `out_dir` must be one folder that every rank sees (a shared file system across nodes).
    Rank r captures the shards i with i % world_size == r; the store written is the one world_size=1 writes.
    """
    out_dir = Path(out_dir)
    layer_ids = adapter.check_layer_ids(layer_ids)
    torch_dtype = store_dtype(dtype)
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
    expected = {
        "schema_version": SCHEMA_VERSION,
        "target_layer_ids": layer_ids,
        "hidden_size": adapter.hidden_size,
        "dtype": dtype,
        "fingerprint": _normalised(fingerprint),
    }

    manifest = read_manifest(out_dir)
    if manifest is not None:
        _check_resumable(manifest, expected, out_dir)
        if manifest.get("expected_num_samples") != len(dataset):
            raise ValueError(
                f"feature store {out_dir} was captured from a dataset of {manifest.get('expected_num_samples')} "
                f"samples, this one has {len(dataset)}: use a new output folder or delete {out_dir}"
            )
    if world_size > 1:
        return _capture_ranks(
            adapter, dataset, out_dir, manifest, _new_manifest(expected, adapter, len(dataset)), layer_ids,
            batch_tokens=batch_tokens, shard_tokens=shard_tokens, dtype=torch_dtype, check_every=check_every,
            verify_existing=verify_existing, show_progress=show_progress, rank=rank, world_size=world_size,
            pack=pack,
        )
    fresh = manifest is None
    if manifest is not None:
        if verify_existing:
            _repair_shards(adapter, dataset, out_dir, manifest, layer_ids, batch_tokens, torch_dtype, check_every,
                           pack)
        if manifest["complete"]:
            return manifest
        _check_listed_shards(out_dir, manifest)
    else:
        manifest = _new_manifest(expected, adapter, len(dataset))

    writer = ShardWriter(out_dir)
    for path in writer.remove_stale_temps():
        print(f"[capture] removed {path.name}, left by an interrupted writer")
    if fresh:
        remove_sidecars(out_dir)  # left by an older store in this folder: not this run's shards
    lengths = sample_lengths(dataset)
    done = int(manifest["num_samples"])
    plan = list(enumerate(plan_shards(lengths, done, shard_tokens), start=len(manifest["shards"])))
    # Shards that a multi-process run of this store finished (each with a sidecar) are kept.
    finished = {}
    for index, (first, end) in plan:
        entry = read_sidecar(out_dir, index, first, end, verify_existing)
        if entry is not None:
            finished[index] = entry
    work = [(index, first, end) for index, (first, end) in plan if index not in finished]
    check_disk(out_dir, _needed_bytes(lengths, work, len(layer_ids) * adapter.hidden_size, len(layer_ids),
                                      torch_dtype))
    table = dataset.with_format("arrow")
    progress = tqdm(
        total=int(lengths.sum()), initial=int(lengths[:done].sum()) + sum(e["num_tokens"] for e in finished.values()),
        unit="tok", desc="capture", disable=not show_progress,
    )

    def save() -> None:
        writer.write_manifest(manifest)
        if manifest["complete"]:
            remove_sidecars(out_dir)

    def record(index: int, entry: dict[str, Any]) -> None:
        finished[index] = entry
        _append_finished(manifest, finished, len(dataset))
        save()

    if _append_finished(manifest, finished, len(dataset)):
        save()
    try:
        _capture_shards(adapter, table, work, writer, record, layer_ids, batch_tokens, torch_dtype, check_every,
                        progress, pack)
    finally:
        progress.close()
    return manifest


def _capture_ranks(
    adapter: TargetAdapter, dataset: Any, out_dir: Path, manifest: dict[str, Any] | None, fresh: dict[str, Any],
    layer_ids: list[int], *, batch_tokens: int, shard_tokens: int, dtype: torch.dtype, check_every: int,
    verify_existing: bool, show_progress: bool, rank: int, world_size: int, pack: bool,
) -> dict[str, Any]:
    """capture_dataset on one of several ranks: `manifest` is the store's (None if new), `fresh` a new one.

    Every rank plans the same shards: those the manifest lists, then the rest from its last sample on. Rank r
    keeps its shards (i % world_size == r) that are listed or have a sidecar and are intact (hashed with
    `verify_existing`), captures the others and writes a sidecar after each. Rank 0 then writes the manifest of
    every shard, in order, and removes the sidecars.
    """
    if manifest is not None and not verify_existing:
        if manifest["complete"]:
            return manifest
        _check_listed_shards(out_dir, manifest)
    dist.barrier()  # every rank has read the old manifest before rank 0 writes one
    writer = ShardWriter(out_dir)
    lengths = sample_lengths(dataset)
    listed = manifest["shards"] if manifest is not None else []
    plan = [(entry["first_sample"], entry["first_sample"] + entry["num_samples"]) for entry in listed]
    plan += plan_shards(lengths, int(manifest["num_samples"]) if manifest is not None else 0, shard_tokens)
    if rank == 0:
        for path in writer.remove_stale_temps():
            print(f"[capture] removed {path.name}, left by an interrupted writer")
        if manifest is None:
            remove_sidecars(out_dir)  # left by an older store in this folder: not this run's shards
            writer.write_manifest(fresh)  # records the fingerprint, so a rerun with other settings is refused
        unfinished = [(index, first, end) for index, (first, end) in enumerate(plan)
                      if index >= len(listed) and not _sidecar(out_dir, index).is_file()]
        check_disk(out_dir, _needed_bytes(lengths, unfinished, len(layer_ids) * adapter.hidden_size,
                                          len(layer_ids), dtype))
    dist.barrier()  # stale temps and sidecars are gone before any rank looks for its finished shards
    work = []
    for index, (first, end) in enumerate(plan):
        if index % world_size != rank:
            continue
        entry = read_sidecar(out_dir, index, first, end, verify_existing)
        if entry is None and index < len(listed) and _shard_intact(out_dir, listed[index], verify_existing):
            entry = listed[index]
        if entry is None:
            work.append((index, first, end))
    print(f"[capture] rank {rank} of {world_size}: {len(work)} of {len(plan)} shards to capture")
    progress = tqdm(total=sum(int(lengths[first:end].sum()) for _, first, end in work), unit="tok",
                    desc=f"capture (rank 0 of {world_size})", disable=not show_progress or rank != 0)
    try:
        _capture_shards(adapter, dataset.with_format("arrow"), work, writer,
                        lambda index, entry: write_sidecar(out_dir, index, entry), layer_ids, batch_tokens, dtype,
                        check_every, progress, pack)
    finally:
        progress.close()
    dist.barrier()  # every rank's shards and sidecars are on disk
    if rank == 0:
        header = manifest if manifest is not None else fresh
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
        header["complete"] = header["num_samples"] == len(dataset)
        writer.write_manifest(header)
        remove_sidecars(out_dir)
    dist.barrier()  # the manifest is in place before any rank reads it
    return read_manifest(out_dir)
