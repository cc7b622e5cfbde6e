"""The block a run ends with (dflash/stages/closing.py), made of the rows each stage gives, and a runner
(dflash/pipeline.py) that names no stage."""

import ast
import json
import os
from types import SimpleNamespace

import pytest

from dflash.config import compose
from dflash.config.schema import STAGES
from dflash.pipeline import Pipeline
from dflash.stages.closing import closing_block, next_command_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finished_run(tmp_path, overall_tau: float, *overrides: str) -> Pipeline:
    """A pipeline whose run folder holds an export, a best checkpoint, a curve and metrics, and whose eval stage
    measured `overall_tau`."""
    pipeline = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}", *overrides]))
    os.makedirs(pipeline.export.out)
    os.makedirs(pipeline.export.best)
    (tmp_path / "run" / "export" / "done.json").write_text("{}")
    (tmp_path / "run" / "export" / "config.json").write_text("{}")
    (tmp_path / "run" / "export_best" / "best.json").write_text(json.dumps({"step": 5, "tau": 2.345}))
    (tmp_path / "run" / "export_best" / "config.json").write_text("{}")
    (tmp_path / "run" / "training_curve.png").write_text("")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    os.makedirs(pipeline.eval.out)
    (tmp_path / "run" / "eval" / "summary.json").write_text("{}")
    (tmp_path / "run" / "eval" / "per_position.png").write_text("")
    pipeline.eval.summary = {"prompt_sets": {"a": {"tau": 1.2}, "b": {"tau": 2.0}}, "overall": {"tau": overall_tau}}
    return pipeline


def test_the_closing_block_names_the_outputs_tau_and_the_next_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipeline = finished_run(tmp_path, 2.5)
    assert closing_block(pipeline.context.run_dir, pipeline.stages, str(tmp_path / "run" / "logs" / "x.log")) == """\
== done: run ==
  drafter (z-lab format)      run/export_best (the best held-out checkpoint, step 5, held-out tau 2.35; what eval \
measures)   serve it with vLLM or SGLang (docs/serving.md)
  final weights               run/export (eval.checkpoint=final measures them)
  training curve              run/training_curve.png
  metrics per step            run/metrics.jsonl
  evaluation                  run/eval/: summary.json, per_position.png
  tau                         a 1.20, b 2.00; overall 2.50
  console log                 run/logs/x.log
  on disk                     33 B in run (export_best 27 B, export 4 B)
  A tiny random-weight target: its tau shows that the pipeline runs end to end, not how good a drafter is (a random \
target's answers repeat themselves). A real drafter: python -m dflash.train on a machine with a GPU (the real SmolLM2 \
target, about 10 minutes).
  next: real decoding         python -m dflash.eval name=tiny eval.mode=live eval.out_dir=run/eval_live"""


def test_the_drafter_named_to_serve_is_the_one_eval_measures(tmp_path, monkeypatch):
    """The block said to serve export/ while its tau was export_best/'s (eval.checkpoint=best, the default)."""
    monkeypatch.chdir(tmp_path)
    rows = dict(finished_run(tmp_path, 2.5, "eval.checkpoint=final").export.closing_rows())
    assert rows["drafter (z-lab format)"] == "run/export   serve it with vLLM or SGLang (docs/serving.md)"
    assert rows["best held-out checkpoint"] == "run/export_best (step 5, held-out tau 2.35)"
    (tmp_path / "run" / "export_best" / "config.json").unlink()  # its marks alone (a folder copied without it)
    rows = dict(Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}"])).export.closing_rows())
    assert rows["drafter (z-lab format)"] == "run/export   serve it with vLLM or SGLang (docs/serving.md)"
    (tmp_path / "run" / "export_best" / "best.json").unlink()  # no best kept (data.heldout=0)
    rows = dict(Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}"])).export.closing_rows())
    assert rows["drafter (z-lab format)"] == "run/export   serve it with vLLM or SGLang (docs/serving.md)"
    assert "final weights" not in rows and "best held-out checkpoint" not in rows


def test_a_short_cpu_run_ends_with_a_note_and_a_live_one_with_no_next_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cpu = finished_run(tmp_path, 1.2, "device=cpu")
    cpu.context.settings.target.kind = "smollm2"  # the CPU demo's target (the note of a tiny one is the one above)
    block = closing_block(cpu.context.run_dir, cpu.stages, "x.log").splitlines()
    assert block[-3] == "  console log                 x.log" and block[-2].startswith("  on disk ")
    assert block[-1].startswith("  This was a short CPU run: a drafter trained for minutes on a CPU")
    assert "+experiment=smollm2_quick" in block[-1]
    other = finished_run(tmp_path / "other", 1.2, "device=cpu")
    other.context.settings.target.kind = "hf"  # another target: the SmolLM2 recipe's commands are not its own
    note = closing_block(other.context.run_dir, other.stages, "x.log").splitlines()[-1]
    assert "A real drafter: this target on a machine with a GPU" in note and "smollm2_quick" not in note
    live = finished_run(tmp_path / "live", 2.5, "eval.mode=live")
    live.context.settings.target.kind = "smollm2"
    assert closing_block(live.context.run_dir, live.stages, "x.log").splitlines()[-1].startswith("  on disk ")


def test_a_run_that_made_nothing_names_its_console_log_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipeline = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}"]))
    assert closing_block(pipeline.context.run_dir, pipeline.stages, "x.log") == \
        "== done: run ==\n  console log                 x.log"


def test_the_loggers_folders_are_named_with_the_command_that_shows_each(tmp_path, monkeypatch):
    from dflash.stages.export import logger_rows

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "my run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "wandb" / "run-20261206_110000-abc").mkdir(parents=True)  # an online run: on wandb's site already
    (run / "wandb" / "latest-run").symlink_to("run-20261206_110000-abc")
    assert logger_rows(str(run)) == [("TensorBoard", "tensorboard --logdir 'my run/tensorboard'")]
    (run / "wandb" / "offline-run-20261206_120000-def").mkdir()  # wandb.mode=offline, the default
    (run / "wandb" / "latest-run").unlink()
    (run / "wandb" / "latest-run").symlink_to("offline-run-20261206_120000-def")
    assert logger_rows(str(run))[1] == ("wandb (offline)", "wandb sync 'my run/wandb/offline-run-20261206_120000-def'")
    # A training resumed after a stop starts a wandb run each time: the block named the last alone. (Those of a
    # drafter of other settings move aside with it: TRAINED_OUTPUTS.)
    (run / "wandb" / "offline-run-20261205_090000-old").mkdir()
    assert logger_rows(str(run))[1] == ("wandb (offline)", "wandb sync 'my run/wandb'/offline-run-*   (2 runs, one per "
                                                           "start of the training)")


def test_the_run_folders_size_names_its_two_largest_entries(tmp_path, monkeypatch):
    from dflash.stages.closing import disk_use, readable_bytes

    for name, size in (("features/shard-0", 3_000_000), ("features/shard-1", 400_000), ("checkpoints/a", 870_000),
                       ("config.yaml", 4_000)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    assert disk_use(str(tmp_path)) == f"4.27 MB in {tmp_path} (features 3.4 MB, checkpoints 870 kB)"
    assert [readable_bytes(n) for n in (0, 999, 87_400_000, 99_960_000, 999_700_000, 1_250_000_000)] == \
        ["0 B", "999 B", "87.4 MB", "100 MB", "1 GB", "1.25 GB"]
    monkeypatch.setattr(os, "lstat", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert disk_use(str(tmp_path)) == f"0 B in {tmp_path}"  # files gone while they were counted: no error


def test_the_runner_names_no_stage():
    """What is particular to a stage lives in its object (dflash/stages/): the runner holds no stage's name."""
    with open(os.path.join(REPO, "dflash", "pipeline.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    named = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in STAGES]
    assert named == []


def test_the_next_command_is_quoted_for_a_shell(tmp_path, monkeypatch):
    """A list override is a glob to bash and zsh, and a run folder may hold a space: each word is quoted where it
    needs to be, so the line pastes into a shell as it is."""
    import shlex

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dflash.stages.evaluation.command_overrides",
                        lambda settings: ["name=tiny", "drafter.target_layer_ids=[1,3]"])
    pipeline = finished_run(tmp_path / "my runs", 2.5)
    line = closing_block(pipeline.context.run_dir, pipeline.stages, "x.log").splitlines()[-1]
    command = line.split("next: real decoding", 1)[1].strip()
    assert shlex.split(command) == ["python", "-m", "dflash.eval", "name=tiny", "drafter.target_layer_ids=[1,3]",
                                    "eval.mode=live", "eval.out_dir=my runs/run/eval_live"]
    assert "'drafter.target_layer_ids=[1,3]'" in command


def test_evaluating_a_run_folder_that_does_not_exist_names_it_and_the_runs_beside_it(tmp_path, monkeypatch):
    """A misspelt name= was blamed on unfinished training, and the command left an empty run folder behind."""
    import subprocess
    import sys

    import pytest

    from dflash.config.errors import NothingToEvaluate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "good").mkdir(parents=True)
    (tmp_path / "runs" / "good" / "config.yaml").write_text("")
    with pytest.raises(NothingToEvaluate, match=r"no run folder runs/godo to evaluate \(runs in runs: good\)"):
        Pipeline(compose(["+experiment=tiny", "run_dir=runs/godo", "stages=[eval]"])).run()
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "-m", "dflash.eval", "+experiment=tiny", "run_dir=runs/godo",
                           "overwrite=true", "eval.temperature=1.0"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("dflash: error: no run folder runs/godo to evaluate")
    # The training command it suggests is this command's settings: not its evaluation's, never overwrite=true.
    assert done.stderr.rstrip().endswith("or train it first with python -m dflash.train +experiment=tiny "
                                         "run_dir=runs/godo")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["good"]  # nothing left behind


def test_evaluating_a_run_folder_whose_drafters_were_moved_aside_says_so(tmp_path):
    """After a data-only overwrite=true moved the drafter aside, the eval said there was no such run folder."""
    import pytest

    from dflash.config.errors import NothingToEvaluate

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints.0123456789abcdef").mkdir(parents=True)
    (run_dir / "data").mkdir()
    with pytest.raises(NothingToEvaluate, match=r"holds no drafter to evaluate: its drafters of other settings were "
                                                 r"moved aside \(checkpoints.0123456789abcdef\)"):
        Pipeline(compose(["+experiment=tiny", f"run_dir={run_dir}", "stages=[eval]"])).run()
    (run_dir / "checkpoints.0123456789abcdef").rmdir()
    with pytest.raises(NothingToEvaluate, match="holds no drafter to evaluate: no drafter was trained there yet"):
        Pipeline(compose(["+experiment=tiny", f"run_dir={run_dir}", "stages=[eval]"])).run()
    # Data made by another command (dflash.extract +experiment=tiny): this command's training command would train
    # other settings there (it suggested `python -m dflash.train name=...`, the CPU demo's settings).
    (run_dir / "config.yaml").write_text("name: run\n")
    with pytest.raises(NothingToEvaluate, match=r"no drafter was trained there yet; train one with python -m "
                                                 r"dflash.train and the overrides its data were made with \(their "
                                                 r"settings: .*run/config.yaml\)$"):
        Pipeline(compose(["+experiment=tiny", f"run_dir={run_dir}", "stages=[eval]"])).run()


def test_a_command_that_stops_short_of_evaluation_names_the_next_command(tmp_path, monkeypatch):
    """dflash.extract (data and capture) is followed by training (by evaluation where the drafter is trained),
    stages=[train] by evaluation."""
    monkeypatch.chdir(tmp_path)
    pipeline = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}"]))

    def last_row(selected, context=pipeline.context, trained=False):
        return closing_block(pipeline.context.run_dir, pipeline.stages, "x.log",
                             next_command_rows(context, selected, trained)).splitlines()[-1]

    assert last_row(["data", "capture"]) == "  next: training              python -m dflash.train name=tiny"
    # A run whose drafter these settings trained already: its evaluation is next, not its training again.
    assert last_row(["data", "capture"], trained=True) == \
        "  next: evaluation            python -m dflash.eval name=tiny"
    assert last_row(["train", "export"]) == "  next: evaluation            python -m dflash.eval name=tiny"
    assert last_row(["data", "capture", "train", "export", "eval"]) == "  console log                 x.log"
    ranks = SimpleNamespace(settings=pipeline.context.settings, world_size=2)  # a launcher's: its training too
    assert last_row(["data", "capture"], ranks).endswith("python -m dflash.train name=tiny (with the same launcher)")
    assert last_row(["train", "export"], ranks).endswith("python -m dflash.eval name=tiny")  # one process


def test_a_data_stage_alone_ends_with_the_training_command(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path / 'run'}", "data.limit=3",
                      "stages=[data]"])).run()
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == \
        "  next: training              python -m dflash.train name=tiny"


MIXED_LAYERS_ENGINES = "SGLang, or a vLLM with PR 40898 for mixed sliding and full drafter layers"


@pytest.mark.parametrize("layer_types,engines", [(["full_attention"], "vLLM or SGLang"),
                                                 (["sliding_attention", "full_attention"], MIXED_LAYERS_ENGINES)])
def test_the_serving_line_of_an_export_without_a_chat_template(tmp_path, layer_types, engines):
    from dflash.stages.export import serving_line

    (tmp_path / "config.json").write_text(json.dumps({"layer_types": layer_types}))
    assert serving_line(str(tmp_path)) == f"serve it with {engines} (docs/serving.md)"


def test_the_next_evaluation_command_names_each_eval_setting_it_changes_once(tmp_path, monkeypatch):
    """An evaluation given eval.out_dir (or eval.mode) is followed by the live one in its own folder: the command
    repeats the others, not those two, which it gives anew."""
    import dflash.stages.evaluation as evaluation

    stage = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}"])).eval
    stage.summary = {"overall": {"tau": 2.0}}
    monkeypatch.setattr(evaluation, "command_overrides",
                        lambda settings: ["name=tiny", "eval.out_dir=elsewhere", "eval.mode=replay"])
    command = stage.next_rows()[-1][1]
    assert command.count("eval.out_dir=") == 1 and command.count("eval.mode=") == 1
    assert command.startswith("python -m dflash.eval name=tiny eval.mode=live eval.out_dir=")
