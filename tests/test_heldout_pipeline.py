"""The held-out split wired through the pipeline: data holds prompts out, capture stores their target passes,
training replays them and keeps the best weights, the eval stage evaluates those (CPU, tiny)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import ConfigError, compose
from dflash.pipeline import Pipeline

HELDOUT = ["+experiment=tiny", "show_progress=false", "data.heldout=4", "train.eval_every=5"]


@pytest.fixture(scope="module")
def heldout_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("heldout")
    Pipeline(compose(HELDOUT + [f"run_dir={run_dir}"])).run()
    return run_dir


def test_heldout_prompts_are_replayed_during_training_and_the_best_is_exported(heldout_run):
    stats = json.loads((heldout_run / "data" / "stats.json").read_text())
    assert stats["heldout"] == 4 and (heldout_run / "features" / "heldout.safetensors").exists()
    records = [json.loads(line) for line in (heldout_run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "heldout/tau" in r]
    last = records[-1]["step"]
    assert [r["step"] for r in evaluated] == sorted({*range(5, last + 1, 5), last})
    best = json.loads((heldout_run / "export_best" / "best.json").read_text())
    assert best["tau"] == max(r["heldout/tau"] for r in evaluated)
    assert best["step"] == min(r["step"] for r in evaluated if r["heldout/tau"] == best["tau"])
    summary = json.loads((heldout_run / "eval" / "summary.json").read_text())
    assert summary["overall"]["tau"] >= 1.0
    assert (heldout_run / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_exported_best_follows_best_by(tmp_path):
    """train.best_by=tau_T1: capture continues the held-out prompts at T=1, every held-out evaluation records the
    estimate there, and export_best/ holds the step with the highest one."""
    Pipeline(compose(HELDOUT + [f"run_dir={tmp_path}", "train.best_by=tau_T1", "stages=[data,capture,train]"])).run()
    assert (tmp_path / "features" / "heldout_T1.safetensors").exists()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "heldout/tau_T1" in r]
    assert evaluated and all("heldout/tau" in r for r in evaluated)
    best = json.loads((tmp_path / "export_best" / "best.json").read_text())
    assert best["best_by"] == "tau_T1" and best["tau_T1"] == max(r["heldout/tau_T1"] for r in evaluated)
    assert best["step"] == min(r["step"] for r in evaluated if r["heldout/tau_T1"] == best["tau_T1"])
    # Another temperature on the same (up-to-date) capture: only the passes it needs are added.
    Pipeline(compose(HELDOUT + [f"run_dir={tmp_path}", "train.best_by=tau_T0.5", "stages=[data,capture]",
                              "overwrite=true"])).run()
    assert (tmp_path / "features" / "heldout_T0.5.safetensors").exists()
    # Another budget for the continuations: the passes at that temperature are made again with it.
    from dflash.train.heldout import sampled_budget

    sampled = str(tmp_path / "features" / "heldout_T0.5.safetensors")
    before = sampled_budget(sampled)
    Pipeline(compose(HELDOUT + [f"run_dir={tmp_path}", "train.best_by=tau_T0.5", "stages=[data,capture]",
                              f"train.heldout_max_new_tokens={before + 5}", "overwrite=true"])).run()
    assert sampled_budget(sampled) == before + 5


def test_training_curve_keeps_the_last_record_of_a_step(tmp_path):
    from dflash.train.metrics_log import read_records

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "loss": 2.4}, {"step": 3, "loss": 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["loss"] for r in read_records(str(path))] == [3.0, 2.4, 2.0]
    path.write_text("")
    with pytest.raises(ValueError, match="no training records"):
        from dflash.train.curve_plot import plot_training_curve
        plot_training_curve(str(path), str(tmp_path / "c.png"))


def test_eval_checkpoint_picks_best_or_final(heldout_run):
    best = Pipeline(compose(HELDOUT + [f"run_dir={heldout_run}"]))
    assert best.eval.drafter_dir() == str(heldout_run / "export_best")
    final = Pipeline(compose(HELDOUT + [f"run_dir={heldout_run}", "eval.checkpoint=final"]))
    assert final.eval.drafter_dir() == str(heldout_run / "export")
    if json.loads((heldout_run / "export_best" / "best.json").read_text())["step"] != 12:
        # Different weights in the two folders whenever the best is not the last step.
        a = load_file(str(heldout_run / "export_best" / "model.safetensors"))
        b = load_file(str(heldout_run / "export" / "model.safetensors"))
        assert any(not torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="eval.checkpoint"):
        Pipeline(compose(HELDOUT + [f"run_dir={heldout_run}", "eval.checkpoint=newest"])).eval.drafter_dir()
    # Where best is asked for and the final weights are measured, the drafter's line says why.
    assert best.eval.why_final(best.eval.drafter_dir()) == final.eval.why_final(str(heldout_run / "export")) == ""
    assert "no best held-out checkpoint" in best.eval.why_final(str(heldout_run / "export"))
    none_held = Pipeline(compose(HELDOUT + [f"run_dir={heldout_run}", "data.heldout=0", "train.eval_every=0"]))
    assert "data.heldout=0 holds out no prompts" in none_held.eval.why_final(str(heldout_run / "export"))


def test_a_run_stopped_before_its_export_is_evaluated_from_its_best_checkpoint(heldout_run, tmp_path):
    """Training stopped by a time limit or a signal leaves checkpoints and no export: the eval stage exports the
    best held-out checkpoint so far and measures it; without one it names what is missing."""
    import shutil

    stopped = tmp_path / "stopped"
    shutil.copytree(heldout_run, stopped)
    for folder in ("export", "export_best", "eval", "checkpoints/final"):
        shutil.rmtree(stopped / folder)
    os.remove(stopped / "checkpoints" / "done.json")
    overrides = HELDOUT + [f"run_dir={stopped}", "stages=[eval]"]
    summary = Pipeline(compose(overrides)).run()
    best = json.loads((stopped / "checkpoints" / "best" / "best.json").read_text())
    assert json.loads((stopped / "export_best" / "best.json").read_text()) == best
    assert summary["overall"]["tau"] >= 1.0 and (stopped / "eval" / "summary.json").exists()
    a = load_file(str(stopped / "export_best" / "model.safetensors"))
    b = load_file(str(heldout_run / "export_best" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same best, exported again
    weights = stopped / "export_best" / "model.safetensors"
    written = weights.stat().st_mtime_ns
    Pipeline(compose(overrides)).eval.drafter_to_evaluate()  # a rerun finds that best exported already
    assert weights.stat().st_mtime_ns == written

    shutil.rmtree(stopped / "checkpoints" / "best")
    shutil.rmtree(stopped / "eval")
    with pytest.raises(FileNotFoundError, match="the train and export stages have not finished"):
        Pipeline(compose(overrides)).run()
    with pytest.raises(FileNotFoundError, match="the train and export stages have not finished"):
        Pipeline(compose(overrides + ["eval.checkpoint=final"])).run()


def test_a_stopped_run_whose_features_were_deleted_names_what_to_capture_again(heldout_run, tmp_path):
    # features/ is the largest entry of the closing block's disk line: deleted, the best checkpoint's export read
    # features/target.json and ended in a traceback.
    import shutil

    stopped = tmp_path / "stopped"
    shutil.copytree(heldout_run, stopped)
    for folder in ("export", "export_best", "eval", "checkpoints/final", "features"):
        shutil.rmtree(stopped / folder)
    os.remove(stopped / "checkpoints" / "done.json")
    with pytest.raises(ConfigError, match=r"features/target.json is missing: the drafter's shape and taps come from "
                                          r"the capture stage's record of the target; capture again \(python -m "
                                          r"dflash.extract name=\S+\), which rewrites it"):
        Pipeline(compose(HELDOUT + [f"run_dir={stopped}", "stages=[eval]"])).run()


def test_an_export_or_checkpoints_of_other_settings_are_not_evaluated_as_these(heldout_run, tmp_path):
    """After a settings change the old export and the old checkpoints belong to the old settings: the eval stage
    must not measure (or report as done) either of them under the new ones."""
    import shutil

    run = tmp_path / "changed"
    shutil.copytree(heldout_run, run)
    overrides = HELDOUT + [f"run_dir={run}", "stages=[eval]", "train.lr=0.01"]
    with pytest.raises(ConfigError, match="holds a drafter trained with other settings"):  # the run folder's guard
        Pipeline(compose(overrides)).run()
    overrides.append("overwrite=true")  # past the guard, the eval stage's own check refuses too
    with pytest.raises(FileNotFoundError, match="from other settings"):
        Pipeline(compose(overrides)).run()
    shutil.rmtree(run / "export")  # a stopped run: only the (old settings') checkpoints are left
    with pytest.raises(FileNotFoundError, match="holds no best held-out checkpoint of these settings"):
        Pipeline(compose(overrides)).run()
