"""A command line Hydra cannot compose is refused in one line naming the override and what it takes
(dflash/config/composition_errors.py), where Hydra's own error takes six to twelve lines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash.config import ConfigError
from dflash.config.composition_errors import refuse_uncomposable, setting_keys

TINY = ["+experiment=tiny"]


@pytest.mark.parametrize("argv,config,line", [
    (["train.epochs=1.5"], "train", "train.epochs=1.5: expected an int"),
    (["train.lr=abc"], "train", "train.lr=abc: expected a number"),
    (["show_progress=maybe"], "train", "show_progress=maybe: expected true or false (or yes/no, on/off, y/n, 1/0)"),
    (["stages=train"], "train", "stages=train: expected a list of strings, e.g. stages=[train]"),
    (["stages=null"], "train", "stages=null: expected a list of strings, e.g. stages=[data,capture,train,export,"
                               "eval]"),
    (["drafter.target_layer_ids=[a,b]"], "train", "drafter.target_layer_ids=[a,b]: expected a list of ints, e.g. "
                                                  "drafter.target_layer_ids=[1,5,9]"),
    (["~run_dir"], "train", "~run_dir: a setting cannot be deleted; give it another value (run_dir=...)"),
    (["overwrite=2"], "train", "overwrite=2: expected true or false (or yes/no, on/off, y/n, 1/0)"),
    (["seed=3"], "train", "seed: no such setting (did you mean data.seed, train.seed or eval.seed?)"),
    (["+eval.prompt_sets.gsm8k.limit=3"], "train", "+eval.prompt_sets.gsm8k.limit=3: eval.prompt_sets.gsm8k.limit is "
                                                   "there already, so it is set without the +: "
                                                   "eval.prompt_sets.gsm8k.limit=3"),
    (["data.path=~/prompts.jsonl"], "train", "data.path=~/prompts.jsonl: a value starting with ~ is read as Hydra's "
                                             "deletion mark (the shell left it unexpanded); quote it: "
                                             "data.path='~/prompts.jsonl'"),
    # Characters Hydra's parser takes only quoted: it said "LexerNoViableAltException" or "mismatched input '('".
    (["name=ünï/日本"], "train", "name=ünï/日本: Hydra reads a value holding non-ASCII letters only when quoted: "
                               "name='\"ünï/日本\"'"),
    (["run_dir=/data/run(1)"], "train", "run_dir=/data/run(1): Hydra reads a value holding the characters ( ) only "
                                        "when quoted: run_dir='\"/data/run(1)\"'"),
    (["data.path=/data/p#1.jsonl"], "train", "data.path=/data/p#1.jsonl: Hydra reads a value holding the characters # "
                                             "only when quoted"),
    # The override Hydra refused is named, not a valid one before it holding braces (an interpolation).
    (["eval.out_dir=${run_dir}/evals/live", "name=ünï"], "train", "name=ünï: Hydra reads a value holding non-ASCII"),
    (["name=w-${hydra:job.num}", "data.path=/tmp/a[1].jsonl"], "train",
     "data.path=/tmp/a[1].jsonl: Hydra reads a value holding the characters [ ] only when quoted"),
    (["capture.ranks=2"], "train", "capture.ranks: only capture=online has this setting, and this command runs "
                                   "another capture mode"),
    (["target.tiny=llama"], "train", "target.tiny=llama: target.tiny is a mapping: change a key of it with "
                                     "target.tiny.<key>=..."),
    (["data.chat_template_kwargs={enable_thinking:false}"], "train",
     "data.chat_template_kwargs: its keys are given one by one: +data.chat_template_kwargs.enable_thinking=..."),
    (["eval.prompt_sets=nonsense"], "eval",
     "eval.prompt_sets=nonsense: eval.prompt_sets is a mapping of entries: change one with "
     "eval.prompt_sets.<name>.<key>=..., drop one with ~eval.prompt_sets.<name>, add one with "
     "+eval.prompt_sets.<name>.<key>=..."),
    (["eval.prompt_sets=[humaneval]"], "eval", "eval.prompt_sets=[humaneval]: eval.prompt_sets is a mapping"),
    (["train=5"], "train", "train=5: no such option; train takes default"),
    (["deepspeed=zero4"], "train", "deepspeed=zero4: no such option; deepspeed takes zero1, zero2, zero3"),
    (["target=llama"], "extract", "target=llama: no such option; target takes hf, qwen36, smollm2, tiny"),
    (["train.lr", "1e-3"], "train", "train.lr: an override is key=value (did you mean train.lr=1e-3?)"),
    (["eval.prompt_sets.nonsense.limit=2"], "eval",
     "eval.prompt_sets.nonsense.limit: eval.prompt_sets has no entry 'nonsense' (it holds humaneval, mtbench, "
     "gsm8k); a + adds one: +eval.prompt_sets.nonsense.source=<a source> +eval.prompt_sets.nonsense.limit=..."),
    (["train.lr=1e-3,3e-4"], "train", "train.lr=1e-3,3e-4: a comma sweeps, one job per value, each in a run folder "
                                      "of its own: python -m dflash.train -m +experiment=tiny train.lr=1e-3,3e-4 "
                                      "'name=tiny-${hydra:job.num}'; a list is train.lr=[1e-3,3e-4]"),
    # A list setting: a sweep would give it one item a job and a quoted string is no list, so only brackets are said.
    (["stages=data,capture"], "train", "stages=data,capture: stages is a list, written in brackets: "
                                       "stages=[data,capture]"),
    (["train.betas=0.9,0.95"], "train", "train.betas=0.9,0.95: train.betas is a list, written in brackets: "
                                        "train.betas=[0.9,0.95]"),
    (["capture=offline,online"], "train", "capture=offline,online: capture takes one option; a comma sweeps, one job "
                                          "per option, each in a run folder of its own: python -m dflash.train -m "
                                          "+experiment=tiny capture=offline,online 'name=tiny-${hydra:job.num}'"),
    (["eval.prompt_sets.humaneval.limt=2"], "eval", "eval.prompt_sets.humaneval.limt: no such setting (did you mean "
                                                    "eval.prompt_sets.humaneval.limit?)"),
    (["+eval.prompt_sets.humaneval.limt=2"], "train", "eval.prompt_sets.humaneval.limt: no such setting (did you mean "
                                                      "eval.prompt_sets.humaneval.limit?)"),
    (["eval.prompt_sets.gsm8k.limit=abc"], "train", "eval.prompt_sets.gsm8k.limit=abc: expected an int"),
    (["eval.prompt_sets.gsm8k.limit=2.5"], "eval", "eval.prompt_sets.gsm8k.limit=2.5: expected an int"),
    (["eval.prompt_sets.mtbench.turns=two"], "train", "eval.prompt_sets.mtbench.turns=two: expected an int"),
    (["train.lr.warmup=3"], "train", "train.lr.warmup: train.lr is one value (float), not a group of settings: "
                                     "train.lr=..."),
    (["--epochs", "3"], "train", "--epochs: no such option; settings are given as key=value (did you mean "
                                 "train.epochs=3?)"),
    (["--lr=3e-4"], "train",
     "--lr=3e-4: no such option; settings are given as key=value (did you mean train.lr=3e-4?)"),
    (["--micro-batch-size", "8"], "train", "(did you mean train.micro_batch_size=8?)"),
    (["--exp=tiny"], "train", "--exp=tiny: Hydra takes this for its flag --experimental-rerun; write its flags in "
                              "full, and settings as key=value (did you mean +experiment=tiny?)"),
    (["--pack", "false"], "train", "--pack: Hydra takes this for its flag --package; write its flags in full, and "
                                   "settings as key=value (did you mean capture.pack=false?)"),
    (["--multi", "--cfg", "job"], "train", "--multi and --cfg: Hydra takes one of --run, --multirun, --cfg, --info, "
                                           "--shell-completion at a time"),
    (["-m", "-c", "job"], "train", "-m and -c: Hydra takes one of"),
    (["--ver=true"], "train", "--ver=true: Hydra takes this for its flag --version; write its flags in full"),
])
def test_an_uncomposable_command_line_is_one_line_naming_the_override(argv, config, line):
    with pytest.raises(ConfigError) as error:
        refuse_uncomposable([*TINY, *argv], config)
    assert line in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv,line", [
    (["target.tiny.hidden_size=64"], "target.tiny.hidden_size=64: target.tiny is null in this config, so it has no "
                                     "key hidden_size to set; only target.kind=tiny reads it (this target is smollm2); "
                                     "target=tiny chooses a config that gives it one"),
    (["target.tiny={family:llama}"], "target.tiny={family:llama}: target.tiny is null in this config and takes no "
                                     "mapping here; only target.kind=tiny reads it (this target is smollm2); "
                                     "target=tiny chooses a config that gives it one"),
    # The others' settings are refused (no such target path), so no reason is read from them; the option of the
    # target group that gives target.tiny a value is named all the same.
    (["target=hf", "target.path=/x", "target.tiny.family.name=llama"], "target.tiny.family.name=llama: target.tiny is "
                                                                       "null in this config, so it has no key "
                                                                       "family.name to set; target=tiny chooses a "
                                                                       "config that gives it one"),
])
def test_a_key_below_a_null_setting_is_one_line_naming_it(argv, line):
    # OmegaConf asserts on an update below a null value: Hydra's traceback ended in "Unexpected type for root".
    with pytest.raises(ConfigError) as error:
        refuse_uncomposable(argv, "train")
    assert str(error.value).startswith(line)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv", [["show_progress=1"], ["overwrite=True"], ["overwrite=no"], ["overwrite=yes"],
                                  ["overwrite=on"], ["overwrite=Off"],
                                  ["overwrite=${oc.env:DFLASH_TEST_UNSET,false}"]])
def test_a_bool_takes_what_omegaconf_reads_as_one_but_another_int(argv):
    refuse_uncomposable([*TINY, *argv], "train")


def test_a_bool_sweep_is_hydras():
    # The check of a bool's value read `true,false` as one value, and refused the sweep.
    from dflash.config import CONFIG_DIR
    from dflash.config.unknown_keys import refuse_unknown_override_keys

    refuse_unknown_override_keys([*TINY, "-m", "show_progress=true,false", "overwrite=choice(true,false)"], CONFIG_DIR)


def test_an_experiment_without_its_plus_says_to_add_one():
    with pytest.raises(ConfigError) as error:
        refuse_uncomposable(["experiment=tiny"], "train")
    assert str(error.value) == "experiment=tiny: experiment is not chosen by default, so it is added with a +: " \
                               "+experiment=tiny"


@pytest.mark.parametrize("argv", [["hydra.mode=MULTIRUN", "train.lr=1e-3,3e-4"], ["--multi", "train.lr=1e-3,3e-4"]])
def test_a_sweep_hydra_runs_is_left_to_it(argv):
    refuse_uncomposable([*TINY, *argv], "train")


@pytest.mark.parametrize("argv", [["train.lr=1e-3", "stages=[data]"], ["--help"], ["--cfg", "job"], ["-m", "x=1"],
                                  ["-m", "--multirun", "x=1"], ["--cfg", "job", "--cfg", "hydra"]])
def test_a_composable_command_line_or_one_of_hydra_s_flags_passes(argv):
    refuse_uncomposable([*TINY, *argv], "train")


def test_the_keys_a_flag_is_matched_against_are_every_setting():
    keys = setting_keys()
    assert {"train.epochs", "train.lr", "data.max_length", "eval.temperature", "device", "capture.mode"} <= set(keys)
    assert "train" not in keys and "eval.prompt_sets" in keys


def test_the_command_prints_the_line_and_exits_2_before_any_work(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dflash.train", *TINY, f"run_dir={tmp_path / 'run'}",
                           "train.epochs=1.5"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HYDRA_FULL_ERROR": ""})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["dflash: error: train.epochs=1.5: expected an int"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,override,line", [
    ("dflash.eval", "eval.prompt_sets=nonsense", "dflash: error: eval.prompt_sets=nonsense: eval.prompt_sets is a "
                                                 "mapping of entries"),
    ("dflash.extract", "target=llama", "dflash: error: target=llama: no such option; target takes hf, qwen36, "
                                       "smollm2, tiny"),
])
def test_the_other_commands_compose_their_own_config_first(tmp_path, command, override, line):
    done = subprocess.run([sys.executable, "-m", command, *TINY, f"run_dir={tmp_path / 'run'}", override],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": ""})
    assert done.returncode == 2 and done.stderr.strip().startswith(line)
