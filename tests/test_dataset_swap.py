"""The dataset swap of the data stage: the new dataset replaces the old whole, and what an earlier build killed
mid-swap left behind (its temp or old copy, a full dataset each) is removed by the next build."""

from __future__ import annotations

import datasets

from dflash.data.dataset import FEATURES, _save_dataset


def rows(ids: list[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"id": ids, "input_ids": [[1, 2, 3]] * len(ids),
                                       "loss_mask": [[0, 1, 1]] * len(ids), "prompt_set": ["s"] * len(ids)},
                                      features=FEATURES)


def test_a_build_replaces_the_dataset_and_removes_an_interrupted_swaps_copies(tmp_path):
    target = tmp_path / "dataset"
    _save_dataset(rows(["a"]), target)
    # A build killed between its renames: the old dataset moved aside, the new one still under its temp name.
    (tmp_path / ".dataset.old-123").mkdir()
    (tmp_path / ".dataset.old-123" / "data.arrow").write_bytes(b"x" * 100)
    (tmp_path / ".dataset.tmp-123").mkdir()
    (tmp_path / ".heldout.tmp-9").mkdir()  # another dataset's copy is not this swap's to remove
    _save_dataset(rows(["b", "c"]), target)
    assert datasets.load_from_disk(str(target))["id"] == ["b", "c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".heldout.tmp-9", "dataset"]
