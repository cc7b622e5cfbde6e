"""`--help` of each command: a short page of its own (conf/hydra/help/), while the three compose one config."""

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from dflash.config import compose

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("train", "extract", "eval")


def command(module: str, *args: str, cwd) -> str:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", f"dflash.{module}", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, str]:
    cwd = tmp_path_factory.mktemp("help")
    return {name: command(name, "--help", cwd=cwd) for name in COMMANDS}


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.slow
def test_each_command_prints_a_short_page_of_its_own(pages, name):
    page = pages[name]
    assert len(page.splitlines()) < 45
    assert page.startswith(f"python -m dflash.{name}: ")  # what the command does
    assert f"Usage: python -m dflash.{name} " in page
    assert "capture: colocated, offline, online" in page and "experiment: qwen36, smollm2, smollm2_quick, tiny" in page
    examples = page.split("== Examples ==")[1].split("==")[0]
    assert sum(f"-m dflash.{name} " in line for line in examples.splitlines()) >= 3
    assert "python -m dflash.config" in page and "docs/config.md" in page and "--cfg job" in page
    assert "powered by Hydra" not in page and "== Config ==" not in page  # not Hydra's dump of the whole config
    others = [other for other in COMMANDS if other != name]
    assert all(pages[other] != page for other in others)


def test_the_main_keys_show_the_values_of_the_command_line(tmp_path):
    page = command("train", "+experiment=tiny", "train.epochs=7", "capture=online", "--help", cwd=tmp_path)
    assert "name=tiny  run_dir=runs/tiny  device=cpu" in page
    assert "train.epochs=7  train.lr=0.0006" in page and "capture=online" in page


@pytest.mark.parametrize("overrides", [[], ["+experiment=tiny"], ["+experiment=qwen36", "capture=online"],
                                       ["+experiment=smollm2", "train.lr=1e-3", "eval.mode=live"]])
def test_extract_and_eval_compose_the_config_of_train(overrides):
    train = OmegaConf.to_yaml(compose(overrides))
    assert OmegaConf.to_yaml(compose(overrides, config_name="extract")) == train
    assert OmegaConf.to_yaml(compose(overrides, config_name="eval")) == train


@pytest.mark.parametrize("name", ["extract", "eval"])
def test_cfg_job_of_each_command_prints_the_config_of_train(tmp_path, name):
    printed = command(name, "+experiment=tiny", "--cfg", "job", cwd=tmp_path)
    assert printed == OmegaConf.to_yaml(compose(["+experiment=tiny"]))
