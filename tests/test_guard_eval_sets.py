"""The run-folder guard and evaluation sets: a trained run folder refuses a command whose data stage would rebuild
the drafter's data for an evaluation set its overlap check has not covered (added since, or its file edited), as it
refuses an edited prompt file; an eval-only command evaluates the drafter on it as it is, and overwrite=true trains
on the checked data. A refusal's other run folder is one the same command reaches, and the train stage says why it
moved checkpoints aside."""

import json
import logging
import os
import shutil

import pytest

from dflash.config import compose, fingerprints
from dflash.config.errors import RunFolderError
from dflash.pipeline import Pipeline
from dflash.run_files import folder_checksums, read_json, write_json, write_text
from dflash.stages.guard import ways_on

TINY = ["+experiment=tiny", "show_progress=false", "train.epochs=1"]
TRAIN = ["stages=[data,capture,train]"]
CHAT = "+eval.prompt_sets.chat={source: sharegpt, limit: 2}"  # ShareGPT: most training prompts overlap it


def file_set(path) -> str:
    return f"+eval.prompt_sets.mine={{source: file, path: {path}}}"


def write_eval_prompts(path, texts) -> None:
    path.write_text("".join(json.dumps({"id": f"e{i}", "conversations": [{"from": "human", "value": text}]}) + "\n"
                            for i, text in enumerate(texts)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder holding a run trained with an evaluation set read from a file, and that file."""
    folder = tmp_path_factory.mktemp("trained")
    write_eval_prompts(folder / "mine.jsonl", ["Say hi to the people reading this, in a friendly way."])
    Pipeline(compose(TINY + TRAIN + [f"run_dir={folder / 'run'}", file_set(folder / "mine.jsonl")])).run()
    return folder


def copied(trained, tmp_path) -> list[str]:
    """The trained run and its evaluation file copied to tmp_path; the overrides of its training command there (the
    file's path aside, the same sets: a set is checked by its source and contents)."""
    shutil.copytree(trained / "run", tmp_path / "run")
    shutil.copy(trained / "mine.jsonl", tmp_path / "mine.jsonl")
    return TINY + [f"run_dir={tmp_path / 'run'}", file_set(tmp_path / "mine.jsonl")]


def test_an_added_eval_set_is_refused_and_overwrite_trains_on_the_checked_prompts(trained, tmp_path):
    command = copied(trained, tmp_path)
    run_dir = tmp_path / "run"
    before = folder_checksums(run_dir)
    with pytest.raises(RunFolderError, match="were not checked for overlap with eval.prompt_sets chat ") as error:
        Pipeline(compose(command + TRAIN + [CHAT])).run()
    message = str(error.value)
    assert "python -m dflash.eval with the same overrides" in message and "overwrite=true" in message
    assert folder_checksums(run_dir) == before
    # A command without the data stage evaluates the drafter on the set as it is: the guard lets it through.
    Pipeline(compose(command + ["stages=[eval]", CHAT], config_name="eval")).train.preflight(selected=False)

    Pipeline(compose(command + TRAIN + [CHAT, "overwrite=true"])).run()
    overlap = read_json(str(run_dir / "data" / "stats.json"))["eval_overlap"]
    assert sum(overlap["dropped"].values()) > 0 and "chat" in overlap["eval_set_sources"]
    aside = [p for p in run_dir.iterdir() if p.name.startswith("checkpoints.")]
    assert len(aside) == 1 and folder_checksums(aside[0] / "export") == folder_checksums(trained / "run" / "export")
    assert folder_checksums(run_dir / "export") != folder_checksums(aside[0] / "export")


def test_an_edited_eval_set_file_is_refused_like_an_added_set(trained, tmp_path):
    command = copied(trained, tmp_path)
    Pipeline(compose(command + TRAIN)).train.preflight(selected=True)  # the same file elsewhere: checked
    write_eval_prompts(tmp_path / "mine.jsonl", ["Say hi to the people reading this, in a friendly way.",
                                                 "Another question?"])
    with pytest.raises(RunFolderError, match="were not checked for overlap with eval.prompt_sets mine "):
        Pipeline(compose(command + TRAIN)).run()


def test_the_other_run_folder_a_refusal_names_is_one_the_same_command_reaches(trained, tmp_path):
    """A run folder given by run_dir does not move with name=: the refusal names another run_dir then."""
    refused = copied(trained, tmp_path) + TRAIN + ["train.epochs=2"]
    with pytest.raises(RunFolderError, match="holds a drafter trained with other settings") as error:
        Pipeline(compose(refused)).run()
    other = f"run_dir={tmp_path / 'run-2'}"
    assert f"run the same command with {other};" in str(error.value)
    Pipeline(compose(refused + [other])).train.preflight(selected=True)  # that command is not refused
    # A run folder that follows name=: another name.
    by_name = Pipeline(compose(TINY + [f"run_dir={tmp_path}/${{name}}"])).train
    assert "run the same command with name=tiny-2;" in ways_on(by_name, "train")
    os.makedirs(tmp_path / "tiny-2")
    assert "run the same command with name=tiny-3;" in ways_on(by_name, "train")


@pytest.mark.parametrize("overwrite, why", [(False, "the data stage's output changed under them since"),
                                           (True, "on other data moved aside to")])
def test_the_train_stage_says_why_it_moves_checkpoints_aside(tmp_path, caplog, overwrite, why):
    """Checkpoints of these settings made from other data than data/ holds now: moved aside by the train stage
    without overwrite=true (a rerun that answered failed prompts), and its line says so."""
    train = Pipeline(compose(TINY + [f"run_dir={tmp_path}", f"overwrite={str(overwrite).lower()}"])).train
    os.makedirs(train.checkpoints)
    write_json(os.path.join(train.checkpoints, "fingerprint.json"), {"fingerprint": "0123456789abcdef"})
    write_json(os.path.join(train.checkpoints, "settings.json"),
               {"fingerprint": fingerprints.settings_fingerprint(train.context.settings)})
    write_text(os.path.join(train.checkpoints, "latest"), "step5")  # a saved step: a folder of settings alone goes
    with caplog.at_level(logging.INFO, logger="dflash.stages.train"):
        assert not train.claim_checkpoints()
    (line,) = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert why in line and ("overwrite=true" in line) == overwrite
    assert os.path.isfile(tmp_path / "checkpoints.0123456789abcdef" / "settings.json")


def test_a_refusal_says_which_way_on_keeps_the_data_and_features(trained, tmp_path):
    """A changed train setting leaves the folder's data and features this command's: overwrite=true keeps them, a
    new run folder makes them again (a new user took the new folder and waited for both)."""
    refused = copied(trained, tmp_path) + TRAIN + ["train.epochs=2"]
    with pytest.raises(RunFolderError) as error:
        Pipeline(compose(refused)).run()
    assert str(error.value).endswith("add overwrite=true (which keeps this folder's data and features, the same for "
                                     "these settings; a new folder makes them again)")
    with pytest.raises(RunFolderError) as error:  # another data setting: neither keeps them
        Pipeline(compose(refused + ["data.max_new_tokens=17"])).run()
    assert str(error.value).endswith("add overwrite=true")
    os.remove(tmp_path / "run" / "data" / "done.json")  # data not finished: overwrite=true would make it again
    with pytest.raises(RunFolderError) as error:
        Pipeline(compose(refused)).run()
    assert str(error.value).endswith("add overwrite=true")
