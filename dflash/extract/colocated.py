"""Colocated capture: each trainer rank runs the frozen target itself, one forward per micro-batch it captures.

For a target small enough to share the trainer's GPU (SmolLM2-135M: 0.3 GB in bf16, a forward costs a fraction of
the drafter's step) this is the cheapest way to give the trainer its features: nothing is written to disk or sent
between processes. The features are exactly what offline capture would store: the same `TargetAdapter.capture`
over right-padded rows, the same self-check of every batch, the same cast to the feature dtype.
Larger targets belong on their own GPUs: capture.mode=online. With capture.cuda_graphs the forward is a CUDA graph
replay over fixed shapes instead (static_capture.py), whose features equal these up to the kernels' rounding.

The trainer takes a micro-batch already padded (`micro_batch`: one target forward, or the kept rows below), and the
self-check of its features is read after the training step rather than inside it (`verify_features`): reading it at
once would make the host wait for the target's forward before it could launch the drafter's, leaving the GPU idle
while it does. There too one captured sample in `check_every` is compared with a plain forward of it alone, as
offline capture compares its samples (a single-sample forward every few dozen steps).

With a FeatureMemory (capture.cache, feature_memory.py) the first epoch's features are kept in host memory as they
are captured, and a micro-batch whose samples are all kept is put together from there without the forward; one with
some kept runs the target on the others only (the whole micro-batch with CUDA graphs, whose rows are fixed).

With `final_hidden=True` the forward also runs the rest of the decoder (never the LM head) and each sample gets
"target_final" [T, H], the target's final normed hidden state in its own dtype: the drafter's KL loss makes the
target's next-token distributions from it chunk by chunk (train.kl_weight), so no [T, vocab] logits are kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import record_function

from dflash.data.feature_source import FeatureSource, Sample
from dflash.data.sample_sizes import sample_lengths
from dflash.extract.feature_checks import crosscheck_if_it_fits, feature_flags, raise_on_bad_features
from dflash.host_copy import host_to_device
from dflash.extract.store import store_dtype
from dflash.models.targets.base import TargetAdapter

if TYPE_CHECKING:
    from dflash.extract.feature_memory import FeatureMemory
    from dflash.extract.static_capture import StaticCapture


class Crosscheck(NamedTuple):
    """A captured sample to compare with a plain forward of it alone: its tokens, id and features [T, K*H] (and
    final normed state [T, H] when the source keeps it)."""

    input_ids: list[int]
    sample_id: str
    hidden: torch.Tensor
    final: torch.Tensor | None


class ColocatedFeatureSource(FeatureSource):
    """Samples {"input_ids", "loss_mask", "hidden"} (+ "target_final" when final_hidden) of a token dataset, the
    features computed on access.

    `micro_batch` (`get_batch`) captures a micro-batch in one padded target forward and returns it padded, the
    hidden states on the target's device; its check is pending until `verify_features`.
    `get_many` and indexing return checked single samples. memory: where the first epoch's features are kept
    (None: every micro-batch is captured); lengths: every sample's token count where the caller has them
    (sample_lengths of the dataset, which is otherwise counted when kept_apart needs it); check_every: one sample in
    that many captured (counted in capture order; 0: none) is compared with a plain forward when its batch is
    verified (capture.check_every).
    """

    def __init__(self, adapter: TargetAdapter, dataset: Any, layer_ids: list[int], dtype: str,
                 final_hidden: bool = False, static: StaticCapture | None = None,
                 memory: FeatureMemory | None = None, lengths: np.ndarray | None = None,
                 check_every: int = 0) -> None:
        self.dtype = store_dtype(dtype)
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"colocated capture keeps features in bfloat16 or float32, not {dtype!r}: fp8 only "
                             "saves disk, and colocated features never touch the disk")
        self.adapter = adapter
        self.layer_ids = adapter.check_layer_ids(list(layer_ids))
        self.dataset = dataset
        # Rows as numpy arrays: 64 rows of ~600 tokens pad in ~4 ms this way, against ~18 ms through Python lists
        # (2-core CPU), host time that every colocated training step pays.
        self._rows = dataset.with_format("numpy", columns=["input_ids", "loss_mask"], output_all_columns=True)
        self.final_hidden = final_hidden
        # capture.cuda_graphs: the forward over fixed shapes (static_capture.py), built for these taps and final_hidden.
        if static is not None and (static.layer_ids != self.layer_ids or static.final_hidden != final_hidden):
            raise ValueError(f"the static capture was built for taps {static.layer_ids} (final_hidden="
                             f"{static.final_hidden}), not {self.layer_ids} ({final_hidden})")
        self.static, self.memory, self.lengths = static, memory, lengths
        self.tokens_captured = self.tokens_recalled = self.samples_captured = 0
        self.check_every = check_every
        # Per micro-batch handed out and not verified yet: its samples' indices, its checks (flags on the host once
        # `ready` has passed, sample ids, tap names, ready event; a batch read back from memory has none) and its
        # samples to compare with a plain forward (Crosscheck).
        self._pending: list[tuple[list[int], list[tuple[torch.Tensor, list[str], list, torch.cuda.Event | None]],
                                  list[Crosscheck]]] = []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.get_many([index])[0]

    def micro_batch(self, indices: list[int], pin_memory: bool = False) -> Sample:
        return self.get_batch(indices, pin_memory)[0]

    def kept_apart(self, order: Sequence[int], kept: int | None = None) -> int:
        """FeatureSource.kept_apart: with a memory that holds part of the epoch, the first samples of `order` that it
        holds, and the memory keeps those alone; 0 without a memory, or with one that holds the whole epoch (every
        later micro-batch is then kept whole anyway). A resumed run's `kept` is returned as given, and a memory with
        a limit keeps those samples alone (one without keeps every sample)."""
        if kept is None:
            if self.memory is None:
                return 0
            lengths = self.lengths if self.lengths is not None else sample_lengths(self.dataset)
            kept = self.memory.prefix_that_fits([int(lengths[index]) for index in order])
            kept = kept if kept < len(order) else 0
        if self.memory is not None and self.memory.limit_bytes is not None and 0 < kept < len(order):
            self.memory.keep_only(order[:kept])
        return kept

    def get_many(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        batch, lengths = self.get_batch(indices)
        self.verify_features()
        return [{key: value[row, :length] for key, value in batch.items()} for row, length in enumerate(lengths)]

    def get_batch(self, indices: list[int], pin_memory: bool = False) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(the micro-batch right-padded to its longest sample, as `batches.collate` pads stored samples (zeros,
        loss_mask 0); each sample's length). pin_memory: input_ids / loss_mask in page-locked host memory. Its
        check stays pending until verify_features."""
        rows = self._rows[list(indices)]
        ids, masks = rows["input_ids"], rows["loss_mask"]
        lengths = [len(row) for row in ids]
        for j, (row_ids, row_mask) in enumerate(zip(ids, masks)):
            if not len(row_ids) or len(row_ids) != len(row_mask):
                raise ValueError(f"sample {rows['id'][j]!r}: {len(row_ids)} input_ids, {len(row_mask)} loss_mask "
                                 "entries (need the same, non-zero count)")
        width = max(lengths)
        padded_ids = np.zeros((len(ids), width), dtype=np.int64)
        padded_mask = np.zeros((len(ids), width), dtype=np.int64)
        for row, (row_ids, row_mask) in enumerate(zip(ids, masks)):
            padded_ids[row, : lengths[row]] = row_ids
            padded_mask[row, : lengths[row]] = row_mask
        input_ids, loss_mask = torch.from_numpy(padded_ids), torch.from_numpy(padded_mask)
        kept = [] if self.memory is None else [row for row, index in enumerate(indices) if index in self.memory.where]
        if len(kept) == len(indices):
            batch = self.memory.recall(indices, self.adapter.device)  # checked when they were captured
            self._pending.append((list(indices), [], []))
        else:
            # Some kept (a memory that holds part of the epoch): the target runs on the others only. With CUDA graphs
            # every micro-batch has the same rows, so there the whole micro-batch is captured.
            if self.static is not None:
                kept = []
            held = set(kept)
            captured = [row for row in range(len(indices)) if row not in held]
            batch = self._capture_rows(input_ids, lengths, captured, [str(rows["id"][row]) for row in captured],
                                       [indices[row] for row in captured])
            if kept:
                self.memory.recall_into(batch, kept, [indices[row] for row in kept])
        recalled = sum(lengths[row] for row in kept)
        self.tokens_recalled += recalled
        self.tokens_captured += sum(lengths) - recalled
        if pin_memory:
            input_ids, loss_mask = input_ids.pin_memory(), loss_mask.pin_memory()
        return {"input_ids": input_ids, "loss_mask": loss_mask, **batch}, lengths

    def _capture_rows(self, input_ids: torch.Tensor, lengths: list[int], rows: list[int], sample_ids: list[str],
                      indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch's {"hidden"} (+ "target_final") [all rows, width, D] with `rows` made by one target
        forward (padded to their own longest), kept in memory, their checks pending; the other rows zeros."""
        sub_lengths = [lengths[row] for row in rows]
        features, checks = self._capture(input_ids[rows, :max(sub_lengths)], sub_lengths, sample_ids)
        self._pending.append((list(indices), checks, self._crosschecks(input_ids, lengths, rows, sample_ids,
                                                                       features)))
        if self.memory is not None:
            self.memory.keep(indices, sub_lengths, features)
        if len(rows) == input_ids.shape[0]:
            return features
        # One copy per key into the full micro-batch (zeros on the padding, as the sub-batch has them); the row
        # numbers go to the device from page-locked memory, without a host wait.
        where = host_to_device(torch.tensor(rows), self.adapter.device)
        batch = {}
        for key, value in features.items():
            batch[key] = value.new_zeros(input_ids.shape[0], input_ids.shape[1], value.shape[-1])
            batch[key].narrow(1, 0, value.shape[1]).index_copy_(0, where, value)
        return batch

    def _crosschecks(self, input_ids: torch.Tensor, lengths: list[int], rows: list[int], sample_ids: list[str],
                     features: dict[str, torch.Tensor]) -> list[Crosscheck]:
        """The captured `rows` (k-th: features[...][k]) whose place in capture order is a multiple of check_every,
        each with a copy of its features (the batch's own are the trainer's to free)."""
        chosen = []
        for k, row in enumerate(rows):
            if self.check_every and (self.samples_captured + k) % self.check_every == 0:
                final = features.get("target_final")
                chosen.append(Crosscheck(input_ids[row, :lengths[row]].tolist(), sample_ids[k],
                                         features["hidden"][k, :lengths[row]].clone(),
                                         None if final is None else final[k, :lengths[row]].clone()))
        self.samples_captured += len(rows)
        return chosen

    def _capture(self, input_ids: torch.Tensor, lengths: list[int],
                 sample_ids: list[str]) -> tuple[dict[str, torch.Tensor], list[tuple]]:
        """({"hidden"} (+ "target_final") of the padded input_ids: one target forward, zeros on the padding; its
        checks, deferred (`_defer_check`))."""
        width = input_ids.shape[1]
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        device = self.adapter.device
        # The target sees its own pad token on the padding; the batch keeps zeros there, as collate pads.
        target_ids = input_ids.masked_fill(attention_mask == 0, self.adapter.tokenizer.pad_token_id)
        mask_on_device = host_to_device(attention_mask, device)
        # The host's mask: the target checks its padding there, where a check of the device's would wait for the GPU.
        inputs = (host_to_device(target_ids, device), attention_mask, self.layer_ids)
        final = None
        with record_function("dflash: colocated target forward"), self._attention_kernels(device):
            if self.static is not None:
                features, final = self.static(inputs[0])
            elif self.final_hidden:
                features, final = self.adapter.capture_with_final(*inputs)
            else:
                features = self.adapter.capture(*inputs)
        flags = [(feature_flags(features, lengths, self.layer_ids), self.layer_ids)]
        if final is not None:  # the KL target: a non-finite state would only surface as a NaN loss
            flags.append((feature_flags(final, lengths, ["final norm"]), ["final norm"]))
        checks = [self._defer_check(batch_flags, sample_ids, names) for batch_flags, names in flags]
        padding = (mask_on_device == 0)[:, :, None]
        batch = {"hidden": features.to(self.dtype).masked_fill_(padding, 0)}
        if final is not None:
            batch["target_final"] = final.masked_fill(padding, 0)
        return batch, checks

    def summary(self) -> str:
        """What the target's forward made this run, and what came from the kept first epoch."""
        line = f"[train] colocated features: {self.tokens_captured:,} tokens captured"
        if self.memory is not None:
            line += (f", {self.tokens_recalled:,} read from host memory ({len(self.memory.where):,} samples kept in "
                     f"{self.memory.allocated_bytes / 2**30:.2f} GiB)")
        return line

    def close(self) -> None:
        """Hand the kept features' memory back (the end of training)."""
        if self.memory is not None:
            self.memory.close()
            self.memory = None  # later batches are captured
    @staticmethod
    def _attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
        """On CUDA, SDPA's memory-efficient and flash kernels rather than cuDNN's for the padded target forward.

        A micro-batch's padded width changes every step, and cuDNN's attention plans its graph for each new shape
        on the host: a profile of the SmolLM2 recipe on one H200 showed 1.0 ms of host time per attention
        call, 28 calls a step, for 0.13 ms of GPU time each. The step is bound by the host there.
        """
        if torch.device(device).type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])

    @staticmethod
    def _defer_check(flags: torch.Tensor, ids: list[str], names: list) -> tuple:
        """(the flags, on the host once `ready` has passed (None: they are already), ids, names, ready)."""
        if flags.device.type != "cuda":
            return flags, ids, names, None
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)  # lands when the stream gets there; `ready` says when
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(flags.device))  # the copy's stream, whichever device is current
        return host, ids, names, ready

    def verify_features(self, leave: int = 0) -> None:
        """Raise ValueError naming the sample and tap of a pending batch whose features are non-finite or constant,
        or differ from a plain forward (its samples of check_every, crosscheck_if_it_fits); the `leave` newest
        batches stay pending (made ahead for the next step, dflash/train/step_batches.py), and so do the batches
        after a failed one. Waits only for the flags' copy, which a finished training step has passed long ago. The
        samples of a failed batch are not read back from memory: a batch read back before the check
        of the batch its rows came from (made ahead) trains only after that check passed, or not at all."""
        split = max(len(self._pending) - leave, 0)
        pending, self._pending = self._pending[:split], self._pending[split:]
        for position, (indices, checks, crosschecks) in enumerate(pending):
            try:
                for flags, ids, names, ready in checks:
                    if ready is not None:
                        ready.synchronize()
                    raise_on_bad_features(flags, ids, names)
                for check in crosschecks:
                    crosscheck_if_it_fits(self.adapter, check.input_ids, check.hidden, self.layer_ids,
                                          check.sample_id, check.final)
            except ValueError:
                if self.memory is not None:
                    self.memory.forget(indices)
                self._pending = pending[position + 1:] + self._pending
                raise
