"""The run-folder guard beyond settings: an edited prompt file is refused like a changed setting in a folder that
holds a trained drafter (overwrite=true rebuilds the data and trains again, the drafter moved aside), and a command
that trains nothing is told to take the drafter's own settings, not overwrite=true."""

import json
import shutil

import pytest

from dflash.config import ConfigError, compose
from dflash.pipeline import Pipeline
from dflash.run_files import folder_checksums, read_json

TINY = ["+experiment=tiny", "show_progress=false", "data.eval_overlap_ngram=0", "train.epochs=1"]
PROMPTS = [f"Tell me about the number {i}, please." for i in range(12)]


def write_prompts(path, texts) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n" for i, text in enumerate(texts)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a run folder trained on a prompt file, that file, the command's overrides less run_dir)."""
    folder = tmp_path_factory.mktemp("trained")
    prompts = folder / "prompts.jsonl"
    write_prompts(prompts, PROMPTS)
    command = TINY + ["stages=[data,capture,train]", "data.source=file", f"data.path={prompts}", "data.limit=null"]
    Pipeline(compose(command + [f"run_dir={folder / 'run'}"])).run()
    return folder / "run", prompts, command


def test_an_edited_prompt_file_is_refused_like_a_changed_setting(trained, tmp_path):
    source, prompts, command = trained
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    command = command + [f"run_dir={run_dir}"]
    before = folder_checksums(run_dir)
    write_prompts(prompts, PROMPTS + ["A brand new question?"])
    try:
        with pytest.raises(ConfigError, match=f"data.path {prompts} changed since this run's data stage") as error:
            Pipeline(compose(command)).run()
        assert folder_checksums(run_dir) == before
        assert f"run_dir={run_dir}-2;" in str(error.value) and "overwrite=true" in str(error.value)
        assert "keeps this folder's data" not in str(error.value)  # the data stage makes them again: it said so
        Pipeline(compose(command + ["overwrite=true"])).run()  # the data, its capture and the drafter made again
    finally:
        write_prompts(prompts, PROMPTS)
    assert read_json(str(run_dir / "data" / "stats.json"))["samples"] > read_json(
        str(source / "data" / "stats.json"))["samples"]
    assert read_json(str(run_dir / "features" / "done.json")) != read_json(str(source / "features" / "done.json"))
    aside = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and folder_checksums(aside[0] / "export") == folder_checksums(source / "export")


def test_a_command_that_trains_nothing_is_told_to_take_the_drafters_settings(trained):
    run_dir = trained[0]
    before = folder_checksums(run_dir)
    with pytest.raises(ConfigError, match="holds a drafter trained with other settings") as error:
        Pipeline(compose([f"run_dir={run_dir}", "stages=[eval]"], config_name="eval")).run()
    message = str(error.value)
    assert "This command trains nothing" in message and str(run_dir / "checkpoints" / "config.yaml") in message
    assert "target.kind: tiny -> " in message and "overwrite=true" not in message
    assert folder_checksums(run_dir) == before
