"""Run-folder files: done markers and the fingerprint that ties checkpoints to their run's settings."""

import json
import os

import pytest

from dflash.run_files import claim_checkpoint_dir, make_owned_dir, mark_done, remove_owned_dir, stage_done


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


def test_only_the_latest_moved_aside_checkpoints_are_kept(tmp_path):
    folder = tmp_path / "checkpoints"
    (tmp_path / "checkpoints.unfingerprinted").mkdir()  # moved aside by an earlier change: now deleted
    (tmp_path / "checkpoints_other").mkdir()  # not ours
    (tmp_path / "checkpoints.backup").mkdir()  # not ours either, though it starts like ours
    folder.mkdir()
    (folder / "latest").write_text("step2")
    assert claim_checkpoint_dir(str(folder), "ccc") == f"{folder}.unfingerprinted"
    assert (tmp_path / "checkpoints.unfingerprinted" / "latest").read_text() == "step2"
    (folder / "latest").write_text("step9")
    assert claim_checkpoint_dir(str(folder), "ddd") == f"{folder}.ccc"
    assert claim_checkpoint_dir(str(folder), "0123456789abcdef") == f"{folder}.ddd"
    (folder / "latest").write_text("step1")
    assert claim_checkpoint_dir(str(folder), "fedcba9876543210") == f"{folder}.0123456789abcdef"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoints", "checkpoints.0123456789abcdef", "checkpoints.backup", "checkpoints.ccc", "checkpoints.ddd",
        "checkpoints_other"]  # short test keys are not fingerprints: kept


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

    made = tmp_path / "spool"
    make_owned_dir(str(made))
    (made / "item").write_text("x")
    remove_owned_dir(str(made), str(run_dir))
    assert not made.exists()
    remove_owned_dir(str(made), str(run_dir))  # already gone: fine

    inside = run_dir / "feature_cache"  # the run's own folder, e.g. left by a run from before the marker
    inside.mkdir(parents=True)
    (inside / "0.safetensors").write_text("x")
    remove_owned_dir(str(inside), str(run_dir))
    assert not inside.exists()


def test_an_older_moved_aside_fingerprint_folder_is_deleted_when_another_moves_aside(tmp_path):
    folder = tmp_path / "checkpoints"
    for key in ("0123456789abcdef", "fedcba9876543210", "aaaaaaaaaaaaaaaa"):
        claim_checkpoint_dir(str(folder), key)
        (folder / "latest").write_text(key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "checkpoints.fedcba9876543210"]
    assert (tmp_path / "checkpoints.fedcba9876543210" / "latest").read_text() == "fedcba9876543210"


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
