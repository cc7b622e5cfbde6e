"""Offline capture: run the frozen target over a token dataset and store the tapped hidden states.

Samples are planned into shards in dataset order (a sample never straddles two shards). Inside a shard, samples
are sorted by length and grouped into right-padded batches of at most `batch_tokens` padded tokens; each batch
goes through `TargetAdapter.capture` (hooks on the decoder layers, no LM head, stops after the deepest tap) and
its rows are copied back to their place in the shard. Every batch is checked (one row per token, finite values,
non-zero variance per tap and sample), and once per run one sample is compared with a plain
`output_hidden_states` forward, because capture paths have silently produced wrong or all-zero states before
(notes section 8). The manifest is rewritten after every shard, so an interrupted run resumes at the first
missing shard.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from dflash.extract.store import SCHEMA_VERSION, ShardWriter, read_manifest, store_dtype
from dflash.models.targets.base import TargetAdapter

# Relative L2 error allowed between captured features and a plain forward of the same sample: batching and
# padding change the kernels' summation order (large in bfloat16), a wrong tap or zero states give ~1.
CROSSCHECK_RTOL = 0.05
_LENGTH_CHUNK = 65536


def _normalised(value: Any) -> Any:
    """JSON round trip, so tuples and lists (or int keys and str keys) compare the way they are stored."""
    return json.loads(json.dumps(value))


def _sample_lengths(dataset: Any) -> np.ndarray:
    """Token counts of every row, read from Arrow list lengths without materialising the token lists."""
    table = dataset.with_format("arrow")
    lengths = []
    for start in range(0, len(dataset), _LENGTH_CHUNK):
        column = table[start:start + _LENGTH_CHUNK]["input_ids"]
        lengths.append(pc.list_value_length(column).to_numpy(zero_copy_only=False))
    return np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, dtype=np.int64)


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
    b, t, width = features.shape
    num_taps = len(layer_ids)
    if b != len(lengths) or t < max(lengths) or width % num_taps:
        raise ValueError(
            f"captured features have shape {tuple(features.shape)} for {len(lengths)} samples of up to "
            f"{max(lengths)} tokens and {num_taps} taps (one row per token expected)"
        )
    hidden = width // num_taps
    positions = torch.arange(t, device=features.device)
    valid = (positions[None, :] < torch.tensor(lengths, device=features.device)[:, None])[:, :, None]
    count = torch.tensor(lengths, device=features.device, dtype=torch.float32) * hidden
    finite, var = [], []
    for k in range(num_taps):
        # One tap at a time keeps the float32 temporaries at 1/K of the batch.
        x = features[..., k * hidden:(k + 1) * hidden].float()
        finite.append((torch.isfinite(x) | ~valid).flatten(1).all(dim=1))
        x = torch.where(valid, x, 0.0)
        mean = x.sum(dim=(1, 2)) / count
        var.append(torch.where(valid, x - mean[:, None, None], 0.0).pow(2).sum(dim=(1, 2)) / count)
    finite, var = torch.stack(finite, dim=1).cpu(), torch.stack(var, dim=1).cpu()
    for row in range(b):
        for k, layer_id in enumerate(layer_ids):
            if not finite[row, k]:
                raise ValueError(f"sample {ids[row]!r}: tap {layer_id} has non-finite hidden states")
            if not var[row, k] > 0:
                raise ValueError(f"sample {ids[row]!r}: tap {layer_id} has zero variance (all-constant states)")


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


def _capture_shard(
    adapter: TargetAdapter,
    rows: Any,
    layer_ids: list[int],
    batch_tokens: int,
    dtype: torch.dtype,
    crosscheck: bool,
    progress: tqdm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Capture one shard's rows (an Arrow table slice): (hidden, input_ids, loss_mask, offsets)."""
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
        features = features.to(dtype).cpu()
        if crosscheck:
            j = batch[-1]  # the shortest sample of the batch keeps the extra forward cheap
            crosscheck_sample(
                adapter, flat_ids[offsets[j]:offsets[j + 1]].tolist(), features[len(batch) - 1, :lengths[j]],
                layer_ids, sample_ids[j],
            )
            crosscheck = False
        for row, j in enumerate(batch):
            hidden[offsets[j]:offsets[j + 1]] = features[row, :lengths[j]]
        progress.update(sum(batch_lengths))
    return hidden, flat_ids, flat_mask, offsets


def capture_dataset(
    adapter: TargetAdapter,
    dataset: Any,
    out_dir: str | Path,
    layer_ids: list[int],
    *,
    batch_tokens: int = 8192,
    shard_tokens: int = 1 << 20,
    dtype: str = "bfloat16",
    fingerprint: dict,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Capture the features of `layer_ids` for every row of `dataset` (columns id, input_ids, loss_mask) into
    the store folder `out_dir`; returns the manifest.

    Resumable at shard granularity: shards already listed in a partial manifest are kept. A complete store with
    the same fingerprint returns at once; a different fingerprint (or taps, dtype, hidden size) raises ValueError.
    """
    out_dir = Path(out_dir)
    layer_ids = adapter.check_layer_ids(layer_ids)
    torch_dtype = store_dtype(dtype)
    if batch_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"batch_tokens ({batch_tokens}) and shard_tokens ({shard_tokens}) must be positive")
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
        if manifest["complete"]:
            return manifest
        for entry in manifest["shards"]:
            if not (out_dir / entry["file"]).is_file():
                raise FileNotFoundError(
                    f"feature shard {out_dir / entry['file']} listed in the manifest is missing: delete {out_dir}"
                )
    else:
        manifest = {
            **expected,
            "model_type": adapter.model_type,
            "num_target_layers": adapter.num_layers,
            "complete": False,
            "expected_num_samples": len(dataset),
            "num_samples": 0,
            "num_tokens": 0,
            "shards": [],
        }

    writer = ShardWriter(out_dir)
    lengths = _sample_lengths(dataset)
    done = int(manifest["num_samples"])
    plan = plan_shards(lengths, done, shard_tokens)
    table = dataset.with_format("arrow")
    progress = tqdm(
        total=int(lengths.sum()), initial=int(lengths[:done].sum()), unit="tok", desc="capture",
        disable=not show_progress,
    )

    def record(write: Future) -> None:
        entry = write.result()
        manifest["shards"].append(entry)
        manifest["num_samples"] += entry["num_samples"]
        manifest["num_tokens"] += entry["num_tokens"]
        manifest["complete"] = manifest["num_samples"] == len(dataset)
        writer.write_manifest(manifest)

    # Shard k is written (and hashed) by a background thread while shard k+1 is captured; at most one write is
    # pending, so two shards' features are in host memory at once.
    pending: Future | None = None
    start = len(manifest["shards"])
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
        try:
            for index, (first, end) in enumerate(plan, start=start):
                # The comparison with a plain forward runs once per run, on its first batch.
                arrays = _capture_shard(
                    adapter, table[first:end], layer_ids, batch_tokens, torch_dtype, index == start, progress
                )
                if pending is not None:
                    write, pending = pending, None
                    record(write)
                pending = pool.submit(writer.write_shard, index, *arrays, first)
            if pending is not None:
                write, pending = pending, None
                record(write)
        finally:
            # Interrupted while a shard was being written: keep it if the write itself succeeded.
            if pending is not None and pending.exception() is None:
                record(pending)
            progress.close()
    return manifest
