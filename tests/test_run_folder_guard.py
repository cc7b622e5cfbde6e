"""A trained run is never lost: a command of other data, capture or train settings is refused before any work in a
run folder that holds a trained drafter, and overwrite=true moves that drafter aside (never deletes it)."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from dflash.config import ConfigError, compose
from dflash.pipeline import Pipeline

TINY = ["+experiment=tiny", "show_progress=false"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(folder) -> dict[str, str]:
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return files


def test_commands_of_other_settings_leave_a_trained_run_byte_identical(tmp_path, monkeypatch):
    run = TINY + [f"run_dir={tmp_path}"]
    summary = Pipeline(compose(run)).run()
    before = snapshot(tmp_path)
    refused = [
        ["train.epochs=4", "drafter.target_layer_ids=[0,2]"],
        ["data.limit=16", "stages=[data]"],                      # only the data stage, still the drafter's data
        ["capture.dtype=bfloat16", "stages=[capture,train]"],
    ]
    messages = []
    for change in refused:
        with pytest.raises(ConfigError, match="holds a drafter trained with other settings") as error:
            Pipeline(compose(run + change)).run()
        messages.append(str(error.value))
        assert snapshot(tmp_path) == before, change
    # A tap the target lacks fails before any stage, the run folder untouched too.
    with pytest.raises(ConfigError, match=r"drafter.target_layer_ids=\[0, 40\]: \[40\] outside the target's"):
        Pipeline(compose(run + ["train.epochs=4", "drafter.target_layer_ids=[0,40]"])).run()
    assert snapshot(tmp_path) == before
    assert "train.epochs: 3 -> 4" in messages[0]
    assert "drafter.target_layer_ids: null (automatic: [1,5]) -> [0,2]" in messages[0]
    assert f"run_dir={tmp_path}-2;" in messages[0] and "overwrite=true" in messages[0]
    assert "data.limit: 32 -> 16" in messages[1]
    # Other eval settings are another look at the same drafter: allowed, into their own folder. Each command that
    # runs adds its console log under logs/; every file of the trained run stays as it was.
    Pipeline(compose(run + ["stages=[eval]", f"eval.out_dir={tmp_path.parent / 'other_eval'}"])).run()
    again = Pipeline(compose(run)).run()  # the good command: everything up to date, the same drafter evaluated
    assert again["overall"] == summary["overall"]
    after = snapshot(tmp_path)
    assert {k: after[k] for k in before} == before
    assert all(k.startswith("logs" + os.sep) for k in set(after) - set(before))
    # The automatic taps named are the drafter's own, as its training recorded them, not those of features
    # captured since (a capture command of other taps, stages=[capture]).
    from dflash.stages.capture import CaptureStage
    monkeypatch.setattr(CaptureStage, "layer_ids", lambda self, mode=None: [0, 3])
    with pytest.raises(ConfigError, match=r"target_layer_ids: null \(automatic: \[1,5\]\) -> \[0,2\]"):
        Pipeline(compose(run + ["drafter.target_layer_ids=[0,2]"])).run()


def test_the_command_refuses_with_one_line_naming_what_changed(tmp_path):
    run_dir = tmp_path / "run"
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[data,capture,train]", "train.epochs=1"])).run()
    before = snapshot(run_dir)
    done = subprocess.run([sys.executable, "-m", "dflash.train", *TINY, f"run_dir={run_dir}", "train.epochs=2"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "train.epochs: 1 -> 2" in done.stderr
    assert f"run_dir={run_dir}-2;" in done.stderr  # given outright: name= would not move it
    assert snapshot(run_dir) == before  # not even a log of Hydra's (conf/train.yaml: it writes none)


def test_overwrite_moves_the_trained_drafter_aside_and_going_back_restores_it(tmp_path, monkeypatch):
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train]", "train.epochs=1"]
    Pipeline(compose(run)).run()
    first = snapshot(tmp_path / "export")
    Pipeline(compose(run + ["train.lr=0.05", "overwrite=true"])).run()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and snapshot(aside[0] / "export") == first  # moved with its checkpoints, not deleted
    assert snapshot(tmp_path / "export") != first
    second = snapshot(tmp_path / "export")
    with pytest.raises(ConfigError, match=r"target_layer_ids=\[0, 40\]"):  # an overwrite that fails before training
        Pipeline(compose(run + ["train.lr=0.07", "overwrite=true", "drafter.target_layer_ids=[0,40]"])).run()
    assert snapshot(aside[0] / "export") == first and snapshot(tmp_path / "export") == second

    def must_not_train(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr("dflash.train.loop.train", must_not_train)
    # The drafter moved aside as a folder whose train stage marked its export: its done.json in export/ alone.
    os.remove(aside[0] / "done.json")
    shutil.rmtree(aside[0] / "final")
    Pipeline(compose(run + ["overwrite=true"])).run()  # back: the first drafter returns, nothing retrained
    assert snapshot(tmp_path / "export") == first
    assert (tmp_path / "checkpoints" / "done.json").read_text() == (tmp_path / "export" / "done.json").read_text()
    assert sum(p.name.startswith("checkpoints.") for p in tmp_path.iterdir()) == 1


def test_overwrite_keeps_the_outputs_of_a_drafter_whose_checkpoints_were_deleted(tmp_path, monkeypatch):
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train,export]", "train.epochs=1"]
    Pipeline(compose(run)).run()
    first, metrics = snapshot(tmp_path / "export"), (tmp_path / "metrics.jsonl").read_text()
    shutil.rmtree(tmp_path / "checkpoints")  # kept the export, freed the disk
    with pytest.raises(ConfigError, match="holds a drafter trained with other settings"):
        Pipeline(compose(run + ["train.lr=0.05"])).run()
    Pipeline(compose(run + ["train.lr=0.05", "overwrite=true"])).run()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and snapshot(aside[0] / "export") == first
    assert (aside[0] / "metrics.jsonl").read_text() == metrics
    assert snapshot(tmp_path / "export") != first

    def must_not_train(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr("dflash.train.loop.train", must_not_train)
    Pipeline(compose(run + ["overwrite=true"])).run()  # back: its export returns and is adopted, nothing retrained
    assert snapshot(tmp_path / "export") == first and (tmp_path / "metrics.jsonl").read_text() == metrics


def test_another_rank_count_keeps_a_finished_training_and_refuses_to_resume_an_unfinished_one(tmp_path):
    """A rank count is not a setting: a training these settings finished on 1 rank is kept by a launch of 2 (export
    included), while an unfinished one, whose steps count another global batch, is refused before any work."""
    from dflash.config.errors import RunFolderError

    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train,export]", "train.epochs=1"]
    Pipeline(compose(run)).run()
    two = Pipeline(compose(run))
    two.context.world_size = 2
    assert two.train.up_to_date() and two.export.up_to_date()
    two.train.preflight(selected=True)  # finished: nothing to resume
    os.remove(tmp_path / "checkpoints" / "done.json")  # as if killed before the end
    one = Pipeline(compose(run))
    one.train.preflight(selected=True)  # its own rank count resumes it
    two = Pipeline(compose(run))
    two.context.world_size = 2
    assert not two.train.up_to_date()
    with pytest.raises(RunFolderError, match=r"trained on 1 rank\(s\) with a global batch of (\d+) samples; this "
                                             r"launch of 2 rank\(s\) has"):
        two.train.preflight(selected=True)


def test_a_refusal_names_no_config_file_when_none_was_kept(tmp_path):
    from dflash.config.errors import RunFolderError

    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train]", "train.epochs=1"]
    Pipeline(compose(run)).run()
    for config in (tmp_path / "config.yaml", tmp_path / "checkpoints" / "config.yaml"):
        config.unlink()
    with pytest.raises(RunFolderError, match=r"other settings \(its config.yaml was not kept\); nothing") as error:
        Pipeline(compose(run[:-1] + ["train.epochs=2"])).run()
    assert "see " not in str(error.value)
    with pytest.raises(RunFolderError, match="This command trains nothing") as error:
        Pipeline(compose(run[:-2] + ["stages=[eval]", "train.epochs=2"])).run()
    assert "its settings:" not in str(error.value)


def fail_training_at_its_start(overrides: list[str], monkeypatch) -> None:
    """The command of `overrides`, its training failing before its first step (out of memory)."""

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (a test)")

    with monkeypatch.context() as patch:
        patch.setattr("dflash.train.loop.train", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            Pipeline(compose(overrides)).run()


def test_a_training_that_failed_before_its_first_step_leaves_no_folder_behind(tmp_path, monkeypatch):
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train]", "train.epochs=1"]
    Pipeline(compose(run)).run()
    good = snapshot(tmp_path / "checkpoints")
    fail_training_at_its_start(run + ["train.lr=0.05", "overwrite=true"], monkeypatch)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert snapshot(aside).items() >= good.items()  # the trained drafter, moved aside with its outputs
    Pipeline(compose(run)).run()  # back: the good drafter returns; the failed one's settings are all it left
    assert snapshot(tmp_path / "checkpoints") == good
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    # A folder moved aside that holds anything more than a training's settings is kept.
    fail_training_at_its_start(run + ["train.lr=0.05", "overwrite=true"], monkeypatch)
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")
    Pipeline(compose(run)).run()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert (aside / "notes.txt").read_text() == "mine"


def test_a_data_change_that_moves_aside_a_training_of_settings_alone_removes_it(tmp_path, monkeypatch):
    """The data stage's overwrite=true moves the training in the folder aside (set_drafter_aside) as the train stage
    does: a trained drafter is kept, the settings of a training that failed before its first step are not."""
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train]", "train.epochs=1"]
    Pipeline(compose(run)).run()
    fail_training_at_its_start(run + ["data.max_new_tokens=17", "overwrite=true"], monkeypatch)
    (trained,) = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert (trained / "final").is_dir()
    # The failed training's settings are in checkpoints/ when the data changes again.
    fail_training_at_its_start(run + ["data.max_new_tokens=18", "overwrite=true"], monkeypatch)
    assert [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")] == [trained]


def killed_after_the_claim(monkeypatch):
    """The train stage's claim as a kill right after checkpoints/ moved (aside or back) leaves it: the outputs of the
    run folder not moved on from where the claim's renames left them (KeyboardInterrupt)."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed after the claim's renames")

    monkeypatch.setattr("dflash.stages.train.carry_trained_outputs", killed)


OUTPUTS = ("metrics.jsonl", "export", "eval", "training_curve.png")


def outputs_of(folder) -> dict[str, str]:
    return {k: v for k, v in snapshot(folder).items() if k.split(os.sep)[0] in OUTPUTS}


def test_a_kill_inside_overwrite_never_parts_a_drafter_from_its_outputs(tmp_path, monkeypatch):
    """overwrite=true moves a drafter aside with its outputs in one rename, and a restore brings them back out at
    the next command: a kill between never leaves one drafter's outputs beside another's checkpoints."""
    a = TINY + [f"run_dir={tmp_path}", "train.epochs=1"]
    b = a + ["train.lr=0.05", "overwrite=true"]
    Pipeline(compose(a)).run()
    trained_a = outputs_of(tmp_path)
    with monkeypatch.context() as patched:
        killed_after_the_claim(patched)
        with pytest.raises(KeyboardInterrupt):
            Pipeline(compose(b)).run()  # moving A aside for B
    aside = next(p for p in tmp_path.iterdir() if p.name.startswith("checkpoints."))
    assert outputs_of(aside) == trained_a and outputs_of(tmp_path) == {}  # moved with A's checkpoints
    Pipeline(compose(b)).run()  # the rerun trains B beside nothing of A's
    trained_b = outputs_of(tmp_path)
    assert outputs_of(aside) == trained_a and trained_b and trained_b != trained_a
    with monkeypatch.context() as patched:
        killed_after_the_claim(patched)
        with pytest.raises(KeyboardInterrupt):
            Pipeline(compose(a + ["overwrite=true"])).run()  # restoring A over B
    Pipeline(compose(a)).run()  # A's command again: up to date, with A's own outputs back out
    assert outputs_of(tmp_path) == trained_a
    b_aside = next(p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.") and p.name != aside.name)
    assert outputs_of(b_aside) == trained_b
