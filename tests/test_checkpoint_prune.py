"""Pruning old checkpoints: a kill inside the delete leaves no half-deleted tag, and the next save finishes it."""

import os
import shutil

import pytest

from dflash.train import checkpoints
from dflash.train.checkpoints import COMPLETE, complete_tags, prune_checkpoints


def make_tag(directory, name, complete=True):
    folder = directory / name
    folder.mkdir()
    for shard in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_optim_states.pt", "rng_rank0.safetensors"):
        (folder / shard).write_bytes(b"x" * 64)
    if complete:
        (folder / COMPLETE).write_text(name[4:] + "\n")


def test_prune_keeps_the_newest_and_removes_orphans(tmp_path):
    for step in (1, 2, 3, 4):
        make_tag(tmp_path, f"step{step}")
    make_tag(tmp_path, "step7", complete=False)  # a save killed before `complete`, never saved again
    make_tag(tmp_path, "step2_universal")
    (tmp_path / "latest_universal").write_text("step2_universal")
    prune_checkpoints(str(tmp_path), keep_last=2, current="step4")
    assert sorted(os.listdir(tmp_path)) == ["step3", "step4"]


def test_keep_last_zero_keeps_every_complete_tag(tmp_path):
    for step in (1, 2, 3):
        make_tag(tmp_path, f"step{step}")
    prune_checkpoints(str(tmp_path), keep_last=0, current="step3")
    assert [tag for _, tag in complete_tags(str(tmp_path))] == ["step1", "step2", "step3"]


def test_a_kill_inside_the_delete_leaves_whole_tags_and_the_next_prune_finishes(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        make_tag(tmp_path, f"step{step}")
    real_rmtree = shutil.rmtree

    def killed_after_one_file(path, *args, **kwargs):
        first = sorted(os.listdir(path))[0]
        os.remove(os.path.join(path, first))  # `complete` sorts first: the worst moment to die
        raise KeyboardInterrupt("killed inside the delete")

    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(str(tmp_path), keep_last=1, current="step3")
    # No folder named like a tag is half-deleted: the one being deleted was renamed first.
    for name in os.listdir(tmp_path):
        if name.startswith("step"):
            assert len(os.listdir(tmp_path / name)) == 4, name
    assert any(name.startswith(checkpoints.PRUNED) for name in os.listdir(tmp_path))
    monkeypatch.setattr(checkpoints.shutil, "rmtree", real_rmtree)
    make_tag(tmp_path, "step4")
    prune_checkpoints(str(tmp_path), keep_last=1, current="step4")
    assert sorted(os.listdir(tmp_path)) == ["step4"]
