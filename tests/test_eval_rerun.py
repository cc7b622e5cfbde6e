"""An evaluation of other eval settings in a run folder's eval/: it replaces the earlier one whole once it has
finished, saying so; stopped before, it leaves eval/ and <run_dir>/config.yaml as they were, and the command of the
earlier settings still finds its evaluation up to date."""

from __future__ import annotations

import os
import shutil

import pytest

from dflash.config import compose
from dflash.pipeline import Pipeline
from tests.test_run_folder_guard import snapshot

# A short evaluation (no MT-Bench second turns to answer) of a drafter trained for one epoch.
TINY = ["+experiment=tiny", "show_progress=false", "train.epochs=1", "~eval.prompt_sets.mtbench"]
OTHER_EVAL = "eval.prompt_sets.gsm8k.limit=1"


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("evaluated")
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    return run_dir


@pytest.fixture
def run_dir(evaluated_run, tmp_path):
    copied = tmp_path / "run"
    shutil.copytree(evaluated_run, copied)
    return copied


def forbid_evaluating(monkeypatch) -> None:
    monkeypatch.setattr("dflash.eval.evaluate.evaluate", lambda *args, **kwargs: pytest.fail("evaluated again"))


def hidden(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


def test_an_interrupted_evaluation_of_other_eval_settings_changes_nothing(run_dir, monkeypatch, capsys):
    from dflash.eval import evaluate

    before, config = snapshot(run_dir / "eval"), (run_dir / "config.yaml").read_bytes()
    written = evaluate.write_summary

    def interrupted(summary, out_dir):
        written(summary, out_dir)  # the new evaluation's files are written, not yet in eval/'s place
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "write_summary", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", OTHER_EVAL])).run()
    assert snapshot(run_dir / "eval") == before and (run_dir / "config.yaml").read_bytes() == config
    assert hidden(run_dir) == []

    forbid_evaluating(monkeypatch)
    capsys.readouterr()
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    out = capsys.readouterr().out
    assert f"[eval] up to date (its table, measured before, follows): {run_dir / 'eval'}" in out
    assert "overall" in out and "time (s):" not in out  # the table without the seconds of a command before


def test_a_killed_evaluation_s_folder_is_removed_by_the_next_command(run_dir, monkeypatch):
    left = run_dir / ".eval.tmp-4321"  # an evaluation killed (SIGKILL, a power loss) before its swap
    left.mkdir()
    (left / "summary.json").write_text("{}")
    forbid_evaluating(monkeypatch)
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert hidden(run_dir) == []


def test_a_finished_evaluation_of_other_eval_settings_replaces_the_earlier_one_saying_so(run_dir, capsys):
    capsys.readouterr()
    summary = Pipeline(compose(TINY + [f"run_dir={run_dir}", OTHER_EVAL])).run()
    out = capsys.readouterr().out
    assert f"[eval] replacing {run_dir / 'eval'} once this evaluation completes (measured with other eval settings: " \
           f"eval.prompt_sets.gsm8k.limit: 2 -> 1); to keep both, give eval.out_dir={run_dir / 'eval_2'} " \
           f"(Ctrl-C now leaves it as it is)" in out
    assert summary["prompt_sets"]["gsm8k"]["num_prompts"] == 1
    for config in (run_dir / "config.yaml", run_dir / "eval" / "config.yaml"):
        assert "limit: 1" in config.read_text()
    assert hidden(run_dir) == []
    # Up to date for the new settings; replaced again, without saying so, where no evaluation was finished there.
    Pipeline(compose(TINY + [f"run_dir={run_dir}", OTHER_EVAL])).run()
    assert "[eval] up to date" in capsys.readouterr().out
    shutil.rmtree(run_dir / "eval")
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert "replacing" not in capsys.readouterr().out


def test_what_else_the_evaluation_folder_holds_is_kept(run_dir):
    # A new evaluation replaces its folder whole: what it does not write there comes along.
    (run_dir / "eval" / "notes.txt").write_text("mine")
    (run_dir / "eval" / "mine").mkdir()
    (run_dir / "eval" / "mine" / "plot.png").write_bytes(b"png")
    (run_dir / "eval" / ".summary.json.tmp-5").write_text("{")  # a writer's temporary copy, killed: not carried
    Pipeline(compose(TINY + [f"run_dir={run_dir}", OTHER_EVAL])).run()
    assert not (run_dir / "eval" / ".summary.json.tmp-5").exists()
    assert (run_dir / "eval" / "notes.txt").read_text() == "mine"
    assert (run_dir / "eval" / "mine" / "plot.png").read_bytes() == b"png"


@pytest.mark.parametrize("new_is_done", [True, False])
def test_an_evaluation_killed_between_the_swaps_renames_leaves_one_whole_folder(run_dir, new_is_done, monkeypatch,
                                                                                capsys):
    """A kill between swap_in_dir's two renames leaves no eval/, the earlier evaluation set aside and the new one
    beside it: the next command puts the new one in place where it is marked done, else the earlier one back."""
    from dflash.run_files import temp_path

    eval_dir = run_dir / "eval"
    new = temp_path(str(eval_dir))
    shutil.copytree(eval_dir, new)
    with open(f"{new}/summary.csv", "a") as f:
        f.write("# the new evaluation's\n")
    if not new_is_done:
        os.remove(f"{new}/done.json")
    expected = snapshot(new) if new_is_done else snapshot(eval_dir)
    eval_dir.rename(f"{new}.old")
    forbid_evaluating(monkeypatch)
    capsys.readouterr()
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert "[eval] up to date" in capsys.readouterr().out
    assert snapshot(eval_dir) == expected
    assert hidden(run_dir) == []


def test_an_evaluation_into_another_drafters_evaluation_folder_is_refused_before_any_work(run_dir, tmp_path,
                                                                                         monkeypatch):
    """eval.out_dir naming another run's evaluation folder replaced its results without a word about the drafter;
    now the command stops first, naming a free folder."""
    from dflash.config import ConfigError

    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    # Another training's drafter: its evaluation's done.json names another checkpoint fingerprint.
    done = other / "eval" / "done.json"
    done.write_text(done.read_text().replace('"checkpoint": "', '"checkpoint": "0ther'))
    before = snapshot(other)
    forbid_evaluating(monkeypatch)
    command = TINY + [f"run_dir={run_dir}", "stages=[eval]", f"eval.out_dir={other / 'eval'}"]
    with pytest.raises(ConfigError, match=f"^eval.out_dir={other / 'eval'} holds the evaluation of another drafter "
                                          rf"\(trained with settings 0ther.*give eval.out_dir={other / 'eval'}_2 "
                                          r"\(or remove that folder to measure this drafter there\)$"):
        Pipeline(compose(command)).run()
    assert snapshot(other) == before


@pytest.mark.parametrize("target", ["", "data", "checkpoints", "export", "mine"])
def test_an_evaluation_into_a_folder_of_other_files_is_refused_before_any_work(run_dir, tmp_path, monkeypatch,
                                                                               target):
    """eval.out_dir naming a run folder, a stage's folder or a folder of one's own: the evaluation took it over (its
    files carried into the evaluation's folder, a stage's done.json replaced by the evaluation's); now the command
    stops first. A copy of this run's checkpoints/ or export/, whose done.json names this drafter as an evaluation's
    does, too. An empty folder is taken."""
    from dflash.config import ConfigError

    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("eval"))
    folder = other / target if target != "mine" else tmp_path / "mine"
    if target == "mine":
        folder.mkdir()
        (folder / "notes.txt").write_text("mine\n")
    before = snapshot(folder)
    forbid_evaluating(monkeypatch)
    command = TINY + [f"run_dir={run_dir}", "stages=[eval]", f"eval.out_dir={folder}"]
    with pytest.raises(ConfigError, match=f"^eval.out_dir={folder} holds files that are no evaluation "):
        Pipeline(compose(command)).run()
    assert snapshot(folder) == before
    (tmp_path / "empty").mkdir()
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[eval]", f"eval.out_dir={tmp_path / 'empty'}"])
             ).eval.refuse_a_folder_of_other_files()


def test_another_drafters_evaluation_deeper_in_the_run_folder_is_refused(run_dir, monkeypatch):
    """overwrite=true moves the evaluations right in the run folder aside with their drafter, not those deeper
    (eval.out_dir=<run_dir>/evals/live): one of another drafter left there is refused like another run's."""
    from dflash.config import ConfigError

    nested = run_dir / "evals" / "live"
    shutil.copytree(run_dir / "eval", nested)
    done = nested / "done.json"
    done.write_text(done.read_text().replace('"checkpoint": "', '"checkpoint": "0ther'))
    before = snapshot(nested)
    forbid_evaluating(monkeypatch)
    with pytest.raises(ConfigError, match=f"^eval.out_dir={nested} holds the evaluation of another drafter"):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[eval]", f"eval.out_dir={nested}"])).run()
    assert snapshot(nested) == before


def test_a_run_copied_without_its_data_is_not_taken_for_another_drafter(run_dir):
    """The drafter an evaluation folder is compared with is the one its export records: a run folder copied without
    data/ and features/ (which its training's fingerprint is made from) keeps its evaluation up to date."""
    for folder in ("data", "features"):
        shutil.rmtree(run_dir / folder)
    # Deeper than the run folder's own evaluation folders, where the drafter is compared (its eval/ is not).
    shutil.copytree(run_dir / "eval", run_dir / "evals" / "replay")
    command = TINY + [f"run_dir={run_dir}", "stages=[eval]", f"eval.out_dir={run_dir / 'evals' / 'replay'}"]
    Pipeline(compose(command)).eval.refuse_another_drafters_evaluation()
