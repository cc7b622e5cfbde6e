"""Mistakes a new user makes on the command line, each refused in one line naming the override and what to type
instead, before any work (a walk through the first hour found each refused in other words, or taken)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from dflash.config import compose
from dflash.config import command_line
from dflash.config.command_line import command_arguments
from dflash.config.composition_errors import sweep_conflict, sweep_jobs
from dflash.config.reference import describe

TINY = ["+experiment=tiny"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("typed,line", [
    # Hydra's own advice, `override experiment: smollm2`, is a line of a defaults list.
    ("dflash.train +experiment=tiny +experiment=smollm2",
     "+experiment=tiny +experiment=smollm2: one experiment per command; keep one (+experiment=tiny) and give the "
     "settings you want of the other as overrides (conf/experiment/smollm2.yaml lists them)"),
    # Hydra ran smollm2 alone, without a word.
    ("dflash.train +experiment=tiny experiment=smollm2",
     "+experiment=tiny experiment=smollm2: one experiment per command; keep one (+experiment=tiny) and give the "
     "settings you want of the other as overrides (conf/experiment/smollm2.yaml lists them)"),
    # The shell splits the list at its space: Hydra said "no viable alternative at input '[0.9,'".
    ("dflash.train +experiment=tiny train.betas=[0.9, 0.95]",
     "train.betas=[0.9, 0.95]: the shell split this list at its spaces; quote it: 'train.betas=[0.9, 0.95]', or drop "
     "the spaces: train.betas=[0.9,0.95]"),
    ("dflash.eval +experiment=tiny +eval.prompt_sets.mine={source: gsm8k}",
     "+eval.prompt_sets.mine={source: gsm8k}: the shell split this mapping at its spaces; quote it: "
     "'+eval.prompt_sets.mine={source: gsm8k}', or drop the spaces: +eval.prompt_sets.mine={source:gsm8k}"),
    # Spaces around =, quoted or not: the refusal named the key `train.lr ` and suggested train.lr.
    ("dflash.train +experiment=tiny 'train.lr = 1e-3'",
     "train.lr = 1e-3: an override has no spaces around its =; write train.lr=1e-3"),
    ("dflash.train +experiment=tiny 'train.lr =1e-3'",
     "train.lr =1e-3: an override has no spaces around its =; write train.lr=1e-3"),
    ("dflash.train +experiment=tiny train.lr =1e-3",
     "train.lr =1e-3: an override has no spaces around its =; write train.lr=1e-3"),
    ("dflash.train +experiment=tiny train.lr= 1e-3",
     "train.lr= 1e-3: an override has no spaces around its =; write train.lr=1e-3"),
    ("dflash.extract +experiment=tiny train.lr = 1e-3",
     "train.lr = 1e-3: an override has no spaces around its =; write train.lr=1e-3"),
    # Taken without a word: the run went to runs/<name>, and Hydra made the folder given, empty.
    ("dflash.train +experiment=tiny name=w hydra.run.dir=/tmp/x",
     "hydra.run.dir=/tmp/x: dflash writes to run_dir (runs/${name}), not to Hydra's run folder, which would stay "
     "empty; give run_dir=/tmp/x instead (or name=NAME), or add hydra.job.chdir=true to run in it"),
    # The working folder or an interpolation is no run folder to give instead.
    ("dflash.train +experiment=tiny hydra.run.dir=.",
     "hydra.run.dir=.: dflash writes to run_dir (runs/${name}), not to Hydra's run folder, which would stay empty; "
     "give run_dir=<a folder> instead (or name=NAME), or add hydra.job.chdir=true to run in it"),
    ("dflash.extract +experiment=tiny 'hydra.run.dir=${run_dir}'",
     "hydra.run.dir=${run_dir}: dflash writes to run_dir (runs/${name}), not to Hydra's run folder, which would stay "
     "empty; give run_dir=<a folder> instead (or name=NAME), or add hydra.job.chdir=true to run in it"),
    ("dflash.eval +experiment=tiny hydra.run.dir=/tmp/x",
     "hydra.run.dir=/tmp/x: dflash writes to eval.out_dir (<run_dir>/eval), not to Hydra's run folder, which would "
     "stay empty; give eval.out_dir=/tmp/x instead"),
    ("dflash.train +experiment=tiny eval.prompt_sets.gsm8k=null",
     "eval.prompt_sets.gsm8k=null: an entry of eval.prompt_sets is dropped, not set to null: ~eval.prompt_sets.gsm8k"),
    # The comma's advice, -m, led to a sweep whose second job was refused for the first's drafter: it gives the
    # sweep that runs, a folder per job where its jobs would share one (working_sweep).
    ("dflash.train +experiment=tiny name=w train.lr=1e-3,2e-3",
     "train.lr=1e-3,2e-3: a comma sweeps, one job per value, each in a run folder of its own: python -m dflash.train "
     "-m +experiment=tiny 'name=w-${hydra:job.num}' train.lr=1e-3,2e-3; a list is train.lr=[1e-3,2e-3]"),
    # One drafter evaluated twice: the second evaluation replaces the first, saying so, as a rerun does.
    ("dflash.eval +experiment=tiny eval.temperature=0,1",
     "eval.temperature=0,1: a comma sweeps, one job per value: python -m dflash.eval -m +experiment=tiny "
     "eval.temperature=0,1; a list is eval.temperature=[0,1]"),
    # A sweep two of whose jobs would spoil each other's results, refused before its first job.
    ("dflash.train -m +experiment=tiny name=w train.lr=1e-3,2e-3",
     "train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would make the drafter of other settings in one run folder, "
     "runs/w; give each job its own: python -m dflash.train -m +experiment=tiny 'name=w-${hydra:job.num}' "
     "train.lr=1e-3,2e-3"),
    ("dflash.extract -m +experiment=tiny run_dir=/tmp/r capture=offline,online",
     "capture=offline,online: jobs 0 and 1 of this sweep would make the features of other settings in one run "
     "folder, /tmp/r; give each job its own: python -m dflash.extract -m +experiment=tiny "
     "'run_dir=/tmp/r-${hydra:job.num}' capture=offline,online"),
    ("dflash.train -m +experiment=tiny 'stages=[data]' name=w data.max_new_tokens=16,32",
     "data.max_new_tokens=16,32: jobs 0 and 1 of this sweep would make the data of other settings in one run folder, "
     "runs/w; give each job its own: python -m dflash.train -m +experiment=tiny 'stages=[data]' "
     "'name=w-${hydra:job.num}' data.max_new_tokens=16,32"),
    # A job whose setting the schema refuses: the jobs before it ran for their whole stages first.
    ("dflash.train -m +experiment=tiny 'stages=[data]' 'name=w${data.limit}' data.limit=4,0",
     "job 1 of this sweep: data.limit=0: expected an int >= 1, or null for all prompts; no job was run"),
    # Each experiment names its run, but not each learning rate.
    ("dflash.train -m +experiment=tiny,smollm2 train.lr=1e-3,2e-3",
     "+experiment=tiny,smollm2 train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would make the drafter of other "
     "settings in one run folder, runs/tiny; give each job its own: python -m dflash.train -m +experiment=tiny,smollm2 "
     "train.lr=1e-3,2e-3 'name=${hydra:runtime.choices.experiment}-${hydra:job.num}'"),
    # Hydra takes the product of two sweeps: two learning rates in each folder.
    ("dflash.train -m +experiment=tiny name=a,b train.lr=1e-3,2e-3",
     "name=a,b train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would make the drafter of other settings in one run "
     "folder, runs/a; give each job its own: python -m dflash.train -m +experiment=tiny 'name=a-${hydra:job.num}' "
     "train.lr=1e-3,2e-3"),
    # A run folder per job, one evaluation folder for all: the second job's eval stage refused the first's.
    ("dflash.train -m +experiment=tiny 'name=lr${train.lr}' train.lr=1e-3,2e-3 eval.out_dir=/shared",
     "train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would evaluate the drafters of two run folders into one "
     "evaluation folder, /shared; give each job its own: python -m dflash.train -m +experiment=tiny "
     "'name=lr${train.lr}' train.lr=1e-3,2e-3 'eval.out_dir=/shared-${hydra:job.num}'"),
    ("dflash.train -m +experiment=tiny name=w eval.out_dir=/shared train.lr=1e-3,2e-3",
     "train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would make the drafter of other settings in one run folder, "
     "runs/w; give each job its own: python -m dflash.train -m +experiment=tiny 'name=w-${hydra:job.num}' "
     "'eval.out_dir=/shared-${hydra:job.num}' train.lr=1e-3,2e-3"),
    ("dflash.eval -m +experiment=tiny name=a,b eval.out_dir=/shared",
     "name=a,b: jobs 0 and 1 of this sweep would evaluate the drafters of two run folders into one evaluation folder, "
     "/shared; give each job its own: python -m dflash.eval -m +experiment=tiny name=a,b "
     "'eval.out_dir=/shared-${hydra:job.num}'"),
    ("dflash.train hydra.mode=MULTIRUN +experiment=tiny name=w train.lr=1e-3,2e-3",
     "train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would make the drafter of other settings in one run folder, "
     "runs/w; give each job its own: python -m dflash.train hydra.mode=MULTIRUN +experiment=tiny "
     "'name=w-${hydra:job.num}' train.lr=1e-3,2e-3"),
    # argparse printed its usage block and `unrecognized arguments`.
    ("dflash.train +experiment=tiny name=w -m train.lr=1e-3,2e-3",
     "-m: Hydra reads its flags before the overrides or after them all, not between them; -m goes first, and each job "
     "needs a folder of its own: python -m dflash.train -m +experiment=tiny 'name=w-${hydra:job.num}' "
     "train.lr=1e-3,2e-3"),
    ("dflash.train +experiment=tiny train.lr=1e-3 --cfg job name=w",
     "--cfg job: Hydra reads its flags before the overrides or after them all, not between them; Hydra's flags go "
     "first: python -m dflash.train --cfg job +experiment=tiny train.lr=1e-3 name=w"),
    # Other trainers' names: the nearest spelling is nowhere near ours.
    ("dflash.train +experiment=tiny train.learning_rate=1e-3",
     "train.learning_rate: no such setting (did you mean train.lr?)"),
    ("dflash.train +experiment=tiny num_train_epochs=2", "num_train_epochs: no such setting (did you mean "
                                                          "train.epochs?)"),
    ("dflash.train +experiment=tiny batch_size=8",
     "batch_size: no such setting (did you mean train.micro_batch_size, data.batch_size or eval.batch_size?)"),
    ("dflash.train +experiment=tiny train.warmup_steps=100",
     "train.warmup_steps: no such setting (did you mean train.warmup_ratio, a share of the steps, not a count?)"),
    ("dflash.train +experiment=tiny max_grad_norm=1", "max_grad_norm: no such setting (did you mean train.grad_clip?)"),
    ("dflash.train +experiment=tiny --learning_rate 1e-3",
     "--learning_rate: no such option; settings are given as key=value (did you mean train.lr=1e-3?)"),
    ("dflash.eval +experiment=tiny eval.output_dir=x",  # a close spelling in its group before another trainer's name
     "eval.output_dir: no such setting (did you mean eval.out_dir?)"),
    # OmegaConf takes yes/no and on/off as bools too: the refusal named only true and false.
    ("dflash.train +experiment=tiny overwrite=maybe",
     "overwrite=maybe: expected true or false (or yes/no, on/off, y/n, 1/0)"),
])
def test_a_command_line_mistake_is_one_line_with_what_to_type(typed, line, tmp_path, monkeypatch, capsys):
    """`typed`: the command after `python -m`, split as the shell splits it."""
    module, *argv = shlex.split(typed)
    monkeypatch.chdir(tmp_path)  # no run folder here for an evaluation to adopt a training command from
    monkeypatch.setattr(command_line, "_default_run_line", None)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")
    with pytest.raises(SystemExit) as ended:
        command_arguments(argv, module.split(".")[1])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dflash: error: {line}")
    assert "\n" not in err


@pytest.mark.parametrize("refused,after,key,value", [
    (["train.betas=[0.8,", "0.9]"], "drop the spaces: ", "train.betas", [0.8, 0.9]),
    (["train.lr", "=", "1e-3"], "write ", "train.lr", 1e-3),
    (["eval.prompt_sets.gsm8k=null"], "not set to null: ", "eval.prompt_sets.gsm8k", None),
])
def test_what_the_line_says_to_type_composes(refused, after, key, value, monkeypatch, capsys):
    from omegaconf import OmegaConf

    monkeypatch.setattr(command_line, "_default_run_line", None)
    with pytest.raises(SystemExit):
        command_arguments([*TINY, *refused], "train")
    meant = capsys.readouterr().err.strip().split(after, 1)[1]
    assert OmegaConf.select(compose([*TINY, meant]), key) == value


def refusal(typed: str, monkeypatch, capsys) -> str:
    """The line `python -m <typed>` (split as the shell splits it) is refused with, as run in the working folder."""
    module, *argv = shlex.split(typed)
    monkeypatch.setattr(command_line, "_default_run_line", None)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")
    with pytest.raises(SystemExit):
        command_arguments(argv, module.split(".")[1])
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("typed,jobs", [
    ("dflash.train -m +experiment=tiny 'name=w-lr${train.lr}' train.lr=1e-3,2e-3", 2),  # each job its run folder
    ("dflash.train +experiment=tiny 'name=w-lr${train.lr}' train.lr=1e-3,2e-3 -m", 2),  # the flags after them all
    ("dflash.train -m +experiment=tiny 'name=w-${hydra:job.num}' train.lr=1e-3,2e-3", 2),  # the refusals' form
    ("dflash.train -m +experiment=tiny name=w eval.temperature=0,1", 2),  # one drafter measured twice, the last kept
    ("dflash.eval -m +experiment=tiny name=w eval.temperature=0,1", 2),
    ("dflash.train -m +experiment=tiny name=w show_progress=true,false", 2),  # a sweep of what changes no output
    ("dflash.train -m +experiment=tiny 'name=w${hydra:job.num}' capture=offline,online", 2),
    ("dflash.train -m +experiment=tiny,smollm2", 2),  # each experiment names its run
    ("dflash.extract -m +experiment=tiny name=w train.lr=1e-3,2e-3", 2),  # the data and capture stages take no lr
    ("dflash.train -m +experiment=tiny name=w train.lr=1e-3,2e-3 'stages=[data]'", 2),  # nor does the data stage
    ("dflash.train -m +experiment=tiny 'stages=[data]' 'name=w-${hydra:job.num}' data.max_new_tokens=16,32", 2),
    # Folders per job that only the jobs' own configs tell: Hydra's output folder, the environment a job sets, and
    # Hydra's working folder per job (runs/w in each).
    ("dflash.train -m +experiment=tiny 'run_dir=${hydra:runtime.output_dir}' 'hydra.sweep.subdir=${hydra.job.num}' "
     "train.lr=1e-3,2e-3", 2),
    ("dflash.train -m +experiment=tiny 'name=w-${oc.env:JOB}' '+hydra.job.env_set.JOB=${hydra:job.num}' "
     "train.lr=1e-3,2e-3", 2),
    ("dflash.train -m +experiment=tiny name=w hydra.job.chdir=true 'hydra.sweep.subdir=${hydra.job.num}' "
     "train.lr=1e-3,2e-3", 2),
    ("dflash.train +experiment=tiny name=w hydra.job.chdir=false", 0),
    ("dflash.train +experiment=tiny name=w hydra.run.dir=/tmp/x hydra.job.chdir=true", 0),  # runs/w in /tmp/x
])
def test_a_sweep_with_a_folder_per_job_and_hydras_other_keys_pass(typed, jobs, tmp_path, monkeypatch):
    """`jobs`: how many jobs the sweep has, each composed by the check (none left out for failing to)."""
    module, *argv = shlex.split(typed)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(command_line, "_default_run_line", None)
    arguments = command_arguments(argv, module.split(".")[1])
    assert len(sweep_jobs(arguments, module.split(".")[1]) if jobs else []) == jobs


@pytest.mark.parametrize("typed,after", [
    ("dflash.train -m +experiment=tiny name=w train.lr=1e-3,2e-3", "its own: "),
    ("dflash.train -m +experiment=tiny name=a,b train.lr=1e-3,2e-3", "its own: "),
    ("dflash.train -m +experiment=tiny,smollm2 train.lr=1e-3,2e-3", "its own: "),
    ("dflash.train -m +experiment=tiny name=w eval.out_dir=/shared train.lr=1e-3,2e-3", "its own: "),
    ("dflash.train -m +experiment=tiny 'name=lr${train.lr}' train.lr=1e-3,2e-3 eval.out_dir=/shared", "its own: "),
    ("dflash.extract -m +experiment=tiny run_dir=/tmp/r capture=offline,online", "its own: "),
    ("dflash.eval -m +experiment=tiny name=a,b eval.out_dir=/shared", "its own: "),
    ("dflash.eval -m +experiment=tiny name=w train.lr=1e-3,2e-3", "its own: "),
    ("dflash.train +experiment=tiny train.lr=1e-3,2e-3", "of its own: "),
    ("dflash.train +experiment=tiny name=w eval.out_dir=/shared -m train.lr=1e-3,2e-3", "of its own: "),
])
def test_the_sweep_a_refusal_gives_composes_into_a_folder_per_job(typed, after, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = refusal(typed, monkeypatch, capsys)
    python, _, module, *given = shlex.split(line.split(after, 1)[1].split(";")[0])
    command = module.split(".")[1]
    assert [python, given[0]] == ["python", "-m"]
    jobs = sweep_jobs(given, command)
    assert len(jobs) > 1 and sweep_conflict(jobs, command) is None
    assert len({job.eval_dir for job in jobs}) == len(jobs)
    if "'name=" in line or "'run_dir=" in line:
        assert len({job.run_dir for job in jobs}) == len(jobs)


def test_an_evaluation_sweep_is_checked_with_the_overrides_it_adopts(tmp_path, monkeypatch, capsys):
    """The run folder's training command decides what its evaluations measure: the sweep of an eval setting
    measures that one drafter, the sweep of a training setting would measure others than it holds."""
    monkeypatch.chdir(tmp_path)
    os.makedirs(tmp_path / "runs" / "w" / "checkpoints")
    (tmp_path / "runs" / "w" / "checkpoints" / "settings.json").write_text(
        json.dumps({"fingerprint": "f", "command": ["+experiment=tiny", "train.lr=1e-3", "eval.out_dir=/shared"]}))
    monkeypatch.setattr(command_line, "_default_run_line", None)
    arguments = command_arguments(["-m", "name=w", "eval.temperature=0,1"], "eval")
    assert [job.eval_dir for job in sweep_jobs(arguments, "eval")] == ["/shared", "/shared"]
    capsys.readouterr()
    assert refusal("dflash.eval -m name=w train.lr=1e-3,2e-3", monkeypatch, capsys).endswith(
        "train.lr=1e-3,2e-3: jobs 0 and 1 of this sweep would evaluate drafters of other settings into one evaluation "
        "folder, /shared; give each job its own: python -m dflash.eval -m name=w train.lr=1e-3,2e-3 "
        "'eval.out_dir=/shared-${hydra:job.num}'")


def test_the_settings_lookup_names_ours_for_another_trainers_name(tmp_path):
    with pytest.raises(ValueError, match=r"^train\.learning_rate: no such setting \(did you mean train\.lr\?\)"):
        describe("train.learning_rate")
    done = subprocess.run([sys.executable, "-m", "dflash.config", "learning_rate"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2
    assert done.stderr.startswith("dflash: error: learning_rate: no such setting (did you mean train.lr?)")


def test_the_docs_say_what_a_bool_takes_as_the_refusal_does():
    from dflash.config.unknown_keys import BOOL_WORDS

    with open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    assert f"a bool takes {BOOL_WORDS.rstrip(')')}" in text


@pytest.mark.slow
def test_the_sweep_the_line_gives_runs_each_job_in_its_own_folder(tmp_path):
    """The command of the refusal, as typed, runs both jobs (the data stage only, to be quick), each in its run
    folder; the command as first typed leaves nothing behind."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": REPO}
    typed = [*TINY, "stages=[data]", "data.limit=2", "name=w", "data.max_new_tokens=16,32", "show_progress=false"]
    done = subprocess.run([sys.executable, "-m", "dflash.train", "-m", *typed], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 2 and not (tmp_path / "runs").exists() and not (tmp_path / "multirun").exists()
    line = done.stderr.strip()
    assert "\n" not in line and "jobs 0 and 1 of this sweep would make the data of other settings" in line
    suggested = shlex.split(line.split("give each job its own: ", 1)[1])
    assert suggested[:4] == ["python", "-m", "dflash.train", "-m"]
    done = subprocess.run([sys.executable, *suggested[1:]], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "runs")) == ["w-0", "w-1"]
    assert all((tmp_path / "runs" / name / "data" / "done.json").exists() for name in ("w-0", "w-1"))


def test_every_alias_names_a_setting():
    from dflash.config.unknown_keys import ALIASES, lookup_setting

    assert [(name, key) for name, (keys, _) in ALIASES.items() for key in keys if lookup_setting(key)[0] is None] == []
