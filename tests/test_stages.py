"""The stage objects and the runner's part: done markers, skip lines, barriers and ranks (dflash/pipeline.py); the
stages a command selects; the train stage reading the taps the capture stage recorded; the typed settings the
stages hand down."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.config import ConfigError, compose
from dflash.config.schema import schema_default
from dflash.config.errors import RunFolderError
from dflash.models.targets.logit_transform import LogitTransform
from dflash.pipeline import Pipeline, run_stage, selected_stages, timed
from dflash.run_files import read_json_or_none, write_json
from dflash.stages.capture import CaptureStage
from dflash.stages.data import DataStage
from dflash.stages.evaluation import EvalStage
from dflash.stages.export import ExportStage
from dflash.stages.stage import Stage
from dflash.stages.train import TrainStage
from dflash.train.frozen_head import save_frozen_head
from tests.forked import process_context

TINY = ["+experiment=tiny", "show_progress=false"]


class FakeStage(Stage):
    def __init__(self, name, out, events, record=None, every_rank=False, barrier_before=False, barrier_after=True):
        self.name, self.out, self.events, self.record = name, str(out), events, record
        self.every_rank, self.barrier_before, self.barrier_after = every_rank, barrier_before, barrier_after
        self.summary = None

    def fingerprint(self):
        return f"key-{self.name}"

    def describe(self):
        return f"the {self.name} stage"

    def kept(self):
        self.events.append(f"kept {self.name}")

    def run(self):
        self.events.append(f"run {self.name}")
        return self.record


def test_every_stage_has_the_runners_interface():
    for cls in (DataStage, CaptureStage, TrainStage, ExportStage, EvalStage):
        assert issubclass(cls, Stage) and all(callable(getattr(cls, m)) for m in ("fingerprint", "describe", "run"))
        assert "fingerprint" in vars(cls) and "run" in vars(cls), cls


def test_the_runner_marks_a_finished_stage_done_and_keeps_it_next_time(tmp_path, capsys):
    events = []
    stage = FakeStage("fake", tmp_path, events, record={"stats": {"n": 1}})
    run_stage(stage, rank=0)
    assert read_json_or_none(str(tmp_path / "done.json")) == {"fingerprint": "key-fake", "stats": {"n": 1}}
    run_stage(stage, rank=0)
    assert events == ["run fake", "kept fake"]
    assert capsys.readouterr().out == f"[fake] up to date: {tmp_path}\n"


@pytest.mark.parametrize("record, rank", [(None, 0), ({}, 1)])
def test_an_unfinished_stage_or_another_rank_leaves_no_done_marker(tmp_path, record, rank):
    run_stage(FakeStage("fake", tmp_path, [], record=record), rank=rank)
    assert not os.path.exists(tmp_path / "done.json")


def test_a_stage_without_a_kept_line_says_nothing_when_kept(tmp_path, capsys):
    write_json(str(tmp_path / "done.json"), {"fingerprint": "key-fake"})
    stage = FakeStage("fake", tmp_path, [])
    stage.kept_line = None
    run_stage(stage, rank=0)
    assert capsys.readouterr().out == ""


def fake_pipeline(tmp_path, rank, selected, stages, events):
    pipeline = Pipeline.__new__(Pipeline)
    pipeline.context = SimpleNamespace(rank=rank, world_size=1, run_dir=str(tmp_path), config_yaml=lambda: "",
                                       barrier=lambda: events.append("barrier"))
    pipeline.settings = SimpleNamespace(stages=selected, ignored=lambda typed=None: [],
                                        train=SimpleNamespace(devices=None))  # what the runner's warnings read
    pipeline.stages, pipeline.eval = stages, stages[-1]
    return pipeline


def test_the_runner_reads_ranks_and_barriers_from_the_stages(tmp_path):
    events = []
    stages = (FakeStage("one", tmp_path / "1", events, barrier_after=False),
              FakeStage("two", tmp_path / "2", events, every_rank=True, barrier_before=True),
              FakeStage("three", tmp_path / "3", events))
    fake_pipeline(tmp_path, 1, ["one", "two", "three"], stages, events).run_stages()
    # Rank 1 runs only the every-rank stage; a barrier is met after a stage whether this rank ran it or not.
    assert events == ["barrier", "run two", "barrier", "barrier"]
    events.clear()
    fake_pipeline(tmp_path, 0, ["three"], stages, events).run_stages()
    assert events == ["barrier", "run three", "barrier"]


def test_no_rank_starts_a_stage_before_every_rank_has_checked_the_run_folder(tmp_path, monkeypatch):
    # Each rank's preflight reads the run folder (the guard, the checkpoints); rank 0's first stage may change it
    # (config.yaml, an older drafter moved aside), so the ranks meet in between.
    monkeypatch.setattr("dflash.train.engine.init_distributed", lambda: (0, 2, 0))
    events = []
    stages = (FakeStage("one", tmp_path / "1", events, barrier_after=False), FakeStage("two", tmp_path / "2", events))
    pipeline = fake_pipeline(tmp_path, 0, ["one", "two"], stages, events)
    pipeline.context.world_size = 2
    pipeline.run_stages()
    assert events == ["barrier", "run one", "run two", "barrier"]


@pytest.mark.parametrize("selected, written", [([], True), (["one"], True), (["two"], False), (["one", "two"], True)])
def test_the_run_folder_gets_config_yaml_unless_every_stage_run_keeps_its_own(tmp_path, selected, written):
    events = []
    stages = (FakeStage("one", tmp_path / "1", events), FakeStage("two", tmp_path / "2", events))
    stages[1].records_own_config = True  # as the eval stage does, beside its summary
    fake_pipeline(tmp_path, 0, selected, stages, events).run_stages()
    assert os.path.exists(tmp_path / "config.yaml") == written


class SplitStage(FakeStage):
    """A stage every rank runs whose done marker rank 1 finds and rank 0 does not (as on a shared file system where
    one node still sees an entry another has replaced)."""

    def up_to_date(self):
        return dist.get_rank() == 1


def _run_split_stage(rank, store_file, out, results):
    # A file store, not a TCP one: a port found free and handed to rank 0 could be taken by another listener first.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        events = []
        run_stage(SplitStage("split", out, events, record={}, every_rank=True), rank)
        results[rank] = events
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.slow
def test_rank_0_decides_for_every_rank_whether_a_stage_is_up_to_date(tmp_path):
    results = mp.Manager().dict()
    context = process_context()
    store = str(tmp_path / "store")
    processes = [context.Process(target=_run_split_stage, args=(r, store, str(tmp_path), results)) for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert dict(results) == {0: ["run split"], 1: ["run split"]}  # rank 0's answer: not up to date, on both
    assert read_json_or_none(str(tmp_path / "done.json")) == {"fingerprint": "key-split"}


def test_the_train_stage_brings_its_export_and_export_may_be_named_alone():
    assert selected_stages(["data", "capture", "train"]) == ["data", "capture", "train", "export"]
    assert selected_stages(["train", "eval"]) == ["train", "eval", "export"]  # run in the pipeline's order
    assert selected_stages(["train", "export"]) == ["train", "export"]
    assert selected_stages(["eval"]) == ["eval"] and selected_stages(["export"]) == ["export"]
    assert selected_stages(["data", "capture"]) == ["data", "capture"]


def test_the_export_stage_has_the_train_stages_fingerprint_and_refuses_an_unfinished_training(tmp_path):
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path}", "stages=[export]"]))
    assert [stage.name for stage in pipeline.stages] == ["data", "capture", "train", "export", "eval"]
    assert pipeline.export.fingerprint() == pipeline.train.fingerprint()
    assert pipeline.train.out == str(tmp_path / "checkpoints") and pipeline.export.out == str(tmp_path / "export")
    with pytest.raises(RunFolderError, match=r"nothing to export: the train stage has not finished"):
        pipeline.export.run()


@pytest.mark.parametrize("rank, shown", [("0", True), ("1", False)])
def test_a_stages_time_is_shown_by_rank_0_only(monkeypatch, capsys, rank, shown):
    monkeypatch.setenv("RANK", rank)
    assert timed("train", lambda: 7) == 7
    out = capsys.readouterr().out
    assert ("[train] stage took" in out) == shown and out.count("\n") == int(shown)


def tiny_capture_output(features, layer_ids, transform=None):
    os.makedirs(features, exist_ok=True)
    shape = {"model_type": "llama", "num_layers": 8, "hidden_size": 64, "vocab_size": 512, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "mask_token_id": 3}
    write_json(os.path.join(features, "target.json"), shape)
    write_json(os.path.join(features, "manifest.json"), {"target_layer_ids": layer_ids})
    head = torch.zeros(shape["vocab_size"], shape["hidden_size"])
    save_frozen_head(head, head, os.path.join(features, "frozen_head.safetensors"), transform)


def test_the_train_stage_reads_the_taps_the_capture_stage_recorded(tmp_path):
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path}"]))
    tiny_capture_output(pipeline.capture.out, [1, 5])
    assert pipeline.capture.layer_ids() == [1, 5]
    assert pipeline.train.drafter_config().target_layer_ids == [1, 5]  # num_taps=2 over 8 layers: the same
    assert pipeline.train.drafter_config().logit_transform.identity


def test_the_drafter_config_carries_the_logit_transform_training_applies(tmp_path):
    """The frozen head's transform, which the training loss applies, goes into the drafter config the export writes
    (so the serving engines apply it to the drafter's logits too)."""
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path}"]))
    tiny_capture_output(pipeline.capture.out, [1, 5], LogitTransform(scale=0.25, softcap=30.0))
    config = pipeline.train.drafter_config()
    assert config.logit_transform == LogitTransform(scale=0.25, softcap=30.0)
    assert config.to_zlab()["dflash_config"]["output_multiplier"] == 0.25


def test_features_captured_at_other_taps_are_refused_before_training(tmp_path, monkeypatch):
    def must_not_train(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr("dflash.train.loop.train", must_not_train)
    pipeline = Pipeline(compose(TINY + [f"run_dir={tmp_path}", "stages=[train]"]))
    tiny_capture_output(pipeline.capture.out, [2, 4])
    with pytest.raises(ConfigError, match=r"captured at target layers \[2, 4\], these settings' taps are \[1, 5\]"):
        pipeline.train.run()
    error = str(pytest.raises(ConfigError, pipeline.train.drafter_config).value)
    assert "\n" not in error and "drafter.target_layer_ids=[2,4]" in error


def test_the_eval_stage_hands_load_prompt_sets_its_typed_prompt_sets(tiny_target):
    from dflash.config.schema import PromptSetSettings
    from dflash.eval.evaluate import load_prompt_sets

    typed = {"mt": PromptSetSettings(source="mtbench", limit=1, turns=2, answer_max_new_tokens=2)}
    sets, categories, _ = load_prompt_sets(tiny_target("llama"), typed, max_new_tokens=4,
                                        batch_size=schema_default("eval.batch_size"))
    assert set(sets) == set(categories) == {"mt", "mt_turn2"} and len(sets["mt_turn2"]) == 1


def test_placement_reads_the_typed_target_settings():
    from dflash.config.schema import TargetSettings
    from dflash.models.targets.placement import resolve_gpus_per_worker, target_bytes

    tiny = {"kind": "tiny", "tiny": {"family": "qwen3", "seed": 0}, "dtype": "float32"}
    typed = TargetSettings(**tiny)
    size = target_bytes(typed)
    assert size == target_bytes(tiny)  # a target group read as a dict (the launch scripts) is the same target
    # float32 weighs twice bf16: the dtype comes from the settings, not a default repeated here.
    assert resolve_gpus_per_worker("auto", typed, num_devices=4, gpu_bytes=2 * size) == 2
