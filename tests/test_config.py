"""The typed schema (dflash/config/schema.py) and the fingerprints derived from it (dflash/config/fingerprints.py)."""

import copy
import dataclasses
import json
import re
import shlex
import os
import subprocess
import sys
import typing

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

from dflash.config import ConfigError, compose, fingerprints, settings_from
from dflash.config import schema
from dflash.config.schema import STAGES, CaptureSettings, RunSettings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MADE = {"fingerprint": "d", "samples": 7, "num_tokens": 700}

# Fingerprints computed by the hand-kept code before the schema (commit 3e00386): run folders made then keep them.
# Two cases moved: qwen36 with capture=online no longer takes the offline shard size, which online capture never used;
# a live evaluation at T > 0 now proposes the drafter's argmax (eval.draft_sampling=greedy, what serving engines do):
# another measurement, so another fingerprint (with draft_sampling=sampled it keeps a8abc084df6af5a4). A third
# moved with the `unused` stand-ins: train.group_by=work without grouping (group_by_length 0) trains as the default
# does, so its checkpoint fingerprint is now the default's (it was 02f9957828251239).
# The smollm2 rows name data.synthetic.count=20000, the recipe's count until session 43, and all but one of them
# train.micro_batch_size=64: the recipe's runs had 64 sequences a step until session 38. The last row (neither) is
# the recipe since session 43, whose fingerprints were those of its first run (made at fd24648 with the count given
# on the command line).
GOLDEN = [
    ([], "15acf81feaafbe57", "8e0ab70bba607911", "c3a15bba0e6da0c7", "aa32e96bce02bd1e"),
    (["+experiment=tiny"], "226f545c08a9e29e", "cc8a9ec544f4ca58", "160e8e3701a6ed9e", "cc6f5a9dbc8f9d25"),
    (["+experiment=smollm2", "data.synthetic.count=20000", "train.micro_batch_size=64"], "74e0db4d5c18fafc",
     "973ef0ab1eb917a9", "8e11830750d647d7", "ce8e30719f8ee58d"),
    (["+experiment=smollm2", "data.synthetic.count=20000"], "74e0db4d5c18fafc", "973ef0ab1eb917a9", "86693138de4e8a27",
     "ce8e30719f8ee58d"),
    (["+experiment=qwen36"], "a8e2ebd2cafa01d8", "aa596ff081ddd122", "bf6c017a011cc863", "e20a726fdc05f90d"),
    (["+experiment=tiny", "capture=online"], "226f545c08a9e29e", "6a910157329d3124", "d16775e288eb40d5",
     "cc6f5a9dbc8f9d25"),
    (["+experiment=tiny", "capture=colocated", "train.kl_weight=0.5"], "226f545c08a9e29e", "b3bf1e4ca864afd6",
     "9320faa49157001d", "cc6f5a9dbc8f9d25"),
    (["+experiment=tiny", "train.max_minutes=2.5", "train.group_by=work", "data.synthetic.count=4"],
     "1289b376390a4b5c", "ce54f4965056feb3", "6263d8d25b00ccb5", "cc6f5a9dbc8f9d25"),
    (["+experiment=smollm2", "data.synthetic.count=20000", "train.micro_batch_size=64", "deepspeed=zero3",
      "eval.mode=live", "eval.temperature=1.0"],
     "74e0db4d5c18fafc", "973ef0ab1eb917a9", "3f27cc3bafb7a71a", "cec404e923ebbe38"),
    (["+experiment=smollm2", "data.synthetic.count=20000", "train.micro_batch_size=64", "deepspeed=zero3",
      "eval.mode=live", "eval.temperature=1.0", "eval.draft_sampling=sampled"],
     "74e0db4d5c18fafc", "973ef0ab1eb917a9", "3f27cc3bafb7a71a", "a8abc084df6af5a4"),
    (["+experiment=tiny", "+eval.chat_template_kwargs.enable_thinking=false", "drafter.target_layer_ids=[0,1]"],
     "226f545c08a9e29e", "7a5cce3cf2481128", "71ff126fbf0a69e8", "30305e9b324edc1a"),
    # Computed at commit 36caee6, before the `unused` stand-ins: every setting there that has an `unused` reason is
    # in use and keeps its fingerprint.
    (["+experiment=tiny", "train.group_by_length=8", "train.group_by=work", "train.loss_weighting=dpace",
      "train.dpace_alpha=0.3", "data.heldout=4", "train.heldout_batch_size=2", "eval.mode=live", "eval.seed=3",
      "eval.live_engine=hf", "eval.measure_target=false"],
     "6ac8869406d417ff", "21f38fd5d775a717", "d890fa973465ef17", "7f5088d46ee8c3eb"),
    (["+experiment=tiny", "data.temperature=0.7", "data.top_p=0.9", "data.sampled_share=0.5"], "84f818ed00ff28ab",
     "1585532798ce8bcb", "149605b58756f39f", "cc6f5a9dbc8f9d25"),
    (["+experiment=smollm2"], "955998fcce9d5ec8", "b8243600034d6a16", "b98aeaead23115a4", "ce8e30719f8ee58d"),
]


def settings_of(overrides: list[str], monkeypatch=None) -> RunSettings:
    cfg = compose(overrides + ["run_dir=/nonexistent/run"])
    if monkeypatch is not None:  # the qwen36 target folder need not exist to fingerprint its settings
        monkeypatch.setattr(schema, "target_path_problem", lambda path: None)
    return settings_from(cfg)


def stage_keys(s: RunSettings, made: dict = MADE) -> dict[str, str]:
    """Each stage's fingerprint, chained as the pipeline chains them (the export takes the train stage's, eval the
    exported drafter's)."""
    capture = fingerprints.capture_fingerprint(s, made)
    train = fingerprints.checkpoint_fingerprint(s, capture)
    return {"data": fingerprints.data_fingerprint(s), "capture": capture, "train": train, "export": train,
            "eval": fingerprints.eval_fingerprint(s, train, "/run/export")}


@pytest.mark.parametrize("overrides,data,capture,checkpoint,evaluation", GOLDEN, ids=lambda v: str(v))
def test_fingerprints_of_runs_made_before_the_schema_are_kept(overrides, data, capture, checkpoint, evaluation,
                                                              monkeypatch):
    s = settings_of(overrides, monkeypatch)
    made = {"fingerprint": None, "samples": None, "num_tokens": None}  # a data stage that has not run
    assert fingerprints.data_fingerprint(s) == data
    capture_key = fingerprints.capture_fingerprint(s, made)
    assert capture_key == capture
    assert fingerprints.checkpoint_fingerprint(s, capture_key) == checkpoint
    assert fingerprints.eval_fingerprint(s, "DRAFTER", "FOLDER") == evaluation


def schema_classes() -> list[type]:
    found, todo = [], [RunSettings, *CaptureSettings.__subclasses__()]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        for f in dataclasses.fields(cls):
            for arg in (f.type, *typing.get_args(f.type)):
                if dataclasses.is_dataclass(arg):
                    todo.append(arg)
    return found


def test_every_field_says_which_stages_it_affects():
    """A field without `affects` would be silently left out of every fingerprint (or silently rerun stages)."""
    classes = schema_classes()
    assert len(classes) >= 14
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert "affects" in f.metadata and "doc" in f.metadata, \
                f"{cls.__name__}.{f.name}: declare it with setting(..., affects=..., doc=...)"
            assert set(f.metadata["affects"]) <= set(STAGES)


def changed(value, annotation):
    """Another value of the field's type (the fingerprints are computed, so it need not pass the checks)."""
    if value is None:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)][0]
        origin = typing.get_origin(inner) or inner
        return {int: 7, float: 1.5, str: "other", list: [1], dict: {"a": 1}}[origin]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return value + [value[0]] if value else [1]
    if isinstance(value, dict):
        return {**value, "extra": 1}
    raise TypeError(value)


def leaves(node, path=(), inherited=None):
    """(path, field, affects) of every leaf setting under `node`; a nested setting's stages must lie within its
    parent's, or a change inside it would not reach the fingerprint."""
    for f in dataclasses.fields(node):
        affects = set(f.metadata["affects"])
        if inherited is not None:
            assert affects <= inherited, f"{'.'.join(path + (f.name,))} affects more than its parent field"
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, path + (f.name,), affects if path else None)
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for key, entry in value.items():
                yield from leaves(entry, path + (f.name, key), affects)
        else:
            yield path + (f.name,), f, affects


def set_at(s, path, value):
    node = s
    for part in path[:-1]:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    setattr(node, path[-1], value)


def downstream(affects: set[str]) -> set[str]:
    if not affects:
        return set()
    first = min(STAGES.index(stage) for stage in affects)
    return set(STAGES[first:]) | affects


@pytest.mark.parametrize("capture", ["offline", "online", "colocated"])
def test_changing_a_setting_reruns_exactly_the_stages_it_affects(capture):
    # Synthetic prompts on, sampled answers, dpace weighting, grouped batches, held-out prompts and live sampling
    # with sampled drafts: their fields are not at the neutral values that leave them out, and are in use. A setting
    # the run does not use (its schema `unused` reason) reruns nothing: test_a_setting_the_run_does_not_use_...
    base = settings_of(["+experiment=tiny", f"capture={capture}", "data.synthetic.count=4", "data.temperature=0.7",
                        "train.loss_weighting=dpace", "train.group_by_length=4", "data.heldout=4",
                        "eval.mode=live", "eval.temperature=0.7", "eval.draft_sampling=sampled"])
    before = stage_keys(base)
    tested = 0
    for path, f, affects in leaves(base):
        s = copy.deepcopy(base)
        node = s
        for part in path[:-1]:
            node = node[part] if isinstance(node, dict) else getattr(node, part)
        set_at(s, path, changed(getattr(node, path[-1]), f.type))
        after = stage_keys(s)
        rerun = {stage for stage in STAGES if after[stage] != before[stage]}
        unused = ".".join(path) in unused_keys(s)
        expected = set() if unused else downstream(affects)
        assert rerun == expected, f"{'.'.join(path)}: reruns {sorted(rerun)}, declares {sorted(affects)}"
        tested += 1
    assert tested > 60


# One field of each stage's, a field of two stages' and speed-only ones, as overrides of the tiny experiment.
STAGE_FIELDS = ["data.max_new_tokens=50", "capture.dtype=bfloat16", "capture.batch_tokens=4096", "train.lr=0.01",
                "drafter.block_size=8", "eval.max_new_tokens=32", "target.dtype=bfloat16",
                "data.batch_size=4", "capture.shard_tokens=4096", "train.log_every=5", "eval.batch_size=4"]


def stage_object_keys(run_dir, *overrides: str) -> dict[str, str]:
    """Each stage object's fingerprint() in a Pipeline of the tiny experiment, after writing the export marker that
    an export of these settings leaves (the eval stage's fingerprint is that of the drafter it measures)."""
    from dflash.pipeline import Pipeline
    from dflash.run_files import mark_done

    pipeline = Pipeline(compose(["+experiment=tiny", f"run_dir={run_dir}", *overrides]))
    mark_done(pipeline.export.out, pipeline.export.fingerprint(), checkpoint=pipeline.train.checkpoint_fingerprint())
    return {stage.name: stage.fingerprint() for stage in pipeline.stages}


def test_each_stage_objects_fingerprint_changes_exactly_when_the_schema_says(tmp_path, monkeypatch):
    # The table test above chains the fingerprint functions itself; this one asks the stage objects, which add what
    # the functions do not see: the train stage the world size, the eval stage the export's marker, the capture
    # stage what the data stage made (data/stats.json).
    from dflash.run_files import write_json

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    table = {".".join(path): affects for path, _, affects in leaves(settings_of(["+experiment=tiny"]))}
    run_dir = tmp_path / "run"
    stats = run_dir / "data" / "stats.json"
    os.makedirs(stats.parent)
    os.makedirs(run_dir / "export")
    write_json(str(stats), MADE)
    before = stage_object_keys(run_dir)
    assert len(set(before.values())) == len(STAGES) - 1  # the export's is the train stage's

    def rerun(after: dict[str, str]) -> set[str]:
        return {stage for stage in STAGES if after[stage] != before[stage]}

    for override in STAGE_FIELDS:
        field = override.split("=")[0]
        assert rerun(stage_object_keys(run_dir, override)) == downstream(table[field]), override
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rerun(stage_object_keys(run_dir)) == {"train", "export", "eval"}
    monkeypatch.delenv("WORLD_SIZE")
    write_json(str(stats), {**MADE, "samples": 8})
    assert rerun(stage_object_keys(run_dir)) == {"capture", "train", "export", "eval"}


def test_the_data_stage_output_reaches_the_capture_fingerprint():
    s = settings_of(["+experiment=tiny"])
    assert stage_keys(s)["capture"] != stage_keys(s, {**MADE, "samples": 8})["capture"]


def test_neutral_values_leave_a_field_out():
    s = settings_of(["+experiment=tiny"])
    train = fingerprints.stage_settings(s.train, "train")
    assert "max_minutes" not in train and "group_by" not in train and "lr" in train
    assert "synthetic" not in fingerprints.stage_settings(s.data, "data")
    assert "log_every" not in train  # affects nothing: changing it never retrains
    evaluation = fingerprints.stage_settings(s.eval, "eval")
    assert "draft_sampling" not in evaluation  # greedy, but at T=0 it changes nothing
    live = settings_of(["+experiment=tiny", "eval.mode=live", "eval.temperature=0.7"])
    assert fingerprints.stage_settings(live.eval, "eval")["draft_sampling"] == "greedy"
    sampled = settings_of(["+experiment=tiny", "eval.mode=live", "eval.temperature=0.7", "eval.draft_sampling=sampled"])
    assert "draft_sampling" not in fingerprints.stage_settings(sampled.eval, "eval")  # as before the setting
    assert "draft_temperature" not in fingerprints.stage_settings(sampled.eval, "eval")
    sharp = settings_of(["+experiment=tiny", "eval.mode=live", "eval.temperature=0.7", "eval.draft_sampling=sampled",
                         "eval.draft_temperature=0.35"])
    assert fingerprints.stage_settings(sharp.eval, "eval")["draft_temperature"] == 0.35
    greedy = settings_of(["+experiment=tiny", "eval.mode=live", "eval.temperature=0.7", "eval.draft_temperature=0.35"])
    assert "draft_temperature" not in fingerprints.stage_settings(greedy.eval, "eval")  # drafts are argmax


# (key, a change of it, overrides of the tiny experiment where the run does not use it, where it does)
UNUSED = [
    ("target.tiny", "target.tiny.seed=9", ["target.kind=smollm2"], []),
    ("drafter.num_taps", "drafter.num_taps=3", ["drafter.target_layer_ids=[0,1]"], []),
    ("drafter.sliding_window", "drafter.sliding_window=64", ["drafter.layer_types=null"], []),
    ("data.turns", "data.turns=all", ["data.source=gsm8k"], []),
    ("data.temperature", "data.temperature=0.9", ["data.temperature=0.7", "data.sampled_share=0"],
     ["data.temperature=0.7"]),
    ("data.top_p", "data.top_p=0.9", ["data.temperature=0.7", "data.sampled_share=0"], ["data.temperature=0.7"]),
    ("data.sampled_share", "data.sampled_share=0.5", [], ["data.temperature=0.7"]),
    ("data.synthetic.system_prompts", "data.synthetic.system_prompts=[x]", [], ["data.synthetic.count=4"]),
    ("data.synthetic.temperature", "data.synthetic.temperature=0.5", [], ["data.synthetic.count=4"]),
    ("data.synthetic.top_p", "data.synthetic.top_p=0.9", [], ["data.synthetic.count=4"]),
    ("data.synthetic.max_new_tokens", "data.synthetic.max_new_tokens=50", [], ["data.synthetic.count=4"]),
    ("data.synthetic.min_chars", "data.synthetic.min_chars=3", [], ["data.synthetic.count=4"]),
    ("data.synthetic.max_oversample", "data.synthetic.max_oversample=2", [], ["data.synthetic.count=4"]),
    ("data.synthetic.keep_system", "data.synthetic.keep_system=false", [], ["data.synthetic.count=4"]),
    ("capture.shard_tokens", "capture.shard_tokens=4096", ["capture=online"], []),
    ("capture.batch_tokens", "capture.batch_tokens=4096", ["capture=colocated"], ["capture=online"]),
    ("capture.verify_existing", "capture.verify_existing=true", ["capture=colocated"], []),
    ("capture.pack", "capture.pack=false", ["capture=colocated"], []),
    ("capture.devices", "capture.devices=[0]", ["capture=colocated"], ["device=cuda"]),
    ("capture.gpus_per_worker", "capture.gpus_per_worker=2", ["capture=colocated"], []),
    ("train.dpace_alpha", "train.dpace_alpha=0.3", [], ["train.loss_weighting=dpace"]),
    ("train.group_by", "train.group_by=work", [], ["train.group_by_length=4"]),
    ("train.heldout_max_new_tokens", "train.heldout_max_new_tokens=8", [], ["data.heldout=4"]),
    ("train.heldout_batch_size", "train.heldout_batch_size=2", [], ["data.heldout=4"]),
    ("train.prepare_ahead", "train.prepare_ahead=false", ["capture=online"], []),
    ("eval.seed", "eval.seed=3", [], ["eval.temperature=0.7"]),
    ("eval.measure_target", "eval.measure_target=false", [], ["eval.mode=live"]),
    ("eval.live_engine", "eval.live_engine=hf", [], ["eval.mode=live"]),
    ("eval.compile_drafter", "eval.compile_drafter=true", [], ["eval.mode=live"]),
    ("eval.draft_temperature", "eval.draft_temperature=0.5", ["eval.temperature=0.7"],
     ["eval.temperature=0.7", "eval.draft_sampling=sampled"]),
    # A prompt set's settings (each set of eval.prompt_sets has them; the table names them by mtbench's).
    ("eval.prompt_sets.mtbench.answer_max_new_tokens", "eval.prompt_sets.mtbench.answer_max_new_tokens=5",
     ["eval.prompt_sets.mtbench.turns=1"], []),
]


def unused_keys(s: RunSettings) -> set[str]:
    return {key for key, *_ in schema.unused_settings(s)}


def affects_of(s: RunSettings, key: str) -> set[str]:
    """The stages the field at `key` affects, as the class of its group in `s` declares (capture: per mode)."""
    *groups, name = key.split(".")
    node = s
    for group in groups:
        node = node[group] if isinstance(node, dict) else getattr(node, group)
    return set({f.name: f for f in dataclasses.fields(node)}[name].metadata["affects"])


@pytest.mark.parametrize("key,change,unused,used", UNUSED, ids=[row[0] for row in UNUSED])
def test_a_setting_the_run_does_not_use_reruns_nothing(key, change, unused, used, monkeypatch):
    before = settings_of(["+experiment=tiny", *unused], monkeypatch)
    after = settings_of(["+experiment=tiny", *unused, change], monkeypatch)
    assert key in unused_keys(after) and f"{key}=" in " ".join(after.ignored())
    assert stage_keys(after) == stage_keys(before)
    assert fingerprints.settings_fingerprint(after) == fingerprints.settings_fingerprint(before)
    assert fingerprints.target_identity(after) == fingerprints.target_identity(before)
    # Where the run uses it, the change reruns the stages it affects.
    before = settings_of(["+experiment=tiny", *used], monkeypatch)
    after = settings_of(["+experiment=tiny", *used, change], monkeypatch)
    assert key not in unused_keys(after) and key not in " ".join(after.ignored())
    keys = stage_keys(before)
    rerun = {stage for stage, value in stage_keys(after).items() if value != keys[stage]}
    assert rerun == downstream(affects_of(after, key))


def test_every_setting_with_an_unused_reason_is_in_the_table():
    s = settings_of(["+experiment=tiny", "capture=colocated"])  # the capture fields as every mode declares them
    declared = {".".join(path) for path, f, _ in leaves(s) if "unused" in f.metadata}
    declared = {re.sub(r"^eval\.prompt_sets\.[^.]+\.", "eval.prompt_sets.mtbench.", key) for key in declared}
    assert declared == {row[0] for row in UNUSED}


def test_a_trained_run_folder_lets_through_a_setting_its_training_does_not_use(tmp_path):
    # An eval-only command that repeats the training command plus a setting the run does not use ran into the
    # guard: "holds a drafter trained with other settings (train.dpace_alpha: 0.5 -> 0.3)".
    from dflash.pipeline import Pipeline
    from dflash.run_files import write_json
    from dflash.stages.guard import refuse_other_trained_settings
    from dflash.run_files import SETTINGS_KEY

    run = ["+experiment=tiny", f"run_dir={tmp_path}"]
    trained = Pipeline(compose(run))
    os.makedirs(trained.train.checkpoints)
    write_json(os.path.join(trained.train.checkpoints, "fingerprint.json"), {"fingerprint": "trained"})
    write_json(os.path.join(trained.train.checkpoints, SETTINGS_KEY),
               {"fingerprint": fingerprints.settings_fingerprint(trained.settings)})
    write_json(os.path.join(trained.train.out, "done.json"), {"checkpoint": "trained"})
    OmegaConf.save(compose(run), tmp_path / "config.yaml", resolve=True)
    unused = ["train.dpace_alpha=0.3", "train.group_by=work", "drafter.layer_types=[full_attention,full_attention]",
              "drafter.sliding_window=64"]
    refuse_other_trained_settings(Pipeline(compose(run + unused[:2] + ["stages=[eval]"])).train)
    with pytest.raises(ConfigError) as error:
        refuse_other_trained_settings(Pipeline(compose(run + unused + ["train.lr=0.01"])).train)
    message = str(error.value)
    assert "train.lr: 0.0006 -> 0.01" in message and "drafter.layer_types: [sliding_attention," in message
    assert "dpace_alpha" not in message and "group_by" not in message and "sliding_window" not in message


@pytest.mark.parametrize("inside", ["", "checkpoints", "data", "features", "export", "export_best", "logs",
                                    "checkpoints/step1", "eval/live", "checkpoints.0123456789abcdef"])
def test_an_evaluation_folder_among_the_run_s_own_is_refused(inside, tmp_path):
    """eval.out_dir=<run_dir>/checkpoints replaced checkpoints/done.json and config.yaml with the evaluation's."""
    run_dir = tmp_path / "run"
    out = str(run_dir / inside) if inside else str(run_dir)
    with pytest.raises(ConfigError) as error:
        settings_from(compose(["+experiment=tiny", f"run_dir={run_dir}", f"eval.out_dir={out}"]))
    message = str(error.value)
    assert message.startswith(f"eval.out_dir={out!r}: ") and "\n" not in message
    assert f"own folder {inside.split('/')[0]}," in message if inside else "the run folder itself" in message
    assert not run_dir.exists()


def test_an_evaluation_folder_of_its_own_is_taken(tmp_path):
    run_dir = tmp_path / "run"
    link = tmp_path / "link"
    os.makedirs(run_dir / "checkpoints")
    os.symlink(run_dir / "checkpoints", link)
    for out in (run_dir / "eval", run_dir / "eval_live", tmp_path / "elsewhere", "${run_dir}/eval_t1"):
        settings_from(compose(["+experiment=tiny", f"run_dir={run_dir}", f"eval.out_dir={out}"]))
    for out in (link, "${run_dir}/checkpoints"):  # the same folder by another name
        with pytest.raises(ConfigError, match="own folder checkpoints"):
            settings_from(compose(["+experiment=tiny", f"run_dir={run_dir}", f"eval.out_dir={out}"]))


def test_the_run_folders_an_evaluation_may_not_name_are_those_the_stages_write():
    from dflash.stages.context import FOLDERS
    from dflash.stages.train import TRAINED_OUTPUTS

    assert set(FOLDERS) | {name for name in TRAINED_OUTPUTS if "." not in name} <= set(schema.RUN_FOLDERS)


# Bad input: one line naming the key, before any work -----------------------------------------------------------

BAD = [
    ("train.lr=-1e-3", "train.lr=-0.001: expected a number > 0"),
    ("run_dir=/etc/hostname", "run_dir='/etc/hostname': is a file; expected a folder"),
    ("run_dir=/etc/hostname/run", "run_dir='/etc/hostname/run': is inside /etc/hostname, a file; expected a folder"),
    ("eval.out_dir=/etc/hostname", "eval.out_dir='/etc/hostname': is a file; expected a folder"),
    ("target.cache_dir=/etc/hostname/x", "target.cache_dir='/etc/hostname/x': is inside /etc/hostname, a file"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0: expected an int >= 1"),
    ("train.micro_batch_size=-4", "train.micro_batch_size=-4: expected an int >= 1"),
    ("train.epochs=0", "train.epochs=0: expected an int >= 1"),
    ("train.grad_accum=0", "train.grad_accum=0"),
    ("train.num_anchors=0", "train.num_anchors=0"),
    ("train.warmup_ratio=1.5", "train.warmup_ratio=1.5: expected a number in [0, 1]"),
    ("train.decay_ratio=0", "train.decay_ratio=0.0: expected a number in (0, 1]"),
    ("train.decay_ratio=1.2", "train.decay_ratio=1.2: expected a number in (0, 1]"),
    ("train.kl_weight=2", "train.kl_weight=2.0"),
    ("train.betas=[0.9]", "train.betas=[0.9]: expected two numbers in [0, 1)"),
    ("train.max_steps=0", "train.max_steps=0"),
    ("train.max_minutes=-5", "train.max_minutes=-5.0"),
    ("train.loss_weighting=focal", "train.loss_weighting='focal': expected one of 'exp_decay', 'dpace'"),
    ("train.attention=flash", "train.attention='flash': expected one of 'auto', 'sdpa', 'flex'"),
    ("train.profile_steps=100", "train.profile_steps='100': expected START:COUNT"),
    ("train.kl_weight=0.5", "train.kl_weight=0.5 needs the target's logits"),
    ("data.temperature=-1", "data.temperature=-1.0"),
    ("data.top_p=0", "data.top_p=0.0: expected a number in (0, 1]"),
    ("data.synthetic.temperature=0", "data.synthetic.temperature=0.0: expected a number > 0"),
    ("data.turns=some", "data.turns='some': expected one of 'first', 'all'"),
    ("data.source=file", "data.path=null: expected a .jsonl/.json prompt file"),
    ("data.path=/no/such/prompts.jsonl", "data.path='/no/such/prompts.jsonl': no such file"),
    ("data.limit=0", "data.limit=0"),
    ("data.engine=vllm", "data.engine='vllm'"),
    ("data.decode_attention=flash", "data.decode_attention='flash'"),
    ("data.heldout=32", "data.heldout=32: expected fewer than the 32 prompts data.limit and data.synthetic.count"),
    ("capture.dtype=float16", "capture.dtype='float16' is not allowed"),
    ("capture.mode=online", "choose the mode with the group, capture=online"),
    ("capture.gpus_per_worker=0", "capture.gpus_per_worker=0: expected an int >= 1 or auto"),
    ("drafter.block_size=1", "drafter.block_size=1"),
    ("train.devices=[2,2]", "train.devices=[2,2] lists GPU 2 more than once; list each GPU once"),
    ("capture.devices=[-1]", "capture.devices=[-1]: GPU ids count from 0"),
    ("drafter.target_layer_ids=[3,1]", "drafter.target_layer_ids=[3, 1]: expected layer ids in ascending order, "
                                       "[1, 3]: serving engines (vLLM, SGLang) join"),
    ("drafter.layer_types=[full_attention]", "one entry per layer (2, drafter.num_hidden_layers)"),
    ("drafter.layer_types=[sliding,full_attention]", "drafter.layer_types[...]='sliding'"),
    ("eval.temperature=-0.7", "eval.temperature=-0.7: expected a number >= 0"),
    ("eval.draft_temperature=0", "eval.draft_temperature=0.0: expected a number > 0"),
    ("train.best_by=loss", "train.best_by='loss': expected tau (greedy replay) or tau_T<x>"),
    ("train.best_by=tau_T0", "train.best_by='tau_T0': expected tau (greedy replay) or tau_T<x>"),
    ("train.best_by=tau_T1", "train.best_by=tau_T1 picks the best checkpoint by held-out"),
    ("eval.mode=offline", "eval.mode='offline'"),
    ("eval.max_new_tokens=1", "eval.max_new_tokens=1: expected an int >= 2"),
    ("eval.prompt_sets.gsm8k.limit=0", "eval.prompt_sets.gsm8k.limit=0"),
    ("~eval.prompt_sets.humaneval ~eval.prompt_sets.mtbench ~eval.prompt_sets.gsm8k",
     "eval.prompt_sets={}: expected at least one prompt set"),
    ("+eval.prompt_sets.mine={sourc:gsm8k}", "eval.prompt_sets.mine.sourc: no such setting of a prompt set; its "
                                             "settings: source, path, limit, turns, answer_max_new_tokens"),
    ("+eval.prompt_sets.mine={limit:2}", "eval.prompt_sets.mine.source: a prompt set of your own needs its source, "
                                         "one of 'sharegpt'"),
    ("+eval.prompt_sets.mine.limit=2", "+eval.prompt_sets.mine.source=<one of them>"),
    ("+eval.prompt_sets.mine={source:gsm8k,limit:two}", "eval.prompt_sets.mine.limit='two': expected an int >= 1"),
    ("+eval.prompt_sets.mine=3", "eval.prompt_sets.mine=3: expected {source, path, limit"),
    ("eval.prompt_sets.humaneval.turns=2", "eval.prompt_sets.humaneval.turns=2: expected 1: source humaneval has no "
                                           "second user turn (turns: 2 needs source mtbench)"),
    ("+eval.prompt_sets.mine={source:file,path:mine.jsonl,turns:2}", "eval.prompt_sets.mine.turns=2: expected 1"),
    ("+eval.prompt_sets.mtbench_turn2={source:gsm8k}", "eval.prompt_sets.mtbench_turn2: this name is the one of the "
                                                      "second-turn set that eval.prompt_sets.mtbench.turns=2 adds"),
    ("eval.prompt_sets.mtbench.answer_max_new_tokens=0",
     "eval.prompt_sets.mtbench.answer_max_new_tokens=0: expected an int >= 1, or null"),
    ("eval.checkpoint=last", "eval.checkpoint='last': expected one of 'best', 'final'"),
    ("logging.wandb.mode=on", "logging.wandb.mode='on'"),
    ("stages=[train,serve]", "unknown stages ['serve']"),
    ("device=tpu", "device='tpu': expected auto, cpu or cuda[:N]"),
    ("device=cuda:x", "device='cuda:x': expected auto, cpu or cuda[:N]"),
    ("name=", "name='': expected a folder name under runs/ (e.g. name=my_run, or name=sweep/lr3e-3 to nest runs)"),
    ("target.path=/does/not/exist", "target.path='/does/not/exist': only target=hf reads a path (this target is "
                                    "tiny): add target=hf to run that checkpoint"),
    ("eval.prompt_sets={}", r"eval.prompt_sets={}: a dict override adds to the prompt sets and never empties them"),
    ("+eval.prompt_sets={}", r"eval.prompt_sets={}: a dict override adds"),
    ("target.mask_token_id=-1", "target.mask_token_id=-1"),
    ("train.eval_every=5", "train.eval_every=5 replays held-out prompts while training; set data.heldout"),
    ("train.attention=flex", "train.attention=flex trains only on CUDA (torch has no FlexAttention backward on CPU) "
                             "and this run trains on the CPU (device=cpu): set train.attention=auto or sdpa"),
    ("train.heldout_max_new_tokens=1", "train.heldout_max_new_tokens=1: expected an int >= 2"),
    ("data.max_new_tokens=1 data.heldout=2", "data.max_new_tokens=1: expected an int >= 2 with data.heldout=2"),
    ("data.max_new_tokens=1 data.heldout=2 train.heldout_max_new_tokens=8", "data.max_new_tokens=1: expected"),
]


def test_prompt_sets_are_added_and_dropped_from_the_command_line():
    # `+eval.prompt_sets.NAME={...}` and `+eval.prompt_sets.NAME.source=...` were refused by OmegaConf ("dict is not
    # a subclass of PromptSetSettings"); `+eval.prompt_sets={NAME: {...}}` and `~eval.prompt_sets.NAME` worked.
    def prompt_sets(*overrides: str) -> dict:
        return settings_of(["+experiment=tiny", *overrides]).eval.prompt_sets

    added = prompt_sets("+eval.prompt_sets.mine={source: humaneval, limit: 3}")
    assert list(added) == ["humaneval", "mtbench", "gsm8k", "mine"]
    assert added["mine"] == schema.PromptSetSettings(source="humaneval", limit=3)
    assert added["humaneval"] == schema.PromptSetSettings(source="humaneval", limit=2)  # the experiment's, kept
    assert prompt_sets("+eval.prompt_sets.mine.source=gsm8k")["mine"] == schema.PromptSetSettings(source="gsm8k")
    assert prompt_sets("+eval.prompt_sets={mine: {source: gsm8k}}")["mine"] == schema.PromptSetSettings(source="gsm8k")
    only = prompt_sets("~eval.prompt_sets.humaneval", "~eval.prompt_sets.mtbench", "~eval.prompt_sets.gsm8k",
                       "+eval.prompt_sets.chat={source: mtbench, turns: 2, answer_max_new_tokens: 8}")
    assert only == {"chat": schema.PromptSetSettings(source="mtbench", turns=2, answer_max_new_tokens=8)}
    # A set added on the command line is a new evaluation of the same drafter.
    before = stage_keys(settings_of(["+experiment=tiny"]))
    after = stage_keys(settings_of(["+experiment=tiny", "+eval.prompt_sets.mine={source: gsm8k}"]))
    assert {stage for stage in STAGES if after[stage] != before[stage]} == {"eval"}


def test_the_multi_turn_sources_are_those_whose_prompts_have_a_second_turn(tmp_path):
    from dflash.data.prompts import load_prompts
    from dflash.eval.evaluate import TURN2_SUFFIX

    assert schema.TURN2_SUFFIX == TURN2_SUFFIX
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "And then?"}]
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text(json.dumps({"id": "c", "messages": turns}) + "\n")
    sharegpt = tmp_path / "sharegpt.json"  # the packaged ShareGPT file is large: the same loader on a small one
    sharegpt.write_text(json.dumps([{"id": "s", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "More?"}]}]))
    paths = {"file": str(conversations), "sharegpt": str(sharegpt)}
    for source in schema.PROMPT_SOURCES:
        prompts = load_prompts(source, path=paths.get(source), limit=20)
        assert any(p.follow_ups for p in prompts) == (source in schema.MULTI_TURN_SOURCES), source


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_settings_are_named_before_any_work(override, message, tmp_path):
    with pytest.raises(ConfigError) as error:
        settings_from(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}", *override.split()]))
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_folder_setting_under_a_link_to_nothing_is_refused(tmp_path):
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=f"run_dir='{tmp_path}/gone/run': is inside {tmp_path}/gone, a link to "
                                          f"{tmp_path}/nowhere, which does not exist; expected a folder"):
        settings_from(compose(["+experiment=tiny", f"run_dir={tmp_path / 'gone' / 'run'}"]))
    (tmp_path / "nowhere").write_text("")  # a link to a file
    with pytest.raises(ConfigError, match=f"is inside {tmp_path}/gone, a link to a file; expected a folder"):
        settings_from(compose(["+experiment=tiny", f"run_dir={tmp_path / 'gone' / 'run'}"]))
    (tmp_path / "nowhere").unlink()
    (tmp_path / "nowhere").mkdir()  # the link leads to a folder now: taken
    settings_from(compose(["+experiment=tiny", f"run_dir={tmp_path / 'gone' / 'run'}"]))


def test_a_missing_target_path_names_qwen36_path_only_for_the_qwen36_target(monkeypatch, tmp_path):
    monkeypatch.delenv("QWEN36_PATH", raising=False)

    def message(*overrides: str) -> str:
        with pytest.raises(ConfigError) as error:
            settings_from(compose(["+experiment=tiny", f"run_dir={tmp_path / 'run'}", *overrides]))
        return str(error.value)

    assert compose(["target=qwen36"]).target.path == schema.QWEN36_DEFAULT_PATH  # the check's copy of the default
    monkeypatch.setattr(schema, "QWEN36_DEFAULT_PATH", str(tmp_path / "no-qwen"))  # missing on every machine
    assert message("target=hf", "target.path=/nope").endswith("give a checkpoint folder or a .gguf file")
    assert "QWEN36_PATH" in message("target=hf", f"target.path={tmp_path / 'no-qwen'}")
    monkeypatch.setenv("QWEN36_PATH", str(tmp_path / "elsewhere"))
    assert "QWEN36_PATH" in message("target=qwen36") and "QWEN36_PATH" not in message("target=hf", "target.path=/x")


def test_flex_attention_is_refused_only_where_the_train_stage_would_run_on_the_cpu(monkeypatch):
    import torch

    def check(has_gpu: bool, *overrides: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
        settings_from(compose(["+experiment=tiny", "train.attention=flex", *overrides]))

    with pytest.raises(ConfigError, match=re.escape("trains on the CPU (device=auto finds no GPU here)")):
        check(False, "device=auto")
    check(True, "device=auto")
    check(False, "device=cuda:1")
    check(False, "stages=[eval]")  # evaluating a drafter trained with flex elsewhere


def test_training_on_the_cpu_of_a_machine_with_a_gpu_is_refused_with_the_way_to_do_it(monkeypatch):
    """DeepSpeed takes the GPU it finds as its accelerator (dflash/train/engine.py), so a run with device=cpu there
    would fail at its first step: the drafter on the GPU, the frozen head on the CPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=re.escape("set device=auto to train on the GPU, or hide it to train on the "
                                                    "CPU (CUDA_VISIBLE_DEVICES= python -m dflash.train ...)")):
        settings_from(compose(["+experiment=tiny"]))  # the tiny experiment sets device=cpu
    assert settings_from(compose(["+experiment=tiny", "device=auto"])).device == "auto"
    settings_from(compose(["+experiment=tiny", "stages=[data,capture]"]))  # no training: the CPU serves
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings_from(compose(["+experiment=tiny"]))


@pytest.mark.parametrize("overrides,warning", [
    (["capture=colocated", "capture.shard_tokens=400"], "capture.shard_tokens=400 is ignored: only capture=offline"),
    (["capture=colocated", "capture.devices=[0,1]"], "capture.devices=[0, 1] is ignored: capture=colocated runs"),
    (["eval.seed=3"], "eval.seed=3 is ignored: only eval.mode=live uses it"),
    (["train.dpace_alpha=0.2"], "train.dpace_alpha=0.2 is ignored: only train.loss_weighting=dpace uses it"),
    (["train.group_by=work"], "train.group_by='work' is ignored: train.group_by_length is 0"),
    (["train.heldout_batch_size=4"], "train.heldout_batch_size=4 is ignored: data.heldout is 0"),
    (["data.top_p=0.9"], "data.top_p=0.9 is ignored: data.temperature is 0 (every answer greedy)"),
    (["data.source=gsm8k", "data.turns=all"], "data.turns='all' is ignored: only data.source=sharegpt has turns"),
    (["eval.draft_temperature=0.5"], "eval.draft_temperature=0.5 is ignored: only sampled drafts at eval.temperature"),
    (["eval.temperature=1", "eval.draft_temperature=0.5"], "eval.draft_temperature=0.5 is ignored: only sampled"),
    (["drafter.layer_types=null", "drafter.sliding_window=64"],
     "drafter.sliding_window=64 is ignored: no drafter.layer_types entry is sliding"),
    (["drafter.target_layer_ids=[0,1]", "drafter.num_taps=3"],
     "drafter.num_taps=3 is ignored: drafter.target_layer_ids names the taps"),
    (["eval.prompt_sets.gsm8k.answer_max_new_tokens=5"],
     "eval.prompt_sets.gsm8k.answer_max_new_tokens=5 is ignored: only a set of turns: 2 answers a first turn"),
    (["capture=offline", "capture.devices=[0,1]"], "capture.devices=[0, 1] is ignored: capture runs on the CPU "
                                                   "(device=cpu)"),
])
def test_settings_this_combination_ignores_are_named(overrides, warning):
    assert warning in " ".join(settings_from(compose(["+experiment=tiny", *overrides])).ignored())


@pytest.mark.parametrize("name", ["../escape", "/tmp/x", "a/./b", "a//b"])
def test_a_name_that_would_put_the_run_outside_runs_is_refused_unless_run_dir_is_given(name):
    with pytest.raises(ConfigError, match=re.escape(f"name={name!r}: expected a folder name under runs/")):
        settings_from(compose(["+experiment=tiny", f"name={name}"]))
    assert settings_from(compose(["+experiment=tiny", f"name={name}", "run_dir=/tmp/elsewhere"])).run_dir == \
        "/tmp/elsewhere"  # the name makes no folder then
    assert settings_from(compose(["+experiment=tiny", "name=sweep/lr3e-3"])).run_dir == "runs/sweep/lr3e-3"


def test_only_ignored_settings_the_command_line_typed_are_named_when_it_is_known():
    settings = settings_from(compose(["+experiment=tiny", "capture=colocated", "capture.shard_tokens=400"]))
    warning = "capture.shard_tokens=400 is ignored: only capture=offline"
    assert warning in " ".join(settings.ignored(typed={"capture", "capture.shard_tokens"}))
    assert warning in " ".join(settings.ignored(typed={"capture.shard_tokens.x"}))  # a key below it, as in a mapping
    assert settings.ignored(typed={"capture", "train.lr"}) == []  # a group selection types no setting
    # A prompt set given whole (+eval.prompt_sets.mine={...}) types its settings.
    settings = settings_from(compose(["+experiment=tiny", "+eval.prompt_sets.mine={source: gsm8k, "
                                                          "answer_max_new_tokens: 5}"]))
    warning = "eval.prompt_sets.mine.answer_max_new_tokens=5 is ignored"
    assert warning in " ".join(settings.ignored(typed={"eval.prompt_sets.mine"}))
    assert settings.ignored(typed={"eval.prompt_sets.gsm8k.limit"}) == []


def test_a_prompt_set_name_with_a_dot_is_refused():
    # Only a YAML file makes one (the command line reads the dot as a level); its settings had no key of their own.
    cfg = compose(["+experiment=tiny"])
    with open_dict(cfg.eval.prompt_sets):
        cfg.eval.prompt_sets["gsm8k.v2"] = {"source": "gsm8k", "limit": 2}
    with pytest.raises(ConfigError, match=re.escape("eval.prompt_sets: the set name 'gsm8k.v2' holds a dot, which a "
                                                    "key reads as a level (eval.prompt_sets.gsm8k.v2.limit would name "
                                                    "a set 'gsm8k'): rename it, e.g. gsm8k_v2")):
        settings_from(cfg)


def test_capture_devices_off_cuda_are_named_as_ignored_for_auto_too(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = settings_from(compose(["+experiment=tiny", "device=auto", "capture=offline", "capture.devices=[0]"]))
    assert "capture.devices=[0] is ignored: capture runs on the CPU (no CUDA device is here)" in settings.ignored()


def test_a_prompt_set_setting_it_does_not_use_leaves_the_evaluation_fingerprint_as_it_was():
    from dflash.config.fingerprints import eval_fingerprint

    def fingerprint(*overrides):
        return eval_fingerprint(settings_from(compose(["+experiment=tiny", *overrides])), "drafter", "export")

    assert fingerprint("eval.prompt_sets.gsm8k.answer_max_new_tokens=5") == fingerprint()
    assert fingerprint("eval.prompt_sets.mtbench.answer_max_new_tokens=5") != fingerprint()  # turns: 2 uses it


def test_the_overrides_hydra_recorded_serve_the_warnings_and_the_suggested_commands(monkeypatch):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from dflash.config import CONFIG_DIR
    from dflash.config.command_line import hydra_overrides
    from dflash.pipeline import command_line_keys
    from dflash.stages.evaluation import command_overrides, train_command

    settings = settings_from(compose(["+experiment=tiny"]))
    assert hydra_overrides() is None and command_line_keys() is None  # a test's or a notebook's config
    assert command_overrides(settings) == ["name=tiny"]
    typed = ["+experiment=tiny", "train.lr=1e-3", "stages=[eval]", "eval.mode=live", "overwrite=true"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=typed, return_hydra_config=True)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # put back as it was when the test ends
    HydraConfig.instance().set_config(cfg)
    assert hydra_overrides() == typed
    assert command_line_keys() == {"experiment", "train.lr", "stages", "eval.mode", "overwrite"}
    assert command_overrides(settings) == ["+experiment=tiny", "train.lr=1e-3", "eval.mode=live"]
    assert train_command(settings) == "python -m dflash.train +experiment=tiny train.lr=1e-3"


def test_an_evaluations_training_suggestion_keeps_the_overrides_it_adopted(monkeypatch):
    """`python -m dflash.eval name=intr` adopts `+experiment=tiny train.epochs=300` from the run's training command;
    its "rerun training" suggestion left them out, and that command was refused in the run folder (other settings)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from dflash.config import CONFIG_DIR, command_line
    from dflash.stages.evaluation import command_overrides, train_command

    adopted = ["+experiment=tiny", "train.epochs=300"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="eval", overrides=[*adopted, "name=intr", "eval.mode=live"],
                            return_hydra_config=True)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    HydraConfig.instance().set_config(cfg)
    monkeypatch.setattr(command_line, "_adopted", adopted)
    settings = settings_from(compose([*adopted, "name=intr"]))
    assert command_overrides(settings) == ["name=intr", "eval.mode=live"]  # the next evaluation adopts them again
    assert train_command(settings) == "python -m dflash.train +experiment=tiny train.epochs=300 name=intr"


def test_a_sweep_jobs_and_a_moved_runs_next_command_name_their_own_folder(monkeypatch, tmp_path):
    """A -m job's `name=w-${hydra:job.num}` was suggested as Hydra records it, escaped (`name=w-$\\{hydra\\:job.num\\}`,
    which no command outside a sweep resolves), and a run moved into Hydra's folder by hydra.job.chdir=true was
    suggested a next command without it (the next run looked for runs/<name> in the folder the command started in)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from dflash.config import CONFIG_DIR
    from dflash.config.command_line import hydra_overrides
    from dflash.stages.closing import changed_working_folder
    from dflash.stages.evaluation import command_overrides, train_command

    typed = ["+experiment=tiny", "name=w-$\\{hydra\\:job.num\\}",
             "eval.out_dir=$\\{run_dir\\}/e-$\\{hydra\\:job.num\\}", "x_name='a b ${hydra:job.num}'"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=[*typed[:3], "hydra.job.chdir=true"],
                            return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.job.num = 1
        cfg.hydra.runtime.output_dir = str(tmp_path / "multirun" / "1")
        cfg.hydra.runtime.cwd = str(tmp_path)
        cfg.hydra.overrides.task.append(typed[3])  # a value that needs quotes
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # put back as it was when the test ends
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        job = cfg.copy()
        del job["hydra"]
    settings = settings_from(job)  # the job's settings, its name resolved
    assert settings.name == "w-1"
    # The name from the job's settings; x_name, no setting, with Hydra's own interpolation resolved.
    assert hydra_overrides(settings) == ["+experiment=tiny", "name=w-1", "eval.out_dir=runs/w-1/e-1", "x_name='a b 1'"]
    assert hydra_overrides()[1] == "name=w-1"  # without the settings, Hydra's own interpolations resolved alone
    folder = ["hydra.job.chdir=true", f"hydra.run.dir={tmp_path / 'multirun' / '1'}"]
    assert command_overrides(settings)[-2:] == folder
    assert shlex.split(train_command(settings))[3:] == ["+experiment=tiny", "name=w-1", "x_name='a b 1'", *folder]
    (tmp_path / "multirun" / "1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "multirun" / "1")
    assert changed_working_folder() == f"{tmp_path / 'multirun' / '1'} (hydra.job.chdir=true: the paths below are " \
                                       "inside it)"
    monkeypatch.chdir(tmp_path)
    assert changed_working_folder() is None
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        HydraConfig.instance().set_config(hydra_compose(config_name="train", overrides=typed[:1],
                                                        return_hydra_config=True))
    assert command_overrides(settings) == ["+experiment=tiny"]  # in the folder it started in: nothing added


def test_a_dotted_key_is_looked_up_in_the_schema_for_its_type_and_for_why_it_names_no_setting():
    from dflash.config.unknown_keys import lookup_setting, unknown_key_problem

    assert lookup_setting("train.lr") == (float, None)
    assert lookup_setting("train")[0] is schema.TrainSettings and lookup_setting("train")[1] is None
    kind, problem = lookup_setting("train.lrr")
    assert kind is None and problem.startswith("train.lrr: no such setting (did you mean train.lr?)")
    assert lookup_setting("eval.prompt_sets.gsm8k.limit") == (int, None)  # an entry's own settings
    assert lookup_setting("eval.prompt_sets.mine.turns") == (int, None)  # whatever the entry's name
    assert lookup_setting("eval.prompt_sets.gsm8k.limt")[1].startswith(
        "eval.prompt_sets.gsm8k.limt: no such setting (did you mean eval.prompt_sets.gsm8k.limit?)")
    assert lookup_setting("target.tiny.hidden_size") == (None, None)  # inside a free-form mapping
    assert lookup_setting("train.lr.x") == (None, "train.lr.x: train.lr is one value (float), not a group of "
                                                  "settings: train.lr=...")
    assert unknown_key_problem("train.lrr") == problem
    assert unknown_key_problem("hydra.run.dir") is None and unknown_key_problem("experiment") is None


def test_an_ignored_setting_is_really_ignored_by_its_stage():
    from dflash.stages.data import training_prompts

    settings = settings_from(compose(["+experiment=tiny", "data.source=gsm8k", "data.turns=all", "data.limit=3"]))
    assert "data.turns='all' is ignored" in " ".join(settings.ignored())
    prompts = training_prompts(settings.data)  # the first turns of the source, not an error
    assert len(prompts) == 3 and {p.prompt_set for p in prompts} == {"gsm8k"}


def test_the_shipped_experiments_give_no_ignored_settings():
    for name in ("tiny", "smollm2"):
        assert settings_from(compose([f"+experiment={name}"])).ignored() == []


@pytest.mark.parametrize("override,key", [("train.lr=fast", "train.lr"), ("capture=streaming", "capture")])
def test_bad_types_and_options_stop_the_composition(override, key):
    with pytest.raises(ConfigCompositionException) as error:
        compose(["+experiment=tiny", override])
    assert key in str(error.value) or key in str(error.value.__cause__)


@pytest.mark.parametrize("override,message", [
    ("train.lerning_rate=1e-3", "train.lerning_rate: no such setting; the command's --help lists the groups"),
    ("+train.lrr=0.1", "train.lrr: no such setting (did you mean train.lr?)"),  # Hydra appended it without a word
    ("capture.shard_tokns=1", "capture.shard_tokns: no such setting (did you mean capture.shard_tokens?)"),
    ("capture=online capture.timeout_ss=3", "capture.timeout_ss: no such setting (did you mean capture.timeout_s?)"),
    ("trian.lr=1", "trian: no such setting (did you mean train?)"),
    ("+experiment=tyni", "+experiment=tyni: no such experiment (conf/experiment/ holds qwen36, smollm2, "
                         "smollm2_quick, tiny)"),
])
def test_a_key_that_names_no_setting_is_refused_with_the_nearest_one(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(([] if "experiment" in override else ["+experiment=tiny"]) + override.split())


def test_a_setting_of_another_mode_added_with_a_plus_names_the_modes_that_have_it():
    with pytest.raises(ConfigError, match=re.escape("capture.cache: only capture=online and capture=colocated have "
                                                    "this setting, and this command runs another capture mode")):
        settings_from(compose(["+experiment=tiny", "capture=offline", "+capture.cache=false"]))


def test_free_form_settings_take_new_keys_and_a_composed_config_is_checked_too():
    compose(["+experiment=tiny", "+eval.chat_template_kwargs.enable_thinking=false", "target.tiny.seed=3",
             "+eval.prompt_sets.mine={source: gsm8k}", "hydra.run.dir=/tmp/x"])
    cfg = compose(["+experiment=tiny"])
    with open_dict(cfg.train):
        cfg.train.lrr = 0.1  # what an experiment file or a Hydra append can bring in
    with pytest.raises(ConfigError, match=re.escape("train.lrr: no such setting (did you mean train.lr?)")):
        settings_from(cfg)
    cfg = compose(["+experiment=tiny"])
    with open_dict(cfg.eval.prompt_sets.gsm8k):
        cfg.eval.prompt_sets.gsm8k.limt = 3  # an entry of a prompt set's type: its dataclass would drop the key
    with pytest.raises(ConfigError, match=re.escape("eval.prompt_sets.gsm8k.limt: no such setting (did you mean "
                                                    "eval.prompt_sets.gsm8k.limit?)")):
        settings_from(cfg)


@pytest.mark.parametrize("override,message", [
    ("stages=[data,capture,data]", "stages=['data', 'capture', 'data']: data named more than once"),
    ("stages=[]", "stages=[]: expected at least one of data, capture, train, export, eval"),
    ("run_dir=", "run_dir='': expected a folder path (an empty one would write into the working folder)"),
    ("data.path=/", "data.path='/': a folder; expected a file"),
    ("target.chat_template=/", "target.chat_template='/': a folder (expected a Jinja chat template file)"),
    ("drafter.num_hidden_layers=3", "drafter.layer_types=['sliding_attention', 'full_attention']: expected one entry "
                                    "per layer (3, drafter.num_hidden_layers), or null for full attention in every "
                                    "layer"),
])
def test_a_setting_that_would_run_a_stage_twice_or_write_where_it_should_not_is_refused(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings_from(compose(["+experiment=tiny", override]))


@pytest.mark.parametrize("override", ["eval.out_dir=", "target.cache_dir=", "capture.cache_dir="])
def test_an_empty_folder_setting_but_run_dir_means_its_default(override):
    settings_from(compose(["+experiment=tiny", "capture=online", override]))


def test_a_data_source_every_prompt_of_which_is_an_evaluation_prompt_is_refused_naming_the_check(tmp_path):
    from dflash.pipeline import Pipeline

    # The gsm8k the package ships is its test split: every prompt is one of the evaluation's.
    run = ["+experiment=tiny", f"run_dir={tmp_path}", "data.source=gsm8k", "stages=[data]"]
    with pytest.raises(ConfigError, match=re.escape("data.source=gsm8k: all 32 training prompts share a 13-word run "
                                                    "with an evaluation prompt")):
        Pipeline(compose(run)).run()
    assert not os.path.exists(tmp_path / "data" / "done.json")
    # A file of such prompts: its key is named.
    from dflash.data.prompts import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.messages[-1]["content"]}) + "\n"
                            for p in load_prompts("gsm8k", name="x", turns="first")[:4]))
    with pytest.raises(ConfigError, match=re.escape(f"data.path={path}: all 4 training prompts share")):
        Pipeline(compose(run + ["data.source=file", f"data.path={path}"])).run()


def test_a_key_that_names_no_setting_ends_the_command_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "-m", "dflash.train", "+experiment=tiny", f"run_dir={tmp_path / 'run'}",
                           "train.lrr=0.1"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("dflash: error: train.lrr: no such setting (did you mean train.lr?)")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("experiment", [["+experiment=tiny"], []])  # []: the CPU demo, whose line waits for the check
def test_a_bad_setting_ends_the_command_with_one_line_and_no_run_folder(tmp_path, experiment):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "-m", "dflash.train", *experiment, f"run_dir={run_dir}",
                           "train.lr=-1e-3"], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "dflash: error: train.lr=-0.001: expected a number > 0"
    assert "Traceback" not in done.stdout + done.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("override", ["capture.transport=spool", "capture.spool_dir=/x", "~capture.num_workers",
                                      "+capture.workers=external"])
def test_a_removed_setting_is_refused_with_what_replaces_it(override):
    with pytest.raises(ConfigError) as error:
        compose(["+experiment=tiny", "capture=online", override])
    message = str(error.value)
    assert "file spool was removed" in message and "torchrun --nproc_per_node 2" in message and "\n" not in message
    assert message.startswith(override.lstrip("+~").split("=")[0] + ": ")


def test_a_command_naming_a_removed_setting_ends_in_one_line_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "-m", "dflash.train", "+experiment=tiny", "capture=online",
                           f"run_dir={run_dir}", "capture.transport=spool"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("dflash: error: capture.transport: online capture's file spool was removed")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stdout + done.stderr
    assert not run_dir.exists()


def test_yaml_files_hold_no_copy_of_a_schema_default():
    """conf/ overrides the schema: a value equal to the schema's default would be a second copy of it."""
    presets = {"target": schema.TargetSettings, "drafter": schema.DrafterSettings}
    for group, cls in presets.items():
        defaults = OmegaConf.structured(cls)
        for path in sorted(os.listdir(os.path.join(REPO, "conf", group))):
            preset = OmegaConf.load(os.path.join(REPO, "conf", group, path))
            repeated = [k for k, v in preset.items() if not OmegaConf.is_missing(defaults, k) and v == defaults[k]]
            assert not repeated, f"conf/{group}/{path} repeats the schema's defaults of {repeated}"


def yaml_leaves(node, prefix: str = "") -> dict[str, object]:
    """Every leaf key of a plain nested dict as a dotted path (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    found = {}
    for key, value in node.items():
        found.update(yaml_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def experiment_baseline(path: str) -> list[str]:
    """The overrides of an experiment file's own defaults list: what composes without the file's body."""
    overrides = []
    for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults", []):
        if entry == "_self_":
            continue
        if isinstance(entry, str):
            overrides.append(f"+experiment={entry}")  # another experiment it extends
            continue
        ((key, value),) = entry.items()
        overrides.append(f"{key.removeprefix('override /')}={value}")
    return overrides


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "conf", "experiment"))))
def test_experiment_files_set_only_what_differs_from_what_they_extend(name):
    """An experiment's value equal to what its defaults list (and the schema) already give is a second copy."""
    path = os.path.join(REPO, "conf", "experiment", f"{name}.yaml")
    baseline = compose(experiment_baseline(path))
    body = OmegaConf.to_container(OmegaConf.load(path))
    body.pop("defaults", None)
    repeated = [key for key, value in yaml_leaves(body).items() if OmegaConf.select(baseline, key) == value]
    assert not repeated, f"conf/experiment/{name}.yaml sets {repeated} to the values it already has"


def test_the_command_configs_set_no_settings():
    """conf/train.yaml, eval.yaml and extract.yaml choose groups and Hydra's options; every value is the schema's."""
    for name in ("train", "eval", "extract"):
        body = OmegaConf.to_container(OmegaConf.load(os.path.join(REPO, "conf", f"{name}.yaml")))
        assert set(body) <= {"defaults", "hydra"}, f"conf/{name}.yaml sets {sorted(set(body) - {'defaults', 'hydra'})}"


def test_the_settings_reference_in_the_docs_is_current():
    from dflash.config.reference import END, START, reference

    with open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8") as f:
        text = f.read()
    assert text[text.index(START):text.index(END) + len(END)] == reference(), \
        "docs/config.md: paste the output of `python -m dflash.config`"


def test_moving_the_gguf_cache_reruns_and_refuses_nothing():
    """target.cache_dir says where the dequantised weights are kept, not which: a trained run whose cache moved keeps
    every fingerprint (the GOLDEN table above holds those of runs at the default), and its guard sees no change."""
    base = ["+experiment=smollm2", "run_dir=/nonexistent/run"]
    before, after = settings_of(base), settings_of([*base, "target.cache_dir=/elsewhere/cache"])
    assert after.target.cache_dir == "/elsewhere/cache"
    assert stage_keys(after) == stage_keys(before)
    assert fingerprints.settings_fingerprint(after) == fingerprints.settings_fingerprint(before)
    assert fingerprints.training_changes(OmegaConf.to_container(compose(base)), after) == []
    assert "cache_dir" not in " ".join(after.ignored())  # used, so not called ignored


def test_a_smaller_loss_chunk_resumes_the_same_training():
    """train.loss_chunk_size says how many rows of the head and loss are made at once (docs/training.md: lower it when
    memory is short), not what they are: a trained run keeps every fingerprint and its guard sees no change."""
    base = ["+experiment=tiny", "run_dir=/nonexistent/run"]
    before, after = settings_of(base), settings_of([*base, "train.loss_chunk_size=256"])
    assert after.train.loss_chunk_size == 256
    assert stage_keys(after) == stage_keys(before)
    assert fingerprints.settings_fingerprint(after) == fingerprints.settings_fingerprint(before)
    assert fingerprints.training_changes(OmegaConf.to_container(compose(base)), after) == []


def test_a_run_fingerprinted_before_a_stand_in_is_refused_naming_that_setting(tmp_path):
    """A run that an older dflash made with target.cache_dir=/x (then in the data fingerprint) or a colocated
    capture.batch_tokens of its own (then in the capture fingerprint) has fingerprints no setting of this command
    explains: the guard names the setting, not only the config.yaml to compare."""
    from dflash.pipeline import Pipeline
    from dflash.run_files import write_json
    from dflash.stages.guard import refuse_other_trained_settings
    from dflash.run_files import SETTINGS_KEY

    run = ["+experiment=tiny", "capture=colocated", f"run_dir={tmp_path}"]
    # Settings of the evaluation only, at stand-ins too, which no trained drafter's fingerprint holds.
    older = run + ["target.cache_dir=/x", "capture.batch_tokens=4096", "eval.seed=3",
                   "eval.prompt_sets.gsm8k.answer_max_new_tokens=5"]
    trained = Pipeline(compose(run))
    os.makedirs(trained.train.checkpoints)
    write_json(os.path.join(trained.train.checkpoints, "fingerprint.json"), {"fingerprint": "trained"})
    write_json(os.path.join(trained.train.checkpoints, SETTINGS_KEY), {"fingerprint": "an older form"})
    write_json(os.path.join(trained.train.out, "done.json"), {"checkpoint": "trained"})
    OmegaConf.save(compose(older), tmp_path / "config.yaml", resolve=True)
    with pytest.raises(ConfigError) as error:
        refuse_other_trained_settings(Pipeline(compose(older + ["stages=[eval]"])).train)
    message = str(error.value)
    assert "target.cache_dir: /x (the dflash that made the run fingerprinted this value; this one holds null" in message
    assert "capture.batch_tokens: 4096 (" in message and "see " not in message.split("(")[1]
    assert "eval." not in message
    # A setting that did change is named as before, alone.
    with pytest.raises(ConfigError, match=r"other settings \(train.lr: 0.0006 -> 0.01\)"):
        refuse_other_trained_settings(Pipeline(compose(older + ["train.lr=0.01"])).train)


def test_a_setting_is_described_for_a_terminal_by_its_key_or_its_groups():
    import subprocess

    from dflash.config.reference import describe

    assert describe("train.lr").splitlines() == [
        "train.lr: float, default 0.003; a change reruns train, export, eval",
        "    peak learning rate (AdamW, warmup then cosine)"]
    group = describe("logging")
    assert group.startswith("logging.tensorboard: bool") and "logging.wandb.mode: str, default offline" in group
    assert describe("eval.prompt_sets.humaneval.limit").startswith("eval.prompt_sets.NAME.limit: int or null")
    assert describe("capture.batch_tokens").startswith("capture.batch_tokens (every mode): int")
    other, _, offline, _ = describe("capture.shard_tokens").splitlines()  # a mode's own row says whose it is
    assert other.startswith("capture.shard_tokens (the other modes): int, default 1048576; a change reruns nothing")
    assert offline.startswith("capture.shard_tokens (capture=offline): int, default 1048576; a change reruns capture")
    with pytest.raises(ValueError, match="'': no setting has that key"):
        describe("")
    with pytest.raises(ValueError, match=re.escape("train.lrr: no such setting (did you mean train.lr?)")):
        describe("train.lrr")

    def command(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dflash.config", *arguments], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": REPO}, timeout=120)

    done = command("train.lr", "trian")  # every key checked before anything is printed
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "dflash: error: trian: no such setting (did you mean train?); the command's --help lists " \
                          "the groups, docs/config.md every key\n"
    assert command("train.lr=0.1").stderr.startswith("dflash: error: train.lr=0.1: this command takes keys, not "
                                                      "overrides: python -m dflash.config train.lr")
    assert command("--cfg").returncode == 2 and command("--help").stdout.startswith("usage: python -m dflash.config")
    assert command("train.lr", "data.limit").stdout.splitlines()[::2] == [
        "train.lr: float, default 0.003; a change reruns train, export, eval",
        "data.limit: int or null, default 200; a change reruns data, capture, train, export, eval"]


def docs_examples() -> list[list[str]]:
    """The overrides of docs/config.md's example commands of dflash.train that name no file of the user's."""
    with open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.startswith("    python -m dflash.train ")]
    commands = [line.split("#")[0].split()[3:] for line in lines]
    return [c for c in commands if not any("path=" in arg for arg in c)]


@pytest.mark.parametrize("overrides", docs_examples(), ids=" ".join)
def test_the_example_commands_of_the_settings_doc_pass_their_checks(overrides):
    # The first one failed its checks: the tiny experiment's two drafter layer types against three layers.
    assert len(docs_examples()) >= 2
    settings_from(compose(overrides))


def test_a_run_folder_that_cannot_be_made_is_one_line_before_any_stage(tmp_path, monkeypatch):
    """A folder the schema cannot judge (a special file system, as /proc; another user's, not seen as root): the
    command stops at making it, in one line, not a traceback."""
    from dflash.pipeline import Pipeline

    with pytest.raises(ConfigError, match=r"^run_dir='/proc/dflash-run': the folder cannot be made \(.+\)$"):
        Pipeline(compose(["+experiment=tiny", "run_dir=/proc/dflash-run", "stages=[data]"])).run()
    # Where the process may not write (a user's view of another's folder; root writes everywhere, so it is mocked).
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=rf"^run_dir='{tmp_path}/run': would be made in {tmp_path}, which cannot be "
                                          r"written into; expected a folder this user may write$"):
        settings_from(compose(["+experiment=tiny", f"run_dir={tmp_path}/run"]))
