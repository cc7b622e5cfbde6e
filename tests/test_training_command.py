"""`python -m dflash.eval` takes the training settings of the run folder it finds from the training command that
folder records (dflash/config/training_command.py), its own overrides first."""

import json
import os
import subprocess
import sys

import yaml

from dflash.config.hydra_flags import before_flags, full_flag, split_arguments
from dflash.config.training_command import adopted, training_overrides, with_training_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(run_dir, command):
    os.makedirs(run_dir / "checkpoints", exist_ok=True)
    (run_dir / "checkpoints" / "settings.json").write_text(json.dumps({"fingerprint": "f", "command": command}))


def test_an_evaluation_adopts_what_it_does_not_set_itself(tmp_path):
    record(tmp_path, ["+experiment=tiny", "train.seed=1", "name=other", "run_dir=/elsewhere", "eval.max_new_tokens=8",
                      "hydra.verbose=true"])
    assert adopted(["run_dir=x"], str(tmp_path)) == ["+experiment=tiny", "train.seed=1", "eval.max_new_tokens=8"]
    assert adopted(["+experiment=smollm2", "eval.max_new_tokens=64"], str(tmp_path)) == ["train.seed=1"]
    assert adopted(["train=default"], str(tmp_path)) == ["+experiment=tiny", "eval.max_new_tokens=8"]  # a group
    record(tmp_path, ["target.path=/a/model", "~eval.prompt_sets.mtbench", "hydra/job_logging=none"])
    assert adopted(["target=hf", "eval.prompt_sets.mtbench.limit=1"], str(tmp_path)) == []  # holds or is held
    record(tmp_path, ["target=hf", "target.path=/a/model", "train.seed=1"])
    assert adopted(["target=hf"], str(tmp_path)) == ["target.path=/a/model", "train.seed=1"]  # the same choice
    assert adopted([], str(tmp_path / "none")) == []  # no training there
    (tmp_path / "checkpoints" / "settings.json").write_text(json.dumps({"fingerprint": "f"}))  # from before the record
    assert adopted([], str(tmp_path)) == []
    (tmp_path / "checkpoints" / "settings.json").write_text("{not json")
    assert adopted([], str(tmp_path)) == []


def test_the_record_leaves_out_what_only_that_command_was(tmp_path):
    assert training_overrides(["+experiment=tiny", "stages=[train]", "overwrite=true", "train.seed=1"]) == \
        ["+experiment=tiny", "train.seed=1"]
    assert training_overrides(None) is None  # composed outside a Hydra command: nothing recorded


def test_the_folder_is_the_one_the_evaluation_command_composes_to(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    record(run_dir, ["+experiment=tiny", "train.seed=1"])
    given = [f"run_dir={run_dir}", "eval.max_new_tokens=4"]
    assert with_training_command(given, given) == ["+experiment=tiny", "train.seed=1", *given]
    assert f"the drafter of {run_dir}, with its training command's overrides: +experiment=tiny train.seed=1" \
        in capsys.readouterr().out
    assert with_training_command(["--help"], ["--help"]) == ["--help"]
    # A flag that shows no config, composes another config than the evaluation's, or is no flag of Hydra's adopts
    # nothing.
    for flags in (["-h"], ["--hel"], ["--version"], ["--config-name", "train"], ["-cn", "train"], ["-cd", "/x"],
                  ["--epochs", "3"]):
        assert with_training_command([*given, *flags], [*given, *flags]) == [*given, *flags], flags
    # Hydra's flags that show the config show the one that runs: adopted, with the flags after every override.
    assert with_training_command(["--cfg", "job", *given], ["--cfg", "job", *given]) == \
        ["+experiment=tiny", "train.seed=1", *given, "--cfg", "job"]
    assert "overrides: +experiment=tiny train.seed=1" in capsys.readouterr().err  # stdout is the config's
    assert with_training_command([*given, "--info", "config", "~eval.prompt_sets.mtbench"], given) == \
        ["+experiment=tiny", "train.seed=1", *given, "~eval.prompt_sets.mtbench", "--info", "config"]
    record(tmp_path / "runs" / "mine", ["+experiment=tiny"])
    monkeypatch.chdir(tmp_path)  # name=mine: runs/mine, pinned whatever name the adopted experiment gives
    folder = tmp_path / "runs" / "mine"
    assert with_training_command(["name=mine"], ["name=mine"]) == ["+experiment=tiny", "name=mine", f"run_dir={folder}"]
    elsewhere = [f"run_dir={tmp_path / 'other'}"]
    assert with_training_command(elsewhere, elsewhere) == elsewhere
    assert with_training_command(["train.nope=1"], ["train.nope=1"]) == ["train.nope=1"]  # its error comes later


def test_under_hydra_job_chdir_the_folder_is_looked_for_in_hydras_folder(tmp_path, capsys, monkeypatch):
    """The next command of a run under hydra.job.chdir=true carries hydra.run.dir; its relative run_dir lies there,
    and was looked for in the folder the command started in (another run of that name there was adopted)."""
    record(tmp_path / "out dir" / "runs" / "mine", ["+experiment=tiny", "train.seed=3"])
    record(tmp_path / "runs" / "mine", ["+experiment=tiny", "train.seed=7"])
    monkeypatch.chdir(tmp_path)
    moved = ["name=mine", "hydra.job.chdir=true", f"hydra.run.dir='{tmp_path / 'out dir'}'"]
    assert with_training_command(moved, moved)[:2] == ["+experiment=tiny", "train.seed=3"]
    assert f"the drafter of {tmp_path / 'out dir' / 'runs' / 'mine'}," in capsys.readouterr().out
    # dflash's hydra.run.dir is `.`, the start folder; one named after the time the command starts is not known
    # beforehand.
    assert with_training_command(moved[:2], moved[:2])[:2] == ["+experiment=tiny", "train.seed=7"]
    timed = [*moved[:2], "hydra.run.dir=out/${now:%H-%M-%S}"]
    assert with_training_command(timed, timed) == timed
    stays = ["name=mine", "hydra.job.chdir=false", f"hydra.run.dir='{tmp_path / 'out dir'}'"]
    assert with_training_command(stays, stays)[:2] == ["+experiment=tiny", "train.seed=7"]


def test_hydras_flags_are_told_from_overrides():
    assert [full_flag(a) for a in ("--cfg=job", "-c", "--hel", "--in", "--c", "-x", "name=x")] == \
        ["--cfg", "-c", "--help", "--info", None, None, None]  # --c begins --cfg and --config-*: none
    argv = ["name=x", "--cfg", "job", "-p", "train", "--info", "~eval.prompt_sets.mtbench", "-m", "a='b=c'"]
    assert split_arguments(argv) == (["name=x", "~eval.prompt_sets.mtbench", "a='b=c'"],
                                     ["--cfg", "job", "-p", "train", "--info", "-m"])
    assert before_flags(argv, "run_dir=/r") == ["name=x", "~eval.prompt_sets.mtbench", "a='b=c'", "run_dir=/r",
                                                "--cfg", "job", "-p", "train", "--info", "-m"]
    # By position, as Hydra's parser reads them: a flag without a value takes none, a value may hold '=', and a
    # word repeated is two arguments.
    assert split_arguments(["-m", "foo", "-cd", "/a=b", "--cfg", "job", "job", "--info", "config", "--info",
                            "name"]) == (["foo", "job", "name"], ["-m", "-cd", "/a=b", "--cfg", "job", "--info",
                                                                  "config", "--info"])
    from hydra._internal.utils import get_args_parser

    for argv in (["-cd", "/a=b", "a=1"], ["a=1", "--info"], ["-m", "a=1,2", "--cfg", "job"], ["--cfg=job", "a=1"]):
        rewritten = before_flags(argv, "b=2")
        assert get_args_parser().parse_args(rewritten).overrides == [*get_args_parser().parse_args(argv).overrides,
                                                                     "b=2"], argv


def test_a_sweep_of_evaluations_adopts_the_training_command(tmp_path, capsys):
    """`-m eval.temperature=0.0,1.0` evaluates one drafter twice: it adopts what that drafter was trained with; a
    sweep over run folders adopts nothing."""
    run_dir = tmp_path / "run"
    record(run_dir, ["+experiment=tiny", "train.seed=1", "eval.temperature=0.5"])
    given = [f"run_dir={run_dir}", "eval.temperature=0.0,1.0", "-m"]
    assert with_training_command(given, given) == ["+experiment=tiny", "train.seed=1", *given]
    swept = [f"run_dir={run_dir},{tmp_path / 'other'}", "-m"]
    assert with_training_command(swept, swept) == swept


def test_the_evaluation_command_alone_measures_the_drafter_a_training_command_made(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    train = [sys.executable, "-m", "dflash.train", "+experiment=tiny", "show_progress=false", f"run_dir={run_dir}",
             "train.seed=1", "train.epochs=1", "stages=[data,capture,train,export]"]
    done = subprocess.run(train, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    recorded = json.loads((run_dir / "checkpoints" / "settings.json").read_text())["command"]
    assert recorded == ["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", "train.seed=1",
                        "train.epochs=1"]
    evaluate = [sys.executable, "-m", "dflash.eval", f"run_dir={run_dir}", "eval.prompt_sets.gsm8k.limit=1"]
    done = subprocess.run(evaluate, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "with its training command's overrides: +experiment=tiny show_progress=false train.seed=1 " \
           "train.epochs=1" in done.stdout
    # What to run next repeats the command as typed: the next evaluation adopts the rest again.
    assert f"next: real decoding         python -m dflash.eval run_dir={run_dir} eval.prompt_sets.gsm8k.limit=1 " \
           f"eval.mode=live" in done.stdout
    # --cfg job shows the config that evaluation ran with: the adopted seed under the typed limit.
    done = subprocess.run([*evaluate, "--cfg", "job"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = yaml.safe_load(done.stdout)
    assert shown["train"]["seed"] == 1 and shown["eval"]["prompt_sets"]["gsm8k"]["limit"] == 1
    assert "with its training command's overrides" in done.stderr
    summary = json.loads((run_dir / "eval" / "summary.json").read_text())
    assert summary["max_new_tokens"] == 16 and "gsm8k" in summary["prompt_sets"]  # the tiny experiment's eval
