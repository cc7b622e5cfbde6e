"""A checkpoint of one's own trained again into the same folder (target=hf, target.path unchanged): the data
stage's answers and synthetic prompts came from other weights, so they are written again, never reused; a trained
drafter's data is not replaced without being asked; an evaluation measures the target as it is now. Checkpoints
copied elsewhere or touched are the same weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from dflash.config import compose
from dflash.config.errors import RunFolderError
from dflash.models.targets.checkpoint_digest import SLICE, checkpoint_digest
from dflash.models.targets.tiny import build_tiny_target
from dflash.pipeline import Pipeline

TINY = ["+experiment=tiny", "show_progress=false", "data.limit=6", "data.heldout=0", "data.synthetic.count=4"]


def save_checkpoint(folder, seed):
    adapter = build_tiny_target("llama", seed=seed, tokenizer="builtin")
    adapter.model.save_pretrained(folder)
    adapter.tokenizer.save_pretrained(folder)


def journal_answers(path):
    return {r["id"]: r["response_ids"] for r in map(json.loads, open(path)) if r.get("status") == "done"}


def test_the_digest_follows_the_weights_not_where_they_are(tmp_path):
    save_checkpoint(tmp_path / "a", seed=0)
    digest = checkpoint_digest(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "README.md").write_text("notes on the model\n")
    os.utime(tmp_path / "b" / "config.json", (1, 1))
    assert checkpoint_digest(str(tmp_path / "b")) == digest  # a copy, a note, a touch: the same weights
    for other in ("LICENSE", "trainer_state.json", "all_results.json", "training_args.bin", "nohup.out"):
        (tmp_path / "b" / other).write_text("what a folder gathers beside the model")
    (tmp_path / "b" / "original").mkdir()
    assert checkpoint_digest(str(tmp_path / "b")) == digest
    (tmp_path / "b" / "added_tokens.json").write_text("{}")  # the tokenizer's: another model
    assert checkpoint_digest(str(tmp_path / "b")) != digest
    save_checkpoint(tmp_path / "c", seed=1)
    assert checkpoint_digest(str(tmp_path / "c")) != digest


def test_a_large_file_is_read_at_its_start_middle_and_end(tmp_path):
    weights = tmp_path / "model.gguf"
    data = bytearray(os.urandom(8 * SLICE))
    weights.write_bytes(data)
    before = checkpoint_digest(str(weights))
    for offset in (10, 4 * SLICE - 5, 8 * SLICE - 1):  # in each slice read
        changed = bytearray(data)
        changed[offset] ^= 1
        weights.write_bytes(changed)
        assert checkpoint_digest(str(weights)) != before, offset


def test_a_target_trained_again_in_place_writes_its_answers_again(tmp_path, capsys):
    folder, run_dir = tmp_path / "model", tmp_path / "run"
    save_checkpoint(folder, seed=0)
    command = TINY + ["target=hf", f"target.path={folder}", f"run_dir={run_dir}", "stages=[data]"]
    Pipeline(compose(command)).run()
    first = journal_answers(run_dir / "data" / "journal.jsonl")
    stats = json.loads((run_dir / "data" / "stats.json").read_text())
    assert stats["input_files"]["target.path"] == {"path": str(folder), "sha256": checkpoint_digest(str(folder))}

    Pipeline(compose(command)).run()  # the same weights: up to date, nothing written again
    assert journal_answers(run_dir / "data" / "journal.jsonl") == first

    save_checkpoint(folder, seed=1)  # trained again into the same folder
    capsys.readouterr()
    Pipeline(compose(command)).run()
    assert f"[data] target.path {folder} holds other weights since the dataset was built" in capsys.readouterr().err
    again = journal_answers(run_dir / "data" / "journal.jsonl")
    shared = {pid for pid in first if not pid.startswith("syn-")}  # the ShareGPT prompts, answered again
    assert shared and {pid for pid in again if not pid.startswith("syn-")} == shared
    assert [again[pid] for pid in sorted(shared)] != [first[pid] for pid in sorted(shared)]
    assert {pid for pid in again if pid.startswith("syn-")} != {pid for pid in first if pid.startswith("syn-")}
    aside = sorted(p.name for p in (run_dir / "data").glob("*.jsonl") if p.name.count(".") > 1)
    assert len(aside) == 2 and all(name.startswith(("journal.", "synthetic.")) for name in aside)  # kept, not lost
    assert json.loads((run_dir / "data" / "stats.json").read_text())["input_files"]["target.path"]["sha256"] == \
        checkpoint_digest(str(folder))


def old_version(monkeypatch):
    """What the version before the digest recorded: no weights (its journals, fingerprints, input files)."""
    monkeypatch.setattr("dflash.stages.data.target_weights", lambda settings: None)


def recorded_weights(path):
    return json.loads(path.read_text())["input_files"].get("target.path", {}).get("sha256")


def old_data_folder(tmp_path, monkeypatch):
    """(checkpoint folder, the data command, its data folder) of a data stage the previous version ran."""
    folder, run_dir = tmp_path / "model", tmp_path / "run"
    save_checkpoint(folder, seed=0)
    command = TINY + ["target=hf", f"target.path={folder}", f"run_dir={run_dir}", "stages=[data]"]
    with monkeypatch.context() as patch:
        old_version(patch)
        Pipeline(compose(command)).run()
    return folder, command, run_dir / "data"


def test_data_from_before_weights_were_recorded_is_trusted_until_they_change(tmp_path, monkeypatch):
    """A run folder of the previous version: its data are kept as they are (no answer written again, the same
    fingerprint, so capture and training stand), and record the weights seen now; weights trained into the folder
    later are told apart."""
    folder, command, data = old_data_folder(tmp_path, monkeypatch)
    first, built = journal_answers(data / "journal.jsonl"), json.loads((data / "stats.json").read_text())
    assert "target.path" not in built["input_files"]
    Pipeline(compose(command)).run()  # up to date: kept, with the weights seen now recorded
    assert recorded_weights(data / "stats.json") == checkpoint_digest(str(folder))
    assert json.loads((data / "first_weights.json").read_text())["sha256"] == checkpoint_digest(str(folder))
    (data / "done.json").unlink()  # built again for another reason: the same build, trusted
    Pipeline(compose(command)).run()
    assert json.loads((data / "stats.json").read_text())["fingerprint"] == built["fingerprint"]
    assert journal_answers(data / "journal.jsonl") == first and not list(data.glob("*.*.jsonl"))
    (data / "done.json").unlink()
    (data / "stats.json").unlink()  # a kill inside a rebuild's swap: the build's record gone, still trusted
    Pipeline(compose(command)).run()
    assert json.loads((data / "stats.json").read_text())["fingerprint"] == built["fingerprint"]
    assert journal_answers(data / "journal.jsonl") == first and not list(data.glob("*.*.jsonl"))
    save_checkpoint(folder, seed=1)  # trained again into the folder
    Pipeline(compose(command)).run()
    assert json.loads((data / "stats.json").read_text())["fingerprint"] != built["fingerprint"]
    again = journal_answers(data / "journal.jsonl")
    assert [again[pid] for pid in sorted(first) if pid in again and not pid.startswith("syn-")] != \
        [first[pid] for pid in sorted(first) if pid in again and not pid.startswith("syn-")]
    assert len(list(data.glob("*.*.jsonl"))) == 2  # the old weights' journals, kept aside


def test_a_folder_from_before_killed_in_its_first_rebuild_still_tells_new_weights_apart(tmp_path, monkeypatch):
    """The first command of this version on an old folder runs its data stage (for another reason) and is killed
    before it writes anything: the weights it saw are recorded already, so weights trained in before the rerun do
    not inherit the old answers."""
    from dflash.stages import data as data_stage

    folder, command, data = old_data_folder(tmp_path, monkeypatch)
    first = journal_answers(data / "journal.jsonl")
    (data / "done.json").unlink()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("dflash.data.dataset.build_dataset", killed)
        with pytest.raises(KeyboardInterrupt):
            Pipeline(compose(command)).run()
    assert json.loads((data / data_stage.FIRST_WEIGHTS).read_text())["sha256"] == checkpoint_digest(str(folder))
    save_checkpoint(folder, seed=1)
    Pipeline(compose(command)).run()
    again = journal_answers(data / "journal.jsonl")
    shared = sorted(pid for pid in first if pid in again and not pid.startswith("syn-"))
    assert shared and [again[pid] for pid in shared] != [first[pid] for pid in shared]
    assert len(list(data.glob("*.*.jsonl"))) == 2  # the old weights' journals, kept aside


@pytest.mark.slow
def test_a_trained_drafters_data_is_not_replaced_for_new_weights_and_its_evaluation_is_redone(tmp_path,
                                                                                              monkeypatch):
    folder, run_dir = tmp_path / "model", tmp_path / "run"
    save_checkpoint(folder, seed=0)
    command = TINY + ["target=hf", f"target.path={folder}", f"run_dir={run_dir}", "train.max_steps=2"]
    with monkeypatch.context() as patch:  # a run folder of the previous version
        old_version(patch)
        Pipeline(compose(command)).run()
    done = run_dir / "eval" / "done.json"
    measured = (run_dir / "eval" / "summary.json").read_bytes()
    Pipeline(compose(command)).run()  # its evaluation kept, not redone, with the weights seen now recorded
    assert (run_dir / "eval" / "summary.json").read_bytes() == measured
    assert recorded_weights(done) == checkpoint_digest(str(folder))
    kept = {p: p.read_bytes() for p in (run_dir / "data").rglob("*") if p.is_file()}
    save_checkpoint(folder, seed=1)
    with pytest.raises(RunFolderError, match=r"target.path .* holds other weights since this run's data stage.*"
                                             r"train on the checkpoint as it is now"):
        Pipeline(compose(command)).run()
    assert {p: p.read_bytes() for p in (run_dir / "data").rglob("*") if p.is_file()} == kept
    # The drafter as trained, measured with the target as it is now: its evaluation is not up to date.
    Pipeline(compose(command + ["stages=[eval]"])).run()
    assert recorded_weights(done) == checkpoint_digest(str(folder))
    assert (run_dir / "eval" / "summary.json").read_bytes() != measured


def test_an_evaluation_from_before_input_files_were_recorded_stays_kept(tmp_path):
    """Its done.json records no input files: adding the weights alone would make every other input file count as
    changed (an evaluation's unrecorded file does), so it is left as it is and trusted."""
    from dflash.config import settings_from
    from dflash.stages.data import record_first_weights
    from dflash.stages.evaluation import changed_eval_inputs

    folder = tmp_path / "model"
    save_checkpoint(folder, seed=0)
    settings = settings_from(compose(TINY + ["target=hf", f"target.path={folder}"]))
    old, recorded = tmp_path / "old", tmp_path / "recorded"
    for eval_dir, record in ((old, {"fingerprint": "f"}), (recorded, {"fingerprint": "f", "input_files": {}})):
        eval_dir.mkdir()
        (eval_dir / "done.json").write_text(json.dumps(record))
        record_first_weights(str(eval_dir / "done.json"), settings, create=False)
        assert changed_eval_inputs(settings, str(eval_dir)) == []
    assert "input_files" not in json.loads((old / "done.json").read_text())
    assert recorded_weights(recorded / "done.json") == checkpoint_digest(str(folder))
