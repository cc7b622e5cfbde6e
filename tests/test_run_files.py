"""Run-folder files: done markers and the fingerprint that ties checkpoints to their run's settings."""

import json
import os

import pytest

from dflash.run_files import (
    atomic_path, atomic_write, claim_checkpoint_dir, claim_dir, make_owned_dir, mark_done, remove_owned_dir, stage_done,
    swap_in_dir, temp_path,
)


def test_checkpoints_of_other_settings_are_moved_aside_never_deleted(tmp_path):
    folder = str(tmp_path / "checkpoints")
    assert claim_checkpoint_dir(folder, "aaa") is None  # a fresh folder is claimed
    (tmp_path / "checkpoints" / "latest").write_text("step4")
    assert claim_checkpoint_dir(folder, "aaa") is None  # same settings: kept, so the run resumes
    assert (tmp_path / "checkpoints" / "latest").is_file()

    assert claim_checkpoint_dir(folder, "bbb") == f"{folder}.aaa"
    assert (tmp_path / "checkpoints.aaa" / "latest").read_text() == "step4"
    assert os.listdir(folder) == ["fingerprint.json"]
    assert json.loads((tmp_path / "checkpoints" / "fingerprint.json").read_text()) == {"fingerprint": "bbb"}


def test_moved_aside_checkpoints_are_all_kept(tmp_path):
    folder = tmp_path / "checkpoints"
    (tmp_path / "checkpoints_other").mkdir()  # not ours
    folder.mkdir()
    (folder / "latest").write_text("step2")
    assert claim_checkpoint_dir(str(folder), "ccc") == f"{folder}.unfingerprinted"
    (folder / "latest").write_text("step9")
    assert claim_checkpoint_dir(str(folder), "0123456789abcdef") == f"{folder}.ccc"
    (folder / "latest").write_text("step1")
    assert claim_checkpoint_dir(str(folder), "fedcba9876543210") == f"{folder}.0123456789abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoints", "checkpoints.0123456789abcdef", "checkpoints.ccc", "checkpoints.unfingerprinted",
        "checkpoints_other"]
    assert (tmp_path / "checkpoints.unfingerprinted" / "latest").read_text() == "step2"


def test_only_the_latest_moved_aside_feature_store_is_kept(tmp_path):
    folder = tmp_path / "features"
    (tmp_path / "features.unfingerprinted").mkdir()  # moved aside by an earlier change: now deleted
    (tmp_path / "features.backup").mkdir()  # not ours, though it starts like ours
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    assert claim_dir(str(folder), "0123456789abcdef", stage="capture", contents="features") == \
        f"{folder}.unfingerprinted"
    (folder / "manifest.json").write_text("{}")
    assert claim_dir(str(folder), "fedcba9876543210", stage="capture", contents="features") == \
        f"{folder}.0123456789abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["features", "features.0123456789abcdef",
                                                          "features.backup"]


def test_an_unreadable_done_marker_means_the_stage_is_redone(tmp_path):
    mark_done(str(tmp_path), "key")
    assert stage_done(str(tmp_path), "key") and not stage_done(str(tmp_path), "other")
    (tmp_path / "done.json").write_text('{"fingerprint": "ke')  # torn by a crash of an older writer
    assert not stage_done(str(tmp_path), "key")
    (tmp_path / "done.json").write_text("[]")
    assert not stage_done(str(tmp_path), "key")


def test_a_named_working_folder_is_deleted_only_if_dflash_made_it(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "scratch"
    (elsewhere / "someone").mkdir(parents=True)
    (elsewhere / "someone" / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="holds files that dflash did not write"):
        remove_owned_dir(str(elsewhere), str(run_dir))
    assert (elsewhere / "someone" / "thesis.tex").is_file()

    made = tmp_path / "cache"
    make_owned_dir(str(made))
    (made / "s0000000000.safetensors").write_text("x")
    remove_owned_dir(str(made), str(run_dir))
    assert not made.exists()
    remove_owned_dir(str(made), str(run_dir))  # already gone: fine

    inside = run_dir / "feature_cache"  # the run's own folder, e.g. left by a run from before the marker
    inside.mkdir(parents=True)
    (inside / "0.safetensors").write_text("x")
    remove_owned_dir(str(inside), str(run_dir))
    assert not inside.exists()


def test_going_back_to_earlier_settings_resumes_their_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    a, b = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
    claim_checkpoint_dir(str(folder), a)
    (folder / "latest").write_text("step7 of A")
    assert claim_checkpoint_dir(str(folder), b) == f"{folder}.{a}"
    (folder / "latest").write_text("step3 of B")
    assert claim_checkpoint_dir(str(folder), a) == f"{folder}.{b}"
    assert (folder / "latest").read_text() == "step7 of A"  # restored, not deleted
    assert claim_checkpoint_dir(str(folder), a) is None
    assert (tmp_path / f"checkpoints.{b}" / "latest").read_text() == "step3 of B"


def test_atomic_write_syncs_the_file_and_its_folder_and_leaves_no_temp(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    path = tmp_path / "out.json"
    atomic_write(path, "old")
    atomic_write(path, b"new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]
    temp = temp_path(path)
    assert os.path.dirname(temp) == str(tmp_path) and os.path.basename(temp) == f".out.json.tmp-{os.getpid()}"
    assert synced == [temp, str(tmp_path)] * 2  # the file before its rename, the folder after


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="killed"), atomic_path(path) as temp:
        with open(temp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["weights.bin"]


def test_a_folder_swapped_in_is_synced_file_by_file_and_its_parent_after(tmp_path, monkeypatch):
    new, target = tmp_path / "new", tmp_path / "export"
    (new / "sub").mkdir(parents=True)
    (new / "config.json").write_text("{}")
    (new / "sub" / "weights.bin").write_bytes(b"w")
    target.mkdir()
    (target / "old.json").write_text("old")
    synced, fsync = [], os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    swap_in_dir(str(new), str(target), aside=str(tmp_path / "export.old"))
    assert sorted(os.listdir(target)) == ["config.json", "sub"] and sorted(os.listdir(tmp_path)) == ["export"]
    assert set(synced[:-1]) == {str(new / "config.json"), str(new / "sub" / "weights.bin"), str(new / "sub"), str(new)}
    assert synced[-1] == str(tmp_path)


def test_swap_in_dir_clears_an_aside_folder_left_by_a_killed_swap(tmp_path):
    """A swap killed after the new folder took its place but before the old one was deleted leaves `aside` behind;
    the next swap replaces `target` all the same (os.replace cannot move a folder onto a non-empty one)."""
    target, aside = tmp_path / "best", tmp_path / "best.old"
    target.mkdir()
    (target / "weights").write_text("current")
    aside.mkdir()
    (aside / "weights").write_text("older")
    new = tmp_path / "best.tmp"
    new.mkdir()
    (new / "weights").write_text("newer")
    swap_in_dir(str(new), str(target), aside=str(aside))
    assert (target / "weights").read_text() == "newer"
    assert sorted(os.listdir(tmp_path)) == ["best"]


def test_a_training_that_failed_before_its_first_step_leaves_no_folder_aside_with_its_wandb_run(tmp_path):
    """wandb opens its (offline) run before the engine is built: a training that failed there left wandb/, which
    now travels with the checkpoints it moves aside, and kept that folder of a training that trained nothing."""
    from dflash.stages.train import removed_if_untrained

    def moved(name: str, log: str) -> str:
        folder = tmp_path / name
        (folder / "wandb" / "offline-run-20261207_170000-abc").mkdir(parents=True)
        for record in ("fingerprint.json", "settings.json", "config.yaml"):
            (folder / record).write_text("{}")
        (folder / "metrics.jsonl").write_text(log)
        return str(folder)

    assert removed_if_untrained(moved("failed", "")) and not (tmp_path / "failed").exists()
    assert not removed_if_untrained(moved("trained", '{"step": 1}\n')) and (tmp_path / "trained" / "wandb").is_dir()
