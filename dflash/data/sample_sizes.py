"""Per-sample sizes of a token dataset, read from its Arrow columns without materialising the token lists."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.compute as pc

_LENGTH_CHUNK = 65536
_ANCHOR_CHUNK = 4096


def sample_lengths(dataset: Any) -> np.ndarray:
    """Token counts of every row, read from Arrow list lengths without materialising the token lists."""
    table = dataset.with_format("arrow")
    lengths = []
    for start in range(0, len(dataset), _LENGTH_CHUNK):
        column = table[start:start + _LENGTH_CHUNK]["input_ids"]
        lengths.append(pc.list_value_length(column).to_numpy(zero_copy_only=False))
    return np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, dtype=np.int64)


def sample_anchor_positions(dataset: Any) -> np.ndarray:
    """Per row, the positions a with loss_mask[a] and loss_mask[a + 1] (the valid anchors of training), counted
    over the flat Arrow values chunk by chunk."""
    table = dataset.with_format("arrow")
    counts = []
    # Fewer rows per chunk than for lengths: here every token of the chunk becomes a few numpy arrays.
    for start in range(0, len(dataset), _ANCHOR_CHUNK):
        column = table[start:start + _ANCHOR_CHUNK]["loss_mask"].combine_chunks()
        offsets = column.offsets.to_numpy(zero_copy_only=False) - column.offsets[0].as_py()
        values = column.flatten().to_numpy(zero_copy_only=False).astype(bool)
        # One entry per flat position (+ one past the end, for empty trailing rows): pairs[i] = pairs before i.
        pairs = np.concatenate([[0], np.cumsum(values[:-1] & values[1:]), [0]]) if len(values) else np.zeros(2, int)
        pairs[-1] = pairs[-2]
        # Pairs (a, a + 1) inside row r: a from offsets[r] to offsets[r + 1] - 2.
        first, last = offsets[:-1], np.maximum(offsets[1:] - 1, offsets[:-1])
        counts.append(pairs[last] - pairs[first])
    return np.concatenate(counts).astype(np.int64) if counts else np.zeros(0, dtype=np.int64)
