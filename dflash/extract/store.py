"""The offline feature store: a few large safetensors shards plus manifest.json.

Layout of a store folder:
    manifest.json            schema_version, target_layer_ids, hidden_size, dtype, num_samples, num_tokens,
                             complete, fingerprint, shards: [{file, sha256, first_sample, num_samples, num_tokens}]
    shard-00000.safetensors  many samples in the one file format of captured samples (sample_format.py)
Sample i of the store is row i of the dataset it was captured from. Shards and the manifest are written atomically
(run_files.atomic_path), so a file that exists is complete; a shard's sha256 is checked the first time a reader
opens it.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash.data.feature_source import FeatureSource, Sample
from dflash.extract.fp8 import FP8_DTYPE
from dflash.extract.sample_format import METADATA, SCHEMA_VERSION, decode, sample_tensors
from dflash.run_files import atomic_path, atomic_write, file_sha256

MANIFEST_NAME = "manifest.json"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": FP8_DTYPE}


def store_dtype(name: str) -> torch.dtype:
    """The torch dtype of a stored-feature dtype name; float16 is refused (it overflows in the fusion)."""
    if name in ("float16", "fp16", "half"):
        raise ValueError("float16 features are not supported (overflow in the drafter's fusion); use bfloat16")
    if name not in STORE_DTYPES:
        raise ValueError(f"unknown feature dtype {name!r}; use one of {sorted(STORE_DTYPES)}")
    return STORE_DTYPES[name]


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """The manifest of a store folder, or None when the folder has none yet."""
    file = Path(path) / MANIFEST_NAME
    if not file.is_file():
        return None
    with open(file) as f:
        return json.load(f)


class ShardWriter:
    """Writes shards and the manifest of one store folder atomically (run_files.atomic_path)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def remove_stale_temps(self) -> list[Path]:
        """Delete temporary files (run_files.temp_path) left by a writer killed mid-write; returns them.

        Only one capture writes a store folder at a time, so every temp file found at start-up is stale.
        """
        stale = sorted(self.out_dir.glob(".*.tmp-*"))
        for path in stale:
            path.unlink()
        return stale

    def write_shard(
        self,
        index: int,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        offsets: torch.Tensor,
        first_sample: int,
        scales: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Write shard `index` and return its manifest entry (file, sha256, first_sample, num_samples, num_tokens).

        `scales` [tokens, K] goes with fp8 `hidden` only.
        """
        name = shard_name(index)
        tensors = sample_tensors(hidden, input_ids, loss_mask, offsets, scales, what=f"shard {index}")
        with atomic_path(self.out_dir / name) as tmp:
            # Written from the tensors, not through encode(): a shard can be larger than the memory to spare.
            save_file(tensors, tmp, metadata=METADATA)
            sha = file_sha256(tmp)
        return {
            "file": name,
            "sha256": sha,
            "first_sample": int(first_sample),
            "num_samples": int(offsets.shape[0] - 1),
            "num_tokens": int(offsets[-1]),
        }

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write(self.out_dir / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


class _OpenShard:
    """One opened shard: small tensors in memory, `hidden` read row ranges at a time through safetensors mmap."""

    def __init__(self, path: Path) -> None:
        self.handle = safe_open(str(path), framework="pt")
        self.offsets = self.handle.get_tensor("offsets")
        self.input_ids = self.handle.get_tensor("input_ids")
        self.loss_mask = self.handle.get_tensor("loss_mask")
        self.hidden = self.handle.get_slice("hidden")
        self.scales = self.handle.get_tensor("scales") if "scales" in self.handle.keys() else None


class FeatureStore(FeatureSource):
    """The offline FeatureSource: `store[i]` -> {"input_ids": LongTensor[T], "loss_mask": LongTensor[T],
    "hidden": Tensor[T, K*H]}, in any order.

    `hidden` comes in the stored dtype; fp8 stores are dequantised to bfloat16 on read. A shard's sha256 is checked
    when it is first opened, so there is no deferred check (`verify_features` does nothing).
    """

    def __init__(self, path: str | Path, *, verify: bool = True, allow_partial: bool = False) -> None:
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise FileNotFoundError(f"no feature store at {self.path} ({MANIFEST_NAME} not found)")
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"feature store {self.path} has schema_version {manifest.get('schema_version')}, "
                f"this code reads {SCHEMA_VERSION}"
            )
        if not manifest.get("complete", False) and not allow_partial:
            raise ValueError(
                f"feature store {self.path} is incomplete ({manifest['num_samples']} of "
                f"{manifest.get('expected_num_samples', '?')} samples): rerun the capture to finish it"
            )
        self.manifest = manifest
        self.verify = verify
        self._first = [s["first_sample"] for s in manifest["shards"]]
        self._open: dict[int, _OpenShard] = {}

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["target_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    def _shard(self, index: int) -> _OpenShard:
        if index not in self._open:
            entry = self.manifest["shards"][index]
            path = self.path / entry["file"]
            first, count = entry["first_sample"], entry["num_samples"]
            if not path.is_file():
                raise FileNotFoundError(f"feature shard missing: {path} (samples {first}..{first + count - 1}); "
                                        f"rerun the same command: its capture stage recaptures it")
            if self.verify:
                actual = file_sha256(path)
                if actual != entry["sha256"]:
                    # Set aside, so that the capture stage finds it missing and recaptures it on the next run.
                    with contextlib.suppress(FileNotFoundError):  # another rank set it aside first
                        os.replace(path, path.with_name(path.name + ".corrupt"))
                    raise ValueError(
                        f"feature shard {path} is corrupt: sha256 {actual} does not match the manifest's "
                        f"{entry['sha256']} (samples {first}..{first + count - 1}); it is set aside as "
                        f"{path.name}.corrupt: rerun the same command, its capture stage recaptures it")
            self._open[index] = _OpenShard(path)
        return self._open[index]

    def locate(self, i: int) -> tuple[int, int, int]:
        """(shard index, first row, end row) of sample i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        shard_index = bisect.bisect_right(self._first, i) - 1
        shard = self._shard(shard_index)
        j = i - self._first[shard_index]
        return shard_index, int(shard.offsets[j]), int(shard.offsets[j + 1])

    def __getitem__(self, i: int) -> Sample:
        shard_index, start, end = self.locate(int(i))
        shard = self._open[shard_index]
        return decode(shard.input_ids[start:end], shard.loss_mask[start:end], shard.hidden[start:end],
                      None if shard.scales is None else shard.scales[start:end])

    def lengths(self) -> list[int]:
        """Token count of every sample, in order (opens every shard)."""
        out: list[int] = []
        for index in range(len(self.manifest["shards"])):
            out.extend(torch.diff(self._shard(index).offsets).tolist())
        return out

    def verify_all(self) -> None:
        """Check every shard's sha256 now (raises naming the first corrupt file)."""
        for index in range(len(self.manifest["shards"])):
            self._shard(index)

    def __getstate__(self) -> dict[str, Any]:
        # Open safetensors handles do not pickle (DataLoader workers): each process reopens what it needs.
        state = dict(self.__dict__)
        state["_open"] = {}
        return state
