"""Saving and pruning checkpoints: shards flushed before `complete`, no half-deleted tag after a kill inside a
delete, and a `latest` that names no complete tag falls back to the newest complete one."""

import os
import shutil

import pytest

from dflash import run_files
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


class ShardWriter:
    """A stand-in for TrainEngine.save: writes one shard with a plain open, as DeepSpeed's torch.save does."""

    zero_stage = 0

    def save(self, directory, tag, client_state):
        os.makedirs(os.path.join(directory, tag), exist_ok=True)
        with open(os.path.join(directory, tag, "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"w" * 64)


def test_the_shards_are_flushed_before_the_tag_is_marked_complete(tmp_path, monkeypatch):
    flushed = []
    real = run_files.fsync_path
    monkeypatch.setattr(run_files, "fsync_path", lambda path: (flushed.append(os.fspath(path)), real(path)))
    checkpoints.save_checkpoint(ShardWriter(), str(tmp_path), 3, {}, rank=0, keep_last=1)
    shard = str(tmp_path / "step3" / "mp_rank_00_model_states.pt")
    marker = next(i for i, path in enumerate(flushed) if os.path.basename(path).startswith(f".{COMPLETE}"))
    assert shard in flushed[:marker]


def test_a_stale_copy_of_the_tag_being_saved_is_renamed_before_it_is_deleted(tmp_path, monkeypatch):
    make_tag(tmp_path, "step3")  # e.g. a corrupt newest tag the run resumed past
    deleted = []
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(checkpoints.shutil, "rmtree", lambda path, *a, **k: (deleted.append(path),
                                                                               real_rmtree(path, *a, **k)))
    checkpoints.save_checkpoint(ShardWriter(), str(tmp_path), 3, {}, rank=0, keep_last=1)
    assert deleted and all(os.path.basename(path).startswith(checkpoints.PRUNED) for path in deleted)
    assert [tag for _, tag in complete_tags(str(tmp_path))] == ["step3"]


def test_latest_naming_an_incomplete_tag_falls_back_to_the_newest_complete_one(tmp_path, caplog):
    # A run resumed from step2 past a corrupt step4, then was killed while saving step4 again: `latest` still
    # names step4, which has lost its `complete` marker.
    for step in (1, 2):
        make_tag(tmp_path, f"step{step}")
    make_tag(tmp_path, "step4", complete=False)
    (tmp_path / checkpoints.LATEST).write_text("step4")
    with caplog.at_level("WARNING"):
        assert checkpoints.verified_latest_tag(str(tmp_path)) == "step2"
    assert "names checkpoint 'step4', which is not complete" in caplog.text


def test_a_missing_latest_beside_complete_tags_resumes_from_the_newest(tmp_path, caplog):
    for step in (1, 2):
        make_tag(tmp_path, f"step{step}")
    with caplog.at_level("WARNING"):
        assert checkpoints.verified_latest_tag(str(tmp_path)) == "step2"
    assert "latest is missing" in caplog.text
    assert checkpoints.verified_latest_tag(str(tmp_path / "nothing")) is None
    make_tag(tmp_path, "step5", complete=False)
    (tmp_path / checkpoints.LATEST).write_text("step5")
    for step in (1, 2):
        shutil.rmtree(tmp_path / f"step{step}")
    assert checkpoints.verified_latest_tag(str(tmp_path)) is None  # nothing complete: the run starts over


def test_a_tag_set_aside_again_replaces_what_an_earlier_kill_left_under_its_aside_name(tmp_path):
    make_tag(tmp_path, "step1")
    make_tag(tmp_path, "step2")
    make_tag(tmp_path, checkpoints.PRUNED + "step1", complete=False)  # a delete of an older step1, killed midway
    prune_checkpoints(str(tmp_path), keep_last=1, current="step2")
    assert sorted(os.listdir(tmp_path)) == ["step2"]


def killed_between_complete_and_latest(monkeypatch):
    """save_checkpoint's writes as a kill after `complete` and before `latest` leaves them (KeyboardInterrupt)."""
    real = checkpoints.write_text

    def write(path, text):
        if os.path.basename(path) == checkpoints.LATEST:
            raise KeyboardInterrupt("killed before latest")
        real(path, text)

    monkeypatch.setattr(checkpoints, "write_text", write)


def test_a_kill_between_complete_and_latest_resumes_from_the_tag_it_completed(tmp_path, monkeypatch):
    checkpoints.save_checkpoint(ShardWriter(), str(tmp_path), 2, {}, rank=0, keep_last=0)
    assert not (tmp_path / checkpoints.PENDING).exists()  # a save that ends leaves no pending mark
    killed_between_complete_and_latest(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_checkpoint(ShardWriter(), str(tmp_path), 3, {}, rank=0, keep_last=0)
    assert (tmp_path / checkpoints.LATEST).read_text() == "step2" and (tmp_path / "step3" / COMPLETE).exists()
    assert checkpoints.verified_latest_tag(str(tmp_path)) == "step3"  # its steps are not trained again


def test_a_pending_mark_of_an_unfinished_tag_or_older_than_latest_is_passed_over(tmp_path):
    make_tag(tmp_path, "step2")
    make_tag(tmp_path, "step3", complete=False)
    (tmp_path / checkpoints.LATEST).write_text("step2")
    (tmp_path / checkpoints.PENDING).write_text("step3")  # killed before `complete`: step3 is half-written
    assert checkpoints.verified_latest_tag(str(tmp_path)) == "step2"
    (tmp_path / "step3" / COMPLETE).write_text("3\n")
    assert checkpoints.verified_latest_tag(str(tmp_path)) == "step3"
    # `latest` written after the mark: a user rolled the training back by hand, which wins.
    written = os.stat(tmp_path / checkpoints.PENDING).st_mtime_ns
    os.utime(tmp_path / checkpoints.LATEST, ns=(written + 10**9, written + 10**9))
    assert checkpoints.verified_latest_tag(str(tmp_path)) == "step2"
