"""The keys train.group_by_length sorts samples by: token counts, or the rows a training step spends on a sample."""

import datasets
import numpy as np
import pytest

from dflash.data.batch_plan import grouping_keys
from dflash.data.sample_sizes import sample_anchor_positions


def dataset(masks: list[list[int]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"input_ids": [[7] * len(m) for m in masks], "loss_mask": masks})


def brute_force(mask: list[int]) -> int:
    return sum(1 for a in range(len(mask) - 1) if mask[a] and mask[a + 1])


def test_anchor_positions_count_consecutive_loss_pairs_inside_each_row():
    masks = [[0, 1, 1, 1], [1, 1], [0, 0, 1], [1], [1, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1, 1]]
    rows = dataset(masks)
    assert sample_anchor_positions(rows).tolist() == [brute_force(m) for m in masks] == [2, 1, 0, 0, 1, 1, 4]
    # A slice starts its Arrow offsets past 0: counted the same.
    assert sample_anchor_positions(rows.select(range(3, 7))).tolist() == [0, 1, 1, 4]
    assert sample_anchor_positions(dataset([[1, 1], [], [0, 1, 1], []])).tolist() == [1, 0, 1, 0]  # empty rows


def test_work_keys_add_the_query_rows_of_the_anchors_a_sample_trains():
    masks = [[0, 1, 1, 1], [1] * 10, [0, 0, 1]]
    rows = dataset(masks)
    assert grouping_keys(rows, "tokens", 4, 16).tolist() == [4, 10, 3]
    # anchors trained = min(valid positions, num_anchors): 2, min(9, 4) = 4, 0
    assert np.array_equal(grouping_keys(rows, "work", 4, 16), np.array([4 + 32, 10 + 64, 3]))
    with pytest.raises(ValueError, match="train.group_by must be one of"):
        grouping_keys(rows, "answers", 4, 16)


def test_anchor_positions_equal_a_plain_count_over_chunks_of_a_shuffled_dataset(monkeypatch):
    import random

    import dflash.data.sample_sizes as sample_sizes

    rng = random.Random(1)
    masks = [[rng.choice([0, 1, 1]) for _ in range(rng.randrange(0, 9))] for _ in range(300)]
    rows = dataset(masks).shuffle(seed=3)  # an indices mapping over the Arrow table
    monkeypatch.setattr(sample_sizes, "_ANCHOR_CHUNK", 7)  # chunks that end on empty and on one-token rows
    assert sample_anchor_positions(rows).tolist() == [brute_force(m) for m in rows["loss_mask"]]
