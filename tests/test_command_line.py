"""The command line before Hydra: the GPU default experiment and what keeps a user's own choice."""

import os
import re

import pytest

from dflash.config import compose, settings_from
from dflash.config.command_line import GPU_DEFAULT, command_arguments, repeated_keys, with_gpu_default


@pytest.mark.parametrize("argv", [[], ["train.lr=1e-3"], ["name=mine", "show_progress=false"]])
def test_a_gpu_machine_runs_the_gpu_default_when_nothing_chooses(argv):
    assert with_gpu_default(argv, has_gpu=True) == [*argv, GPU_DEFAULT]


@pytest.mark.parametrize("argv,expected,overrides", [
    (["--cfg", "job"], [GPU_DEFAULT, "--cfg", "job"], [GPU_DEFAULT]),
    (["name=x", "--cfg", "job"], ["name=x", GPU_DEFAULT, "--cfg", "job"], ["name=x", GPU_DEFAULT]),
    (["-m", "train.lr=1e-3,2e-3"], ["train.lr=1e-3,2e-3", GPU_DEFAULT, "-m"], ["train.lr=1e-3,2e-3", GPU_DEFAULT]),
    (["--info", "config", "~eval.prompt_sets.mtbench"], ["~eval.prompt_sets.mtbench", GPU_DEFAULT, "--info", "config"],
     ["~eval.prompt_sets.mtbench", GPU_DEFAULT]),
])
def test_the_gpu_default_goes_before_hydras_flags(argv, expected, overrides):
    """Hydra's parser takes every override before the flags or every one after them (`a=1 --cfg job b=2` is
    refused): the default is an override like the others."""
    from hydra._internal.utils import get_args_parser

    assert with_gpu_default(argv, has_gpu=True) == expected
    assert get_args_parser().parse_args(expected).overrides == overrides


@pytest.mark.parametrize("argv", [["+experiment=tiny"], ["++experiment=smollm2"], ["target=qwen36"],
                                  ["target.path=/models/x"], ["device=cpu"], ["device=cuda:1", "train.lr=1e-3"]])
def test_a_users_experiment_target_or_device_is_kept(argv):
    assert with_gpu_default(argv, has_gpu=True) == argv


def test_a_flags_value_chooses_nothing():
    assert with_gpu_default(["--cfg", "job", "-p", "target"], has_gpu=True) == [GPU_DEFAULT, "--cfg", "job", "-p",
                                                                                "target"]


def test_a_cpu_machine_runs_the_demo():
    assert with_gpu_default([], has_gpu=False) == []


def test_the_gpu_default_is_the_smollm2_recipe_scaled_down():
    demo, quick, full = (settings_from(compose(overrides)) for overrides in
                         ([], [GPU_DEFAULT], ["+experiment=smollm2"]))
    assert quick.name == "smollm2_quick" != demo.name  # its own run folder: the CPU demo's run is never touched
    assert quick.target == full.target and quick.drafter == full.drafter and quick.capture == full.capture
    assert quick.train.max_minutes < full.train.max_minutes
    assert quick.data.limit < 24000 and quick.data.synthetic.count < full.data.synthetic.count


@pytest.mark.parametrize("argv,config,announced", [
    ([], "train", "demo"), (["name=mine"], "train", "demo"), (["+experiment=tiny"], "train", None),
    ([], "eval", None), (["--help"], "train", None), (["--cfg", "job"], "train", None),
    (["target=hf", "target.path=/m.gguf"], "train", "target"), (["target=hf", "+experiment=tiny"], "train", None),
    (["target=hf", "target.path=/m.gguf"], "extract", None), (["device=cpu"], "train", None),
    (["target.dtype=float32"], "train", None), (["+experiment=smollm2_quick"], "train", "gpu"),
    (["+experiment=smollm2", "name=x"], "train", "gpu")])
def test_the_cpu_demo_says_what_it_is_when_it_starts(argv, config, announced, monkeypatch, capsys):
    """And a run of a target named without an experiment says what its default sizes take."""
    import torch

    from dflash.config import command_line
    from dflash.config.command_line import CPU_DEMO_LINE, CPU_TARGET_LINE, command_arguments, default_run_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(command_line, "_default_run_line", None)  # put back after: later runs in this process say none
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert command_arguments(argv, config) == argv
    if announced == "gpu":  # an experiment sized for a GPU: what it takes there, and what runs on a CPU
        assert default_run_line().startswith(f"dflash: no GPU: {argv[0]} is sized for a GPU (about ")
    else:
        assert default_run_line() == {"demo": CPU_DEMO_LINE, "target": CPU_TARGET_LINE, None: None}[announced]
    assert capsys.readouterr().err == ""  # said by the pipeline once the settings are checked, not here


def test_every_experiment_is_sized_for_a_gpu_or_runs_on_a_cpu():
    """A new experiment file is said to be a GPU's (GPU_EXPERIMENTS) or is the CPU's smoke test."""
    from dflash.config import CONFIG_DIR
    from dflash.config.command_line import GPU_EXPERIMENTS

    names = {name[:-len(".yaml")] for name in os.listdir(os.path.join(CONFIG_DIR, "experiment"))}
    assert names == set(GPU_EXPERIMENTS) | {"tiny"}


@pytest.mark.parametrize("argv,expected,deferred", [
    ([], [GPU_DEFAULT], True), (["name=mine"], ["name=mine", GPU_DEFAULT], True),
    (["--cfg", "job"], [GPU_DEFAULT, "--cfg", "job"], False)])
def test_the_gpu_default_is_said_by_the_run_or_at_once_where_no_run_follows(argv, expected, deferred, monkeypatch,
                                                                            capsys):
    import torch

    from dflash.config import command_line
    from dflash.config.command_line import GPU_DEFAULT_LINE, command_arguments, default_run_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(command_line, "_default_run_line", None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert command_arguments(argv, "train") == expected
    assert (default_run_line() == GPU_DEFAULT_LINE) == deferred
    assert (GPU_DEFAULT_LINE in capsys.readouterr().err) != deferred  # --cfg job prints the default's config now


def test_the_gemma3_270m_command_has_help_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from dflash.models.targets.gemma3_270m import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0 and "Join the Gemma 3 270M GGUF chunks" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # not a cache folder named --help, with the 242 MB file in it


@pytest.mark.parametrize("config_name", ["train", "extract", "eval"])
@pytest.mark.parametrize("flag", ["--version", "--vers"])
def test_version_is_dflashs(capsys, config_name, flag):
    """Hydra's own --version printed Hydra's version alone."""
    with pytest.raises(SystemExit) as ended:
        command_arguments(["train.lr=1e-3", flag], config_name)
    assert ended.value.code == 0
    assert re.fullmatch(r"dflash \S+ \(Hydra \d+\.\d+\.\d+\)\n", capsys.readouterr().out)


def test_a_key_given_twice_is_warned_about_and_the_last_used(capsys):
    """Hydra takes the last of a repeated override silently; a script appending to a base command may mean it."""
    arguments = command_arguments(["+experiment=tiny", "train.lr=1e-3", "name=a", "train.lr=2e-3"])
    assert arguments[-1] == "train.lr=2e-3"
    assert capsys.readouterr().err.splitlines()[0] == (
        "dflash: warning: train.lr is given 2 times (train.lr=1e-3, train.lr=2e-3); the last, train.lr=2e-3, is the "
        "one used")
    assert settings_from(compose(arguments)).train.lr == 2e-3
    command_arguments(["+experiment=tiny", "train.lr=1e-3", "--cfg", "job"])
    assert "given" not in capsys.readouterr().err
    assert repeated_keys(["+train.lr=1e-3", "train.lr=2e-3"]) == []  # not a repeat: Hydra refuses the pair itself


@pytest.mark.parametrize("config_name,runs", [("extract", "the data and capture stages"), ("eval", "the eval stage")])
def test_stages_given_to_a_command_that_runs_its_own_is_one_line(config_name, runs, capsys):
    # They were dropped without a word: the command runs its own stages whatever `stages` says.
    with pytest.raises(SystemExit) as ended:
        command_arguments(["+experiment=tiny", "stages=[train]"], config_name)
    assert ended.value.code == 2
    assert capsys.readouterr().err == (f"dflash: error: stages=[train]: python -m dflash.{config_name} runs {runs} "
                                       f"itself; python -m dflash.train stages=[train] runs the stages named\n")


@pytest.mark.parametrize("config_name", ["train", "eval"])
def test_a_target_kind_given_alone_is_refused_naming_the_group(config_name, capsys):
    """target.kind=hf kept the smollm2 group's other keys (its mask token 16, an ordinary token of most checkpoints,
    refused by capture after the whole data stage or used as the mask)."""
    with pytest.raises(SystemExit) as ended:
        command_arguments(["target.kind=hf", "target.path=/models/mine"], config_name)
    assert ended.value.code == 2
    assert ("target.kind=hf: a target is chosen by its group, target=hf target.path=<checkpoint folder or .gguf "
            "file>: target.kind alone keeps the other keys of the target group in use (its mask token among them)"
            ) in capsys.readouterr().err
