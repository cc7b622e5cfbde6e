"""A fault campaign on the tiny pipeline: nothing corrupt is trusted, no kill loses work.

One uninterrupted run is the reference; a run interrupted after its step-4 checkpoint (and its first held-out
evaluation, which wrote checkpoints/best) is the state each fault is applied to: a checkpoint's model states or
optimizer states flipped, a model-states file cut to half, NaN optimizer states under matching checksums, a feature
shard flipped, checkpoints/best flipped; and the exports of the finished run flipped. Each time the same command
names the bad file and falls back, repairs it or stops naming it; where it goes on, the run ends with the reference's
losses and exported weights, byte for byte.
The same end is asked of a run SIGKILLed during capture, inside a step, inside a checkpoint save and inside pruning.
"""

import json
import os
import shutil
import signal

import pytest

from dflash.config import compose
from dflash.pipeline import Pipeline, run_command
from dflash.train.checkpoint_policy import CheckpointPolicy
from tests.forked import process_context
from tests.test_checkpoint_integrity import flip, model_states
from tests.test_divergence import poison_optimizer_state
from tests.test_store_repair import TINY, flip as flip_shard, sha
from tests.test_trainer import held_rendezvous

pytestmark = pytest.mark.slow

SETTINGS = TINY + ["train.save_every=2", "data.heldout=4", "train.eval_every=4"]  # 12 steps, 3 evaluations
TRAINED = ("checkpoints", "export", "export_best", "metrics.jsonl", "tensorboard", "training_curve.png")


def config(run_dir, stages="[data,capture,train]"):
    return compose(SETTINGS + [f"run_dir={run_dir}", f"stages={stages}"])


def losses(run_dir):
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def assert_same_drafter(run_dir, reference):
    assert losses(run_dir) == losses(reference)
    for folder in ("export", "export_best"):
        for name in ("model.safetensors", "config.json"):
            assert sha(run_dir / folder / name) == sha(reference / folder / name), f"{folder}/{name}"


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("campaign") / "reference"
    Pipeline(config(run_dir)).run()
    assert json.loads((run_dir / "export_best" / "best.json").read_text())["step"] == 12
    return run_dir


@pytest.fixture(scope="module")
def interrupted(reference):
    """The reference's data and features, trained again and stopped right after the step-4 checkpoint."""
    run_dir = untrained(reference, reference.parent / "interrupted")
    save = CheckpointPolicy.save

    def save_then_stop(self, engine, step, budget):
        save(self, engine, step, budget)
        if step == 4:
            raise Interrupted

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Interrupted):
        patch.setattr(CheckpointPolicy, "save", save_then_stop)
        Pipeline(config(run_dir)).run()
    assert sorted(os.listdir(run_dir / "checkpoints"))[:3] == ["best", "config.yaml", "fingerprint.json"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step4"
    return run_dir


def untrained(reference, run_dir, keep_features=True):
    """A copy of the reference with nothing trained (and without features unless `keep_features`)."""
    shutil.copytree(reference, run_dir)
    for name in TRAINED + (() if keep_features else ("features",)):
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return run_dir


@pytest.fixture
def run_dir(interrupted, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(interrupted, copy)
    return copy


def optimizer_states(folder):
    return next(os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith("optim_states.pt"))


def cut_to_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("fault", ["model states flipped", "optimizer states flipped", "model states cut to half"])
def test_a_corrupt_checkpoint_is_named_and_the_run_ends_as_the_reference(run_dir, reference, fault, capsys):
    step4 = run_dir / "checkpoints" / "step4"
    bad = optimizer_states(step4) if fault.startswith("optimizer") else model_states(str(step4))
    (cut_to_half if fault.endswith("half") else flip)(bad)
    Pipeline(config(run_dir)).run()
    err = capsys.readouterr().err
    assert f"checkpoint {step4} is corrupt: {os.path.basename(bad)} differs" in err and "resuming from step2" in err
    assert_same_drafter(run_dir, reference)


def test_a_corrupt_feature_shard_is_named_set_aside_and_recaptured(run_dir, reference):
    manifest = json.loads((run_dir / "features" / "manifest.json").read_text())
    shard = run_dir / "features" / manifest["shards"][1]["file"]
    flip_shard(shard)
    with pytest.raises(ValueError, match=rf"{shard.name} is corrupt.*rerun the same command"):
        Pipeline(config(run_dir)).run()
    Pipeline(config(run_dir)).run()
    assert sha(shard) == sha(reference / "features" / shard.name)
    assert_same_drafter(run_dir, reference)


def test_a_checkpoint_that_verifies_but_diverges_stops_with_nothing_non_finite_kept(run_dir, capsys):
    step4 = run_dir / "checkpoints" / "step4"
    poison_optimizer_state(str(step4))  # NaN moments under matching checksums: only the weights show it
    with pytest.raises(SystemExit) as stopped:
        run_command(config(run_dir))
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and err.count("\n") == 1
    assert "training diverged at step 6: the drafter's weights hold NaN" in err and f"{step4}, holds finite" in err
    assert (run_dir / "checkpoints" / "latest").read_text() == "step4" and not (run_dir / "export").exists()


def test_a_corrupt_best_checkpoint_stops_the_resume_naming_it(run_dir, reference, capsys):
    best = run_dir / "checkpoints" / "best"
    flip(str(best / "model.safetensors"))
    with pytest.raises(SystemExit) as stopped:
        run_command(config(run_dir))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert f"best checkpoint {best} is corrupt: model.safetensors differs" in err and f"mv {best} {best}.corrupt" in err
    os.replace(best, run_dir / "checkpoints" / "best.corrupt")  # what the message says to do
    Pipeline(config(run_dir)).run()
    assert_same_drafter(run_dir, reference)  # the best is step 12's, which the resumed run evaluates again


def test_a_corrupt_export_is_named_by_the_evaluator_and_exported_again(reference, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    flip(str(run_dir / "export" / "model.safetensors"))
    flip(str(run_dir / "export_best" / "model.safetensors"))
    with pytest.raises(SystemExit) as stopped:
        run_command(config(run_dir, stages="[eval]"))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    evaluated = run_dir / "export_best"  # eval.checkpoint=best
    assert f"{evaluated} is corrupt: model.safetensors differs" in err and "python -m dflash.train" in err
    Pipeline(config(run_dir)).run()
    err = capsys.readouterr().err
    for folder in ("export", "export_best"):
        assert f"{run_dir / folder} is corrupt: model.safetensors differs" in err
    assert_same_drafter(run_dir, reference)


def kill_at(point, run_dir):
    """Run the pipeline in this process, which SIGKILLs itself at `point` (the child of test_a_sigkill_...)."""
    from dflash.extract.store import ShardWriter
    from dflash.train import checkpoints
    from dflash.train.engine import TrainEngine

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    def after(cls, name, when):
        real = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            result = real(self, *args, **kwargs)
            if when(*args):
                die()
            return result
        setattr(cls, name, wrapped)

    steps = []
    if point == "capture":  # the third shard written, the manifest not yet told
        after(ShardWriter, "write_shard", lambda index, *_: index == 2)
    elif point == "step":  # step 7's backward done, its optimizer step not
        after(TrainEngine, "backward", lambda *_: steps.append(1) or len(steps) == 7)
    elif point == "checkpoint save":  # DeepSpeed's files of step 6 written; its RNG, checksums, `complete` not
        after(TrainEngine, "save", lambda directory, tag, *_: tag == "step6")
    elif point == "pruning":  # step 2 renamed to .pruned-step2 and one of its files deleted (keep_last=3)
        rmtree = shutil.rmtree

        def rmtree_dies(path, *args, **kwargs):
            if os.path.basename(path).startswith(checkpoints.PRUNED):
                os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
                die()
            rmtree(path, *args, **kwargs)
        shutil.rmtree = rmtree_dies
    Pipeline(config(run_dir)).run()


def leftovers(run_dir):
    """Temporary files, half-deleted or incomplete checkpoint folders: what no finished run holds."""
    found = [str(path) for path in run_dir.rglob("*") if ".tmp" in path.name or ".pruned-" in path.name]
    checkpoints = run_dir / "checkpoints"
    found += [name for name in os.listdir(checkpoints)
              if name.startswith("step") and not (checkpoints / name / "complete").exists()]
    return found


def killed_child(point, run_dir, rendezvous):
    """The child process of test_a_sigkill_...: kill_at with one thread of its own, meeting itself in the store of
    the test's held_rendezvous (a port it picked itself could be taken by another listener before it bound it)."""
    import torch

    os.environ.update(rendezvous)
    torch.set_num_threads(1)
    kill_at(point, run_dir)


@pytest.mark.parametrize("point", ["capture", "step", "checkpoint save", "pruning"])
def test_a_sigkill_at_each_point_then_the_same_command_ends_as_the_reference(reference, tmp_path, point):
    run_dir = untrained(reference, tmp_path / "run", keep_features=point != "capture")
    with held_rendezvous() as rendezvous:
        child = process_context().Process(target=killed_child, args=(point, run_dir, rendezvous))
        child.start()
        child.join(timeout=300)
    assert child.exitcode == -signal.SIGKILL, f"the child ended with {child.exitcode} (its output is above)"
    Pipeline(config(run_dir)).run()
    assert_same_drafter(run_dir, reference)
    for shard in json.loads((reference / "features" / "manifest.json").read_text())["shards"]:
        assert sha(run_dir / "features" / shard["file"]) == shard["sha256"]
    assert leftovers(run_dir) == []
