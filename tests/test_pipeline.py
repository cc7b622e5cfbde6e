"""The whole pipeline on the tiny target, the experiment files, and the errors users see for bad input."""

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from dflash.config import CONFIG_DIR, ConfigError, compose, settings_from
from dflash.pipeline import Pipeline, run_command
from dflash.stages.shapes import drafter_config
from tests.forked import run_ranks

TINY = ["+experiment=tiny", "show_progress=false"]
STORED_CURVE = os.path.join(os.path.dirname(__file__), "data", "tiny_loss_curve.json")


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


def forbid_every_stage(monkeypatch) -> None:
    """Any stage's work fails the test: for commands that must find every stage finished."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    for work in ("dflash.data.dataset.build_dataset", "dflash.extract.capture.capture_dataset",
                 "dflash.train.loop.train", "dflash.eval.export.export_zlab", "dflash.eval.evaluate.evaluate"):
        monkeypatch.setattr(work, must_not_run)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("tiny"))
    summary = Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    return run_dir, summary


def test_tiny_run_writes_one_folder_with_every_stage(tiny_run):
    run_dir, summary = tiny_run
    for path in ["config.yaml", "data/dataset", "data/stats.json", "features/manifest.json", "checkpoints/latest",
                 "export/config.json", "export/model.safetensors", "eval/summary.json", "metrics.jsonl"]:
        assert os.path.exists(os.path.join(run_dir, path)), path
    with open(os.path.join(run_dir, "export", "config.json"), encoding="utf-8") as f:
        assert json.load(f)["max_position_embeddings"] == 4096  # the tiny target's context, as it serves beside it
    with open(os.path.join(run_dir, "eval", "summary.json"), encoding="utf-8") as f:
        on_disk = json.load(f)
    for name in ["humaneval", "gsm8k", "overall"]:
        entry = on_disk["prompt_sets"][name] if name != "overall" else on_disk["overall"]
        assert 1.0 <= entry["tau"] <= 4.0
        assert 0.0 <= entry["acceptance_rate"] <= 1.0 and len(entry["per_position"]) == 3
    # The second turns are asked on the target's answers to the first, of eval.max_new_tokens tokens at most.
    assert "mtbench_turn2" in on_disk["prompt_sets"]
    assert on_disk["first_turn_answer_max_new_tokens"] == {"mtbench_turn2": 16}
    with open(os.path.join(run_dir, "data", "stats.json"), encoding="utf-8") as f:
        stats = json.load(f)
    assert stats["done"] + stats["skipped"] + stats["failed"] == stats["total"] == 32
    assert stats["skipped"] > 0  # some ShareGPT prompts exceed the tiny max_length: skipped and counted


def test_tiny_loss_curve_matches_the_stored_curve(tiny_run):
    """A refactor that changes the math (mask, labels, weights, normalisation, init, data order) fails here.

    Regenerate deliberately with: python -m dflash.train +experiment=tiny run_dir=/tmp/t && copy its losses.
    """
    run_dir, _ = tiny_run
    with open(STORED_CURVE, encoding="utf-8") as f:
        stored = json.load(f)["loss"]
    torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(stored), rtol=2e-4, atol=2e-4)


def test_rerun_skips_finished_stages(tiny_run, monkeypatch):
    run_dir, summary = tiny_run

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr("dflash.data.dataset.build_dataset", must_not_run)
    monkeypatch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
    monkeypatch.setattr("dflash.train.loop.train", must_not_run)
    again = Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert again["overall"]["tau"] == summary["overall"]["tau"]


def test_a_copied_run_folder_is_up_to_date_evaluation_included(tiny_run, tmp_path, monkeypatch):
    """Every stage's fingerprint names no folder: a run folder copied elsewhere (or moved) is a finished run there,
    its evaluation kept. The evaluation once named its drafter by absolute path and ran again."""
    run_dir = tmp_path / "copied"
    shutil.copytree(tiny_run[0], run_dir)
    evaluated = (run_dir / "eval" / "summary.json").read_bytes()

    forbid_every_stage(monkeypatch)
    again = Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert again["overall"] == tiny_run[1]["overall"] and (run_dir / "eval" / "summary.json").read_bytes() == evaluated


def test_a_rerun_that_keeps_every_stage_says_no_default_runs_line(tiny_run, tmp_path, monkeypatch, capsys):
    """The CPU demo's line announces minutes of work: a rerun of a finished run has none to announce."""
    from dflash.config import command_line

    run_dir = tmp_path / "copied"
    shutil.copytree(tiny_run[0], run_dir)
    forbid_every_stage(monkeypatch)
    monkeypatch.setattr(command_line, "_default_run_line", "dflash: no GPU: this is the CPU demo (a test's line)")
    capsys.readouterr()
    Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert "CPU demo" not in capsys.readouterr().err
    (run_dir / "eval" / "done.json").unlink()  # the evaluation is left to do: the line is said before it
    with pytest.raises(AssertionError, match="a finished stage ran again"):
        Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert "this is the CPU demo (a test's line)" in capsys.readouterr().err


def test_an_evaluation_marked_with_its_drafter_s_absolute_path_is_kept(tiny_run, tmp_path, monkeypatch):
    """Run folders evaluated before the evaluation named its drafter by folder name are not evaluated again."""
    from dflash.config import fingerprints
    from dflash.run_files import read_json, write_json

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run[0], run_dir)
    marker = run_dir / "eval" / "done.json"
    settings = settings_from(compose(TINY + [f"run_dir={run_dir}"]))
    export_key = read_json(str(run_dir / "export" / "done.json"))["fingerprint"]
    old_key = fingerprints.eval_fingerprint(settings, export_key, str(run_dir / "export"))
    write_json(str(marker), {**read_json(str(marker)), "fingerprint": old_key})
    monkeypatch.setattr("dflash.eval.evaluate.evaluate", lambda *args, **kwargs: pytest.fail("evaluated again"))
    assert Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()["overall"] == tiny_run[1]["overall"]


def test_a_finished_training_without_final_weights_or_checkpoints_is_never_retrained(tiny_run, tmp_path,
                                                                                      monkeypatch):
    """Final weights and every step checkpoint deleted (say, to free the disk): they come back from the whole
    export, and without one the command stops, naming them; training from step 0 would replace the run's metrics."""
    from dflash.config.errors import RunFolderError

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run[0], run_dir)
    for name in os.listdir(run_dir / "checkpoints"):
        if name == "final" or name.startswith("step"):
            shutil.rmtree(run_dir / "checkpoints" / name)
    os.remove(run_dir / "checkpoints" / "latest")
    metrics = (run_dir / "metrics.jsonl").read_bytes()

    def must_not_train(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr("dflash.train.loop.train", must_not_train)
    again = Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert again["overall"] == tiny_run[1]["overall"]
    assert (run_dir / "checkpoints" / "final").is_dir() and (run_dir / "metrics.jsonl").read_bytes() == metrics
    shutil.rmtree(run_dir / "checkpoints" / "final")
    shutil.rmtree(run_dir / "export")
    with pytest.raises(RunFolderError, match="final is missing, and no checkpoint of this finished training"):
        Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


def test_an_incompatible_drafter_is_refused_before_the_target_answers_the_prompt_sets(tiny_run, tmp_path,
                                                                                      monkeypatch):
    def incompatible(drafter, adapter):
        raise ValueError("drafter hidden_size 128 != target hidden_size 64")

    def must_not_generate(*args, **kwargs):
        raise AssertionError("the target answered the prompt sets before the drafter was checked")

    monkeypatch.setattr("dflash.eval.evaluate.check_compatible", incompatible)
    monkeypatch.setattr("dflash.eval.evaluate.load_prompt_sets", must_not_generate)
    with pytest.raises(ValueError, match="hidden_size 128 != target hidden_size 64"):
        Pipeline(compose(TINY + [f"run_dir={tiny_run[0]}", "stages=[eval]", f"eval.out_dir={tmp_path / 'e'}"])).run()


@pytest.mark.parametrize("capture", ["offline", "colocated"])
def test_the_target_leaves_rank_0_for_training_unless_training_runs_it(capture, tmp_path, monkeypatch):
    """Rank 0 writes the capture stage's files with the target, then (but for colocated capture, where the trainer
    runs the target) frees it before training: at the 27B shape that is ~54 GB of a training GPU."""
    resident = []

    def record(*args, **kwargs):
        resident.append(pipeline.context._target is not None)
        raise KeyboardInterrupt  # enough: training itself is not under test

    monkeypatch.setattr("dflash.train.loop.train", record)
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path}", f"capture={capture}"]))
    with pytest.raises(KeyboardInterrupt):
        pipeline.run()
    assert resident == [capture == "colocated"]


def test_the_closing_rows_of_an_evaluation_without_a_draft_step(tiny_run):
    """Every prompt stopped at its first token (the prefill's): no draft step, tau None, and the closing block
    still prints."""
    from dflash.stages.evaluation import EvalStage

    stage = EvalStage.__new__(EvalStage)
    stage.out, stage.context = tiny_run[0], None
    stage.summary = {"prompt_sets": {"gsm8k": {"tau": None}}, "overall": {"tau": None}}
    assert stage.closing_rows()[1] == ("tau", "gsm8k -; overall -")


def test_a_run_folder_whose_train_stage_marked_its_export_resumes_without_training_or_exporting(tiny_run, tmp_path,
                                                                                                 monkeypatch):
    """The layout in which training and export were one stage: its done.json in export/, the final weights only in
    the export, no checkpoints/done.json or checkpoints/final/. The train stage copies both where it keeps them and
    is done; the export and the evaluation of it are kept as they were."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run[0], run_dir)
    os.remove(run_dir / "checkpoints" / "done.json")
    shutil.rmtree(run_dir / "checkpoints" / "final")
    exported = {name: (run_dir / "export" / name).read_bytes() for name in os.listdir(run_dir / "export")}
    evaluated = (run_dir / "eval" / "summary.json").read_bytes()

    forbid_every_stage(monkeypatch)
    again = Pipeline(compose(TINY + [f"run_dir={run_dir}"])).run()
    assert again["overall"] == tiny_run[1]["overall"] and (run_dir / "eval" / "summary.json").read_bytes() == evaluated
    assert {name: (run_dir / "export" / name).read_bytes() for name in exported} == exported
    marker = json.loads((run_dir / "checkpoints" / "done.json").read_text())
    assert marker == json.loads((run_dir / "export" / "done.json").read_text()) and set(marker) == {"fingerprint",
                                                                                                    "checkpoint"}
    # The weights copied from the export export to the same bytes: an export lost later is made again from them.
    monkeypatch.undo()
    shutil.rmtree(run_dir / "export")
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[export]"])).run()
    assert {name: (run_dir / "export" / name).read_bytes() for name in exported} == exported


def test_max_steps_ends_training_and_its_schedule_there(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    full = len(losses(run_dir))
    Pipeline(compose(TINY + [f"run_dir={tmp_path}", "train.max_steps=3", "stages=[data,capture,train]"])).run()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert full > 3 and [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["lr"] == 0.0  # the cosine reached its end at the cap, not at the epochs' end


def test_warmup_stable_decay_holds_the_peak_lr_then_decays_to_the_end(tmp_path):
    Pipeline(compose(TINY + [f"run_dir={tmp_path}", "train.max_steps=9", "train.warmup_ratio=0",
                             "train.decay_ratio=0.5", "stages=[data,capture,train]"])).run()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        lrs = [json.loads(line)["lr"] for line in f]
    peak = compose(TINY).train.lr
    # The 8 steps after the 1-step warmup: 4 at the peak, 4 of cosine decay ending at 0 on the last step.
    assert lrs[:5] == [pytest.approx(peak)] * 5 and lrs[-1] == 0.0
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))


def test_eval_out_dir_keeps_a_second_evaluation_beside_the_first(tiny_run, tmp_path):
    run_dir, summary = tiny_run
    first = (Path(run_dir) / "eval" / "summary.json").read_bytes()
    other = tmp_path / "eval_final"
    again = Pipeline(compose(TINY + [f"run_dir={run_dir}", f"eval.out_dir={other}", "eval.checkpoint=final",
                                     "stages=[eval]"])).run()
    assert (other / "summary.json").is_file() and (other / "summary.csv").is_file()
    assert (Path(run_dir) / "eval" / "summary.json").read_bytes() == first  # the first evaluation is untouched
    assert set(again["prompt_sets"]) == set(summary["prompt_sets"])


@pytest.mark.parametrize("override", ["drafter.intermediate_size=96", "target.mask_token_id=4"])
def test_a_drafter_setting_retrains_without_redoing_data_or_capture(tiny_run, tmp_path, monkeypatch, override):
    run_dir, _ = tiny_run
    for stage in ("data", "features"):
        subprocess.run(["cp", "-r", os.path.join(run_dir, stage), str(tmp_path / stage)], check=True)

    def must_not_run(*args, **kwargs):
        raise AssertionError("data or capture ran again for a drafter-only change")

    monkeypatch.setattr("dflash.data.dataset.build_dataset", must_not_run)
    monkeypatch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
    Pipeline(compose(TINY + [f"run_dir={tmp_path}", override, "stages=[data,capture,train]"])).run()
    with open(tmp_path / "export" / "config.json", encoding="utf-8") as f:
        exported = json.load(f)
    if override.startswith("drafter"):
        assert exported["intermediate_size"] == 96
    else:
        assert exported["dflash_config"]["mask_token_id"] == 4


def test_a_mask_token_given_after_capture_is_checked_before_training(tiny_run, tmp_path, monkeypatch):
    """A target.mask_token_id given after capture keeps the features, and is still refused where the data produce
    it, before any step trains on it (with stages=[train] too)."""
    from dflash.models.targets.tiny import build_tiny_target

    run_dir, _ = tiny_run
    for stage in ("data", "features"):
        subprocess.run(["cp", "-r", os.path.join(run_dir, stage), str(tmp_path / stage)], check=True)
    letter = build_tiny_target("llama", tokenizer="builtin").tokenizer.convert_tokens_to_ids("d")
    monkeypatch.setattr("dflash.extract.capture.capture_dataset", lambda *a, **k: pytest.fail("capture ran again"))
    # Captured features (not colocated): the check reads the target's tokenizer and vocabulary, not its weights.
    monkeypatch.setattr("dflash.stages.context.RunContext.target",
                        property(lambda self: pytest.fail("the whole target was loaded")))
    for stages in ("[data,capture,train]", "[train]"):
        with pytest.raises(ConfigError, match=rf"target.mask_token_id={letter}: 'd' occurs in the training data"):
            Pipeline(compose(TINY + [f"run_dir={tmp_path}", f"target.mask_token_id={letter}",
                                     f"stages={stages}"])).run()
        assert not (tmp_path / "checkpoints" / "latest").exists()


def test_a_changed_train_setting_with_overwrite_trains_afresh_beside_the_old_checkpoints(tiny_run, tmp_path):
    """The old run's checkpoints are not this run's: resuming them would export the old weights as the new run's."""
    run_dir, _ = tiny_run
    for stage in ("data", "features", "checkpoints", "export"):
        subprocess.run(["cp", "-r", os.path.join(run_dir, stage), str(tmp_path / stage)], check=True)
    old_key = json.loads((tmp_path / "checkpoints" / "fingerprint.json").read_text())["fingerprint"]
    Pipeline(compose(TINY + [f"run_dir={tmp_path}", "train.lr=0.05", "overwrite=true",
                          "stages=[data,capture,train]"])).run()
    new = (tmp_path / "export" / "model.safetensors").read_bytes()
    assert new != (Path(run_dir) / "export" / "model.safetensors").read_bytes()
    assert (tmp_path / f"checkpoints.{old_key}" / "latest").is_file()  # moved aside, not deleted
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and len(steps) == len(losses(run_dir))  # trained from step 1, not resumed at the end


def test_capture_and_training_follow_what_the_data_stage_made(tiny_run, tmp_path):
    # A rerun that retried failed prompts writes more samples under the same settings: capture and training redo.
    run_dir, _ = tiny_run
    subprocess.run(["cp", "-r", os.path.join(run_dir, "data"), str(tmp_path / "data")], check=True)
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path}"]))
    before = (pipeline.capture.fingerprint(), pipeline.train.fingerprint())
    stats = json.loads((tmp_path / "data" / "stats.json").read_text())
    (tmp_path / "data" / "stats.json").write_text(json.dumps(dict(stats, samples=stats["samples"] + 1)))
    after = (pipeline.capture.fingerprint(), pipeline.train.fingerprint())
    assert before[0] != after[0] and before[1] != after[1]
    # A setting added with a neutral default leaves the fingerprints of runs from before it as they were.
    older = compose(TINY + [f"run_dir={run_dir}"])
    with open_dict(older.train):
        del older.train["group_by"]
    assert Pipeline(older).train.fingerprint() == Pipeline(compose(TINY + [f"run_dir={run_dir}"])).train.fingerprint()


def run_pipeline_command(overrides: list[str]) -> None:
    """What `python -m dflash.train OVERRIDES` runs, in one rank of a job (tests/forked.py's run_ranks)."""
    run_command(compose(overrides))


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_rank_pipeline_trains_from_the_same_features(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    two = tmp_path / "two"
    two.mkdir()
    for stage in ("data", "features"):
        subprocess.run(["cp", "-r", os.path.join(run_dir, stage), str(two / stage)], check=True)
    # The 2 ranks fork from a server that imported dflash once (tests/forked.py): torchrun's processes would each
    # import it again, most of this test's time. `torchrun -m dflash.train` with 2 ranks is launched in
    # test_capture_settings_change.py.
    overrides = [*TINY, f"run_dir={two}", "stages=[data,capture,train]", "train.micro_batch_size=2"]
    assert run_ranks(run_pipeline_command, 2, overrides) == [0, 0]
    # 2 ranks x 2 samples = the tiny run's 4-sample global batch: the same loss curve.
    torch.testing.assert_close(torch.tensor(losses(two)), torch.tensor(losses(run_dir)), rtol=1e-4, atol=1e-4)
    assert os.path.exists(two / "export" / "model.safetensors")


def test_every_experiment_file_composes():
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIG_DIR, "experiment", "*.yaml")))
    assert {"tiny", "qwen36"} <= set(names)
    for name in names:
        cfg = compose([f"+experiment={name}"])
        assert cfg.name == name


def test_qwen36_recipe_is_the_published_one():
    cfg = compose(["+experiment=qwen36"])
    assert list(cfg.drafter.target_layer_ids) == [1, 16, 31, 46, 61]
    assert list(cfg.drafter.layer_types) == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg.drafter.sliding_window == 2048 and cfg.drafter.block_size == 16
    assert cfg.target.mask_token_id == 248070 and cfg.data.max_length == 4096
    assert cfg.train.lr == 6e-4 and cfg.train.epochs == 6 and cfg.train.num_anchors == 512 and cfg.train.gamma == 7
    assert list(cfg.capture.devices) == [0, 1] and list(cfg.train.devices) == [2, 3, 4, 5, 6, 7]


def test_smollm2_recipe_builds_its_training_settings(tmp_path):
    """The measured recipe of docs/results.md: its data and drafter settings, and train settings that build."""
    cfg = compose(["+experiment=smollm2", f"run_dir={tmp_path}"])
    assert cfg.data.turns == "all" and cfg.data.heldout == 64 and cfg.data.synthetic.count == 40000
    prompts = list(cfg.data.synthetic.system_prompts)
    assert len(prompts) == len(set(prompts)) == 5 and "" in prompts  # one draw set keeps the template's default
    assert cfg.drafter.num_hidden_layers == 5 and cfg.drafter.block_size == 16
    assert str(cfg.capture.mode) == "colocated"
    settings = Pipeline(cfg).settings.train
    assert (settings.micro_batch_size, settings.num_anchors, settings.gamma) == (32, 64, 7.0)
    assert settings.compile and settings.eval_every == 1000 and settings.max_minutes == 16.5


def test_qwen36_without_weights_stops_at_once_naming_the_path(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    run_dir = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        Pipeline(compose(["+experiment=qwen36", f"target.path={missing}", f"run_dir={run_dir}"])).run()
    assert not run_dir.exists()  # nothing half-written


def test_unknown_config_key_is_named():
    with pytest.raises(ConfigError, match="train.lerning_rate: no such setting"):
        compose(TINY + ["train.lerning_rate=1e-3"])


SHAPE = {"model_type": "llama", "num_layers": 6, "hidden_size": 64, "vocab_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}


@pytest.mark.parametrize("override,message", [
    ("drafter.target_layer_ids=[1,9]", r"drafter.target_layer_ids=\[1, 9\]: \[9\] outside the target's 6 layers"),
    ("target.mask_token_id=100000", "mask_token_id 100000 is outside the target vocabulary"),
    ("drafter.hidden_size=32", "drafter.hidden_size=32: the target's hidden size is 64"),
    ("drafter.num_attention_heads=3", "not a multiple"),
])
def test_bad_drafter_settings_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        drafter_config(settings_from(compose(TINY + [override])), SHAPE)


def test_bad_layer_id_stops_before_capture_writes_anything(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    subprocess.run(["cp", "-r", os.path.join(run_dir, "data"), str(tmp_path / "data")], check=True)
    cfg = compose(TINY + [f"run_dir={tmp_path}", "drafter.target_layer_ids=[0,40]", "stages=[data,capture]"])
    with pytest.raises(ConfigError, match=r"drafter.target_layer_ids=\[0, 40\]: \[40\] outside"):
        Pipeline(cfg).run()
    assert not os.path.exists(tmp_path / "features" / "manifest.json")


@pytest.mark.parametrize("override,message", [
    ("drafter.target_layer_ids=[0,40]", r"drafter.target_layer_ids=\[0, 40\]: \[40\] outside"),
    ("drafter.hidden_size=32", "drafter.hidden_size=32: the target's hidden size is 64"),
    # Sizes that only fail together with the target's: the drafter's config is built from both.
    ("drafter.num_attention_heads=7", "^drafter.num_attention_heads=7: num_attention_heads 7 is not a multiple of "
                                      "num_key_value_heads 2 \\(the drafter's sizes left null are those of "
                                      "target=tiny\\)$"),
    ("drafter.num_key_value_heads=3", "^drafter.num_key_value_heads=3: num_attention_heads 4 is not a multiple"),
    ("drafter.head_dim=3", "^drafter.head_dim=3: head_dim 3 is odd: the drafter's RoPE rotates pairs of dimensions$"),
    # A check of the drafter's settings alone names them, without the target.
    ("drafter.sliding_window=2", "^drafter.sliding_window=2, drafter.block_size=4: sliding_window 2 is smaller than "
                                 "block_size 4$"),
])
def test_a_drafter_the_target_cannot_feed_stops_before_any_stage(tmp_path, monkeypatch, override, message):
    """A tiny target's taps, sizes and heads are checked from its family's config before any stage runs (an hf
    target's from its checkpoint's config: test_mask_token.py; smollm2's below)."""
    monkeypatch.setattr("dflash.data.dataset.build_dataset", lambda *a, **k: pytest.fail("answers regenerated"))
    with pytest.raises(ConfigError, match=message):
        Pipeline(compose(TINY + [f"run_dir={tmp_path / 'run'}", override, "stages=[data]"])).run()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("drafter.num_key_value_heads=2", "drafter.num_key_value_heads=2: num_attention_heads 9 is not a multiple of "
                                      "num_key_value_heads 2 \\(the drafter's sizes left null are those of "
                                      "target=smollm2"),
    ("target.mask_token_id=999999", "target.mask_token_id=999999: outside the vocabulary of target=smollm2 "
                                    "\\(0..49151\\)"),
])
def test_a_drafter_the_real_smollm2_cannot_take_is_refused_before_any_stage(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        Pipeline(compose([f"run_dir={tmp_path / 'run'}", override])).run()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_tap_the_real_smollm2_lacks_is_refused_before_any_stage(tmp_path):
    # Read from the converted checkpoint's config, or the GGUF's metadata before the first conversion.
    with pytest.raises(ConfigError, match=r"drafter.target_layer_ids=\[1, 100\]: \[100\] outside the target's 30 "
                                          r"layers \(0..29\)"):
        Pipeline(compose([f"run_dir={tmp_path / 'run'}", "drafter.target_layer_ids=[1,100]"])).run()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content,message", [("", "empty"), ('{"messages": [\n', "prompts.jsonl:1: malformed")])
def test_malformed_or_empty_prompt_file_is_named(tmp_path, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    cfg = compose(TINY + [f"run_dir={tmp_path / 'run'}", "data.source=file", f"data.path={prompts}",
                          "stages=[data]"])
    with pytest.raises(ValueError, match=message) as error:
        Pipeline(cfg).run()
    assert "prompts.jsonl" in str(error.value)
    assert not os.path.exists(tmp_path / "run" / "data" / "dataset")


def test_an_unknown_grouping_key_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="train.group_by='answers': expected one of 'tokens', 'work'"):
        Pipeline(compose(TINY + [f"run_dir={tmp_path}", "train.group_by=answers"]))
    assert not os.listdir(tmp_path)


def test_float16_capture_is_refused(tmp_path):
    with pytest.raises(ValueError, match="float16"):
        Pipeline(compose(TINY + [f"run_dir={tmp_path}", "capture.dtype=float16"]))


def test_synthetic_prompts_join_the_data_stage_and_only_then_change_its_fingerprint(tmp_path):
    """data.synthetic.count > 0: the target writes extra prompts (journaled in the data folder) that are answered
    with the source's; at count 0 the data fingerprint is the one from before the option existed."""
    from dflash.data.dataset import load_dataset_dir

    base = TINY + [f"run_dir={tmp_path}", "stages=[data]", "data.limit=4"]
    off = Pipeline(compose(base))
    older = compose(base)
    with open_dict(older.data):
        del older.data["synthetic"]
    assert off.data.fingerprint() == Pipeline(older).data.fingerprint()
    on = Pipeline(compose(base + ["data.synthetic.count=3", "data.synthetic.max_new_tokens=24",
                                  "data.synthetic.min_chars=1", "data.synthetic.max_oversample=8"]))
    assert on.data.fingerprint() != off.data.fingerprint()
    on.run()
    assert (tmp_path / "data" / "synthetic.jsonl").is_file()
    sets = list(load_dataset_dir(str(tmp_path / "data"))["prompt_set"])
    assert 1 <= sets.count("synthetic") <= 3 and len(sets) > sets.count("synthetic")


def test_an_edited_evaluation_prompt_file_is_evaluated_again(tiny_run, tmp_path, monkeypatch):
    """An evaluation's done.json records the sha256 of its prompt files: the same path with other contents measures
    again. An evaluation marked before the record is kept as it is."""
    from dflash.run_files import file_sha256, read_json, write_json

    run_dir, prompts = tmp_path / "run", tmp_path / "p.jsonl"
    shutil.copytree(tiny_run[0], run_dir)

    def write_prompts(count: int) -> None:
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + {i}?"}) + "\n"
                                   for i in range(count)))

    command = TINY + [f"run_dir={run_dir}", "stages=[eval]", "~eval.prompt_sets.humaneval", "~eval.prompt_sets.mtbench",
                      "~eval.prompt_sets.gsm8k", f"+eval.prompt_sets.mine={{source: file, path: '{prompts}'}}"]
    write_prompts(1)
    assert Pipeline(compose(command)).run()["prompt_sets"]["mine"]["num_prompts"] == 1
    marker = run_dir / "eval" / "done.json"
    assert read_json(str(marker))["input_files"] == {
        "eval.prompt_sets.mine.path": {"path": str(prompts), "sha256": file_sha256(prompts)}}
    write_prompts(2)
    assert Pipeline(compose(command)).run()["prompt_sets"]["mine"]["num_prompts"] == 2

    monkeypatch.setattr("dflash.eval.evaluate.evaluate", lambda *args, **kwargs: pytest.fail("evaluated again"))
    assert Pipeline(compose(command)).run()["prompt_sets"]["mine"]["num_prompts"] == 2  # recorded: up to date
    write_prompts(3)
    write_json(str(marker), {key: value for key, value in read_json(str(marker)).items() if key != "input_files"})
    assert Pipeline(compose(command)).run()["prompt_sets"]["mine"]["num_prompts"] == 2  # no record: trusted
