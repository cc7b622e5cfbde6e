"""The set of token ids a dataset on disk holds (its input_ids column), read through Arrow without a Python loop."""

from __future__ import annotations

import datasets
import pyarrow.compute as pc


def token_ids_in(dataset: datasets.Dataset | None) -> set[int]:
    """Every id that occurs in `dataset`'s input_ids (all rows of its table); empty for None."""
    if dataset is None or len(dataset) == 0:
        return set()
    column = dataset.data.column("input_ids")
    return {int(i) for i in pc.unique(pc.list_flatten(column)).to_pylist()}
