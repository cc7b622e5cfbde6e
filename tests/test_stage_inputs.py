"""A stage whose input stage the command does not run refuses, before any work, an input that is not finished for
these settings, naming the stages to add: capture without the data stage, training without capture (features of
another capture setting), the export without training. A data stage rebuilt with overwrite=true moves the drafter
trained on the data it replaces aside, so that no later command pairs that drafter with other data or trains over
it; the command of its settings brings it back untrained."""

import shutil

import pytest

from dflash.config import compose
from dflash.config.errors import RunFolderError
from dflash.pipeline import Pipeline
from dflash.run_files import folder_checksums, read_json
from tests.test_pipeline import forbid_every_stage

TINY = ["+experiment=tiny", "show_progress=false", "train.epochs=1"]


def must_not_run(*args, **kwargs):
    raise AssertionError("captured or trained")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[data,capture,train]"])).run()
    return run_dir


@pytest.mark.parametrize("change, message", [
    (["stages=[train]", "capture.dtype=bfloat16"],
     r"/features is not captured for these settings: add capture to stages \(stages=\[capture,train\]\)$"),
    (["stages=[capture,train]", "data.limit=16"],
     r"/data is not built for these settings: add data to stages \(stages=\[data,capture,train\]\)$"),
    (["stages=[train]", "data.limit=16"],
     r"/features is not captured for these settings: add data and capture to stages \(stages=\[data,capture,train\]\)"),
    (["stages=[data,train]"], r"this command runs the data stage but not capture, so \S+/features would not follow "
                              r"what it makes: add capture to stages \(stages=\[data,capture,train\]\)"),
    (["stages=[export]"], r"/checkpoints is not trained for these settings: add train to stages "
                          r"\(stages=\[train,export\]\)"),
])
def test_an_input_stage_the_command_does_not_run_must_be_finished(trained, tmp_path, monkeypatch, change, message):
    run_dir = tmp_path / "run"
    for folder in ("data", "features"):  # captured, not trained
        shutil.copytree(trained / folder, run_dir / folder)
    before = folder_checksums(run_dir)
    forbid_every_stage(monkeypatch)
    with pytest.raises(RunFolderError, match=message):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", *change])).run()
    assert folder_checksums(run_dir) == before and not (run_dir / "checkpoints").exists()


def test_a_finished_stage_needs_no_finished_input(trained, tmp_path, monkeypatch):
    """Features deleted after training (they are large), and the layout where training and export were one stage
    (export/done.json its only marker): the trained drafter is kept, nothing captured again."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    shutil.rmtree(run_dir / "features")
    forbid_every_stage(monkeypatch)
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[train]"])).run()
    shutil.copytree(trained / "features", run_dir / "features")
    (run_dir / "features" / "done.json").unlink()  # not captured for these settings
    (run_dir / "checkpoints" / "done.json").unlink()
    shutil.rmtree(run_dir / "checkpoints" / "final")
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[train]"])).run()
    assert read_json(str(run_dir / "checkpoints" / "done.json")) == read_json(str(run_dir / "export" / "done.json"))


def test_a_data_stage_rebuilt_with_overwrite_moves_the_drafter_aside_and_its_settings_bring_it_back(
        trained, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    command = TINY + [f"run_dir={run_dir}"]
    exported = folder_checksums(run_dir / "export")
    aside = run_dir / f"checkpoints.{read_json(str(run_dir / 'checkpoints' / 'fingerprint.json'))['fingerprint']}"
    Pipeline(compose(command + ["stages=[data]", "data.limit=16", "overwrite=true"])).run()
    assert read_json(str(run_dir / "data" / "stats.json"))["total"] == 16
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "export").exists()
    assert folder_checksums(aside / "export") == exported
    monkeypatch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
    monkeypatch.setattr("dflash.train.loop.train", must_not_run)
    # The drafter's own settings: its features are not of the data now there, nor is anything trained on it.
    for stages in ("[capture,train]", "[train]"):
        with pytest.raises(RunFolderError, match=r"add data (and capture )?to stages \(stages=\[data,capture,train\]"):
            Pipeline(compose(command + [f"stages={stages}"])).run()
    Pipeline(compose(command + ["stages=[data,capture,train]"])).run()  # its data again, and the drafter back
    assert folder_checksums(run_dir / "export") == exported and not aside.exists()


def test_a_data_stage_with_failed_prompts_feeds_the_capture_stage_of_another_command(tmp_path, monkeypatch):
    """A build whose failed prompts are left out has no done marker (a rerun retries them) but is built for these
    settings: launch/one_node.sh's capture step after its data step captures it."""
    import dflash.data.regenerate as regenerate

    answers = regenerate._journal_answers

    def one_fails(journal, pending, results, *args, **kwargs):
        failing = ((i, RuntimeError("out of memory") if n == 0 else out) for n, (i, out) in enumerate(results))
        return answers(journal, pending, failing, *args, **kwargs)

    run = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}"]
    with monkeypatch.context() as patch:
        patch.setattr(regenerate, "_journal_answers", one_fails)
        Pipeline(compose(run + ["stages=[data]"])).run()
    assert not (tmp_path / "data" / "done.json").exists()
    Pipeline(compose(run + ["stages=[capture]"])).run()
    assert (tmp_path / "features" / "done.json").exists()
