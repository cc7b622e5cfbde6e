"""Another split of the same global batch is the same training (dflash/stages/batch_split.py): a run folder's
training resumes, or is kept, under a launch of other ranks, micro-batches or accumulation whose product is the same,
and a launch of another global batch is refused with the split that would resume it."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from dflash.config import compose
from dflash.config.errors import RunFolderError
from dflash.pipeline import Pipeline
from dflash.stages.batch_split import RecordedSplit, fingerprinted, keeping_batch, recorded_split

TINY = ["+experiment=tiny", "show_progress=false"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def settings(*overrides):
    return Pipeline(compose(TINY + list(overrides))).context.settings


def test_a_launch_is_fingerprinted_with_the_recorded_split_only_where_it_splits_the_same_global_batch():
    recorded = RecordedSplit(micro_batch_size=4, grad_accum=1, global_batch=8, ranks=2)
    for overrides, ranks, split in [
        (["train.micro_batch_size=4"], 1, (4, 1)),                          # the same split: itself
        (["train.micro_batch_size=4", "train.grad_accum=2"], 1, (4, 1)),    # 4 x 1 x 2 = 8
        (["train.micro_batch_size=2", "train.grad_accum=2"], 2, (4, 1)),    # 2 x 2 x 2 = 8
        (["train.micro_batch_size=8"], 1, (4, 1)),                          # 8 x 1 x 1 = 8
        (["train.micro_batch_size=4", "train.grad_accum=2"], 2, (4, 2)),    # 16: another training
        (["train.micro_batch_size=2"], 1, (2, 1)),                          # 2: another training
    ]:
        s = settings(*overrides)
        t = fingerprinted(s, recorded, ranks).train
        assert (t.micro_batch_size, t.grad_accum) == split, overrides
        assert t.lr == s.train.lr and t.epochs == s.train.epochs
    s = settings("train.grad_accum=2")
    assert fingerprinted(s, None, 1) is s
    assert s.train.grad_accum == 2  # the command's own settings are never changed, only what is fingerprinted


def test_the_split_that_keeps_a_global_batch_on_other_ranks():
    assert keeping_batch(32, 16, 1, 1) == "train.grad_accum=2"
    assert keeping_batch(32, 32, 2, 1) == "train.micro_batch_size=16"
    assert keeping_batch(24, 16, 1, 1) == "train.micro_batch_size=24"
    assert keeping_batch(6, 4, 4, 1) is None  # neither 6 / 16 nor 6 / 4 is whole


def test_the_recorded_split_is_the_record_of_the_last_launch_else_its_newest_tag(tmp_path):
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / "complete").write_text("4\n")
    assert recorded_split(str(tmp_path)) is None  # a tag from before layouts were recorded
    (tmp_path / "step4" / "layout.json").write_text(json.dumps({"world_size": 2, "global_batch_size": 8}))
    assert recorded_split(str(tmp_path)) is None  # nothing says how it was split
    (tmp_path / "config.yaml").write_text("train:\n  micro_batch_size: 4\n  grad_accum: 1\n")
    assert recorded_split(str(tmp_path)) == RecordedSplit(4, 1, 8, 2)  # a folder from before settings.json's split
    split = {"micro_batch_size": 2, "grad_accum": 2, "global_batch": 8, "ranks": 1}
    (tmp_path / "settings.json").write_text(json.dumps({"fingerprint": "f", "split": split}))
    assert recorded_split(str(tmp_path)) == RecordedSplit(2, 2, 8, 1)  # the last launch's, newer than its tags
    shutil.rmtree(tmp_path / "step4")
    assert recorded_split(str(tmp_path)) == RecordedSplit(2, 2, 8, 1)  # tags deleted to free the disk


def as_if_killed_after(run_dir, step):
    """The run folder as a training killed after checkpoint `step` leaves it: later tags, the final weights, the
    done marker and the exports gone."""
    checkpoints = run_dir / "checkpoints"
    for name in os.listdir(checkpoints):
        if name == "final" or name.startswith("step") and int(name[4:]) > step:
            shutil.rmtree(checkpoints / name)
    (checkpoints / "latest").write_text(f"step{step}")
    os.remove(checkpoints / "done.json")
    for name in ("export", "export_best"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def losses(run_dir):
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f) if "loss" in row}


def test_a_killed_training_resumes_under_another_split_of_its_global_batch(tmp_path, capsys):
    """4 sequences a micro-batch, killed after step 4, resumed as 2 x 2 accumulated: it goes on from step 5 to the
    uninterrupted run's end, nothing moved aside, and an evaluation of either split measures the same drafter."""
    run = TINY + ["stages=[data,capture,train,export]", "train.save_every=4", "train.keep_last=0"]
    whole = tmp_path / "whole"
    Pipeline(compose(run + [f"run_dir={whole}"])).run()
    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir)
    as_if_killed_after(run_dir, 4)
    resplit = run + [f"run_dir={run_dir}", "train.micro_batch_size=2", "train.grad_accum=2"]
    capsys.readouterr()
    Pipeline(compose(resplit)).run()
    out = capsys.readouterr().out
    assert "[train] resuming from the checkpoint of step 4" in out
    assert "train.micro_batch_size=2 x 1 rank(s) x train.grad_accum=2 is the global batch of 4 that this run folder's" \
           " training was started with as train.micro_batch_size=4 and train.grad_accum=1: the same training, resumed" \
           in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("run.") or "checkpoints." in p.name]
    assert not [p for p in run_dir.iterdir() if p.name.startswith("checkpoints.")]
    resumed, reference = losses(run_dir), losses(whole)  # fingerprinted as it started, 4 x 1 x 1 (below)
    assert sorted(resumed) == sorted(reference) and max(reference) > 8
    for step in reference:  # the same batches: only the summation order of 2 x 2 against 4 differs
        assert resumed[step] == pytest.approx(reference[step], rel=1e-3), step
    settings_record = json.loads((run_dir / "checkpoints" / "settings.json").read_text())
    assert settings_record["split"] == {"micro_batch_size": 4, "grad_accum": 1, "global_batch": 4, "ranks": 1}

    for name in os.listdir(run_dir / "checkpoints"):  # every step's checkpoint deleted to free the disk
        if name.startswith("step"):
            shutil.rmtree(run_dir / "checkpoints" / name)
    evaluated = Pipeline(compose(TINY + [f"run_dir={run_dir}", "train.micro_batch_size=2", "train.grad_accum=2",
                                         "stages=[eval]"])).run()
    again = Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[eval]"])).run()  # the split it started with
    assert evaluated["overall"] == again["overall"]
    capsys.readouterr()  # finished: kept by a launch of a third split, nothing trained
    Pipeline(compose(run + [f"run_dir={run_dir}", "train.micro_batch_size=1", "train.grad_accum=4"])).run()
    out = capsys.readouterr().out
    assert "[train] kept: train.micro_batch_size=1 x 1 rank(s) x train.grad_accum=4 is the global batch" in out


def test_a_launch_of_another_global_batch_is_refused_with_the_split_that_resumes(tmp_path):
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train,export]", "train.save_every=4",
                  "train.epochs=1"]
    Pipeline(compose(run)).run()
    as_if_killed_after(tmp_path, 4)
    with pytest.raises(RunFolderError, match=r"train.grad_accum: 1 -> 3; its global batch of 4 sequences, split "
                                             r"otherwise, is the same training: train.grad_accum=1 splits it on 1"):
        Pipeline(compose(run + ["train.grad_accum=3"])).run()
    with pytest.raises(RunFolderError, match=r"other settings \(train.lr: 0.0006 -> 0.01\); nothing"):
        Pipeline(compose(run + ["train.lr=0.01", "train.micro_batch_size=2", "train.grad_accum=2"])).run()
    two = Pipeline(compose(run))  # the same command on two ranks: 8 a step
    two.context.world_size = 2
    with pytest.raises(RunFolderError, match=r"this launch of 2 rank\(s\) has 8 \(train.micro_batch_size x ranks x "
                                             r"train.grad_accum\): add train.micro_batch_size=2 to resume it on these"):
        two.train.preflight(selected=True)
    two = Pipeline(compose(run + ["train.micro_batch_size=2"]))  # 2 x 2 ranks: the same global batch
    two.context.world_size = 2
    two.train.preflight(selected=True)
    assert two.train.checkpoint_fingerprint() == Pipeline(compose(run)).train.checkpoint_fingerprint()


def test_after_a_resplit_another_global_batch_is_refused_naming_the_split_that_resumes(tmp_path):
    """A run resumed as 2 x 2 is still a 4 x 1 training: a launch of 2 x 2 on two ranks (8 a step) is refused, its
    changes named against 4 x 1 and the split of two ranks that resumes it."""
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train,export]", "train.save_every=4",
                  "train.epochs=1"]
    Pipeline(compose(run)).run()
    as_if_killed_after(tmp_path, 4)
    Pipeline(compose(run + ["train.micro_batch_size=2", "train.grad_accum=2"])).run()
    as_if_killed_after(tmp_path, 4)
    two = Pipeline(compose(run + ["train.micro_batch_size=2", "train.grad_accum=2"]))
    two.context.world_size = 2
    with pytest.raises(RunFolderError, match=r"train.micro_batch_size: 4 -> 2; train.grad_accum: 1 -> 2; its global "
                                             r"batch of 4 sequences, split otherwise, is the same training: "
                                             r"train.grad_accum=1 splits it on 2 rank\(s\)"):
        two.train.preflight(selected=True)


def test_the_split_of_another_training_never_keys_these_settings(tmp_path):
    """The folder holds a training of other settings at 2 x 2: a command of 4 x 1 and another learning rate is
    fingerprinted as itself, so its own checkpoints, moved aside earlier, come back under their own key."""
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture,train]", "train.epochs=1"]
    Pipeline(compose(run + ["train.micro_batch_size=2", "train.grad_accum=2"])).run()
    other = Pipeline(compose(run + ["train.lr=0.05", "overwrite=true"]))
    assert other.train.fingerprinted_settings is other.context.settings
    same = Pipeline(compose(run))  # the training there, as 4 x 1: the recorded split
    assert same.train.fingerprinted_settings.train.micro_batch_size == 2


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_two_rank_training_killed_resumes_on_one_rank_from_the_command_line(tmp_path):
    """Losing a node, as a user meets it: a 2-rank torchrun training of 2 sequences a rank, killed after step 4,
    resumes as one process accumulating 2 x 2 (its tag converted to a universal checkpoint) to the end the 2-rank
    run reached, the losses of the same steps equal."""
    env = {**os.environ, "PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    run = TINY + ["logging.tensorboard=false", "train.save_every=4", "train.keep_last=0", "train.epochs=2"]
    whole = tmp_path / "whole"
    prepared = subprocess.run([sys.executable, "-m", "dflash.extract", *run, f"run_dir={whole}"], env=env,
                              capture_output=True, text=True, timeout=600)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    two_ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                "2", "-m", "dflash.train", *run, f"run_dir={whole}", "train.micro_batch_size=2",
                                "stages=[train]"], env=env, capture_output=True, text=True, timeout=600)
    assert two_ranks.returncode == 0, two_ranks.stdout[-2000:] + two_ranks.stderr[-3000:]
    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir)
    as_if_killed_after(run_dir, 4)
    one_rank = subprocess.run([sys.executable, "-m", "dflash.train", *run, f"run_dir={run_dir}",
                               "train.micro_batch_size=2", "train.grad_accum=2", "stages=[train]"], env=env,
                              capture_output=True, text=True, timeout=600)
    assert one_rank.returncode == 0, one_rank.stdout[-2000:] + one_rank.stderr[-3000:]
    assert "[train] resuming from the checkpoint of step 4" in one_rank.stdout
    assert "the same training, resumed" in one_rank.stdout
    resumed, reference = losses(run_dir), losses(whole)
    assert sorted(resumed) == sorted(reference) and max(reference) > 4
    for step in reference:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-3), step
