"""Stage fingerprints derived from the schema: each field's `affects` metadata says which stage takes it.

A stage is skipped when its done marker holds the fingerprint of the current settings (dflash/run_files.py), so a
field that decides a stage's output must enter that stage's fingerprint and a field that does not must stay out:
the first reruns the stage when changed, the second never does. Each stage's fingerprint also holds its input
stage's (data -> capture -> train -> export -> eval), so a change reruns the stage it affects and every stage after
it. No setting affects the export alone: its fingerprint is the train stage's (dflash/stages/export.py).

A setting the run does not use (its schema `unused` reason, e.g. train.dpace_alpha without dpace weighting) enters
as its stand-in, not as its value (`in_effect`), so changing it reruns nothing and the run folder's guard lets it
through. The stand-in is the value such a setting had in the runs fingerprinted before (its default; the taps'
count for drafter.num_taps), so those keep their fingerprints; a run made with another value gets new ones, and the
run folder's guard names that setting (stand_in_changes). A field that was found to decide nothing of a stage that
fingerprinted it (target.cache_dir: where the weights are kept) enters that stage's fingerprints at its default
(schema `fingerprinted_before`), the same way.

The parts keep one fixed layout, so that a run folder made by an earlier version of dflash keeps its fingerprints;
tests/test_config.py pins them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from dflash.config.errors import as_typed
from dflash.config.schema import RunSettings, field_default, setting_leaves, unused_settings
from dflash.run_files import fingerprint


def stage_settings(node: Any, stage: str) -> dict[str, Any]:
    """The fields of a settings object that affect `stage`, as plain values; nested settings (a dataclass, or a
    dict of them) are taken the same way field by field. A field at its `neutral` value is left out; a field that
    `stage` fingerprinted before (schema `fingerprinted_before`) enters at its default."""
    taken: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        if stage in f.metadata["fingerprinted_before"]:
            taken[f.name] = field_default(f)
            continue
        if stage not in f.metadata["affects"]:
            continue
        value = getattr(node, f.name)
        if "neutral" in f.metadata and _is_neutral(f.metadata["neutral"], _plain(value, stage), node):
            continue
        taken[f.name] = _plain(value, stage)
    return taken


def _plain(value: Any, stage: str) -> Any:
    if dataclasses.is_dataclass(value):
        return stage_settings(value, stage)
    if isinstance(value, dict):
        return {k: _plain(v, stage) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, stage) for v in value]
    return value


def _is_neutral(neutral: Any, value: Any, group: Any) -> bool:
    """A callable `neutral` is asked with the value and the settings group that holds it."""
    return neutral(value, group) if callable(neutral) else value == neutral


def in_effect(s: RunSettings) -> RunSettings:
    """A copy of `s` with each setting it does not use at its stand-in (schema.unused_settings)."""
    effective = copy.deepcopy(s)
    for key, _, stand_in, _ in unused_settings(s):
        *groups, name = key.split(".")
        node = effective
        for group in groups:  # a group of settings, or an entry of a mapping of them (eval.prompt_sets.gsm8k)
            node = node[group] if isinstance(node, dict) else getattr(node, group)
        setattr(node, name, stand_in)
    return effective


def training_changes(old: dict[str, Any], new: RunSettings) -> list[str]:
    """`key: old -> new` for each setting that decides the data, capture or train stage, is used by `new` and
    differs between the resolved config `old` (a run folder's config.yaml, as a dict) and `new`."""
    changes: list[str] = []
    unused = {key for key, *_ in unused_settings(new)}
    for key, f, value, group in setting_leaves(new):
        if key in unused or not set(f.metadata["affects"]) & {"data", "capture", "train"}:
            continue
        was = recorded_value(old, key, "(absent)")
        if _plain(value, "train") != was:
            neutral = "neutral" in f.metadata and _is_neutral(f.metadata["neutral"], value, group)
            if not (was == "(absent)" and neutral):  # a setting added since, at its neutral value
                changes.append(f"{key}: {as_typed(was)} -> {as_typed(_plain(value, 'train'))}")
    return changes


def stand_in_changes(old: dict[str, Any], new: RunSettings) -> list[str]:
    """`key: value (...)` for each setting that `new` fingerprints at a stand-in (its `unused` stand-in, or the default
    a `fingerprinted_before` field enters at) where the resolved config `old` recorded another value: the
    fingerprints of a run that dflash made before the stand-in took that value, so they differ from `new`'s where
    no setting does (what a guard names when training_changes finds nothing). Only settings of the data, capture or
    train stage: the guard compares a trained drafter's fingerprints, which no other setting enters."""
    training = {"data", "capture", "train"}
    fields = {key: f for key, f, _, _ in setting_leaves(new)}
    standing = {key: stand_in for key, _, stand_in, _ in unused_settings(new)
                if set(fields[key].metadata["affects"]) & training}
    standing.update((key, field_default(f)) for key, f in fields.items()
                    if set(f.metadata["fingerprinted_before"]) & training)
    changes = []
    for key, stand_in in standing.items():
        recorded = recorded_value(old, key, stand_in)
        if recorded != stand_in:
            changes.append(f"{key}: {as_typed(recorded)} (the dflash that made the run fingerprinted this value; this "
                           f"one holds {as_typed(stand_in)} in its place)")
    return changes


def recorded_value(config: dict[str, Any], key: str, missing: Any) -> Any:
    """The value at dotted `key` of a resolved config (a dict), `missing` where it has none."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part, missing) if isinstance(node, dict) else missing
    return node


def target_identity(s: RunSettings) -> dict[str, Any]:
    """Which target wrote the data stage's answers: the target settings that affect the data stage, less the folder
    a GGUF target is dequantised into (which journals never recorded). Journals record it."""
    identity = stage_settings(in_effect(s).target, "data")
    identity.pop("cache_dir", None)
    return identity


# Each public fingerprint below puts the settings in effect once (in_effect) and hands them to the _private forms:
# a second pass would judge use by stand-ins (data.temperature standing in at 0 leaves data.sampled_share unused).

def data_fingerprint(s: RunSettings) -> str:
    return _data_fingerprint(in_effect(s))


def capture_fingerprint(s: RunSettings, made: dict[str, Any]) -> str:
    """`made`: what the data stage made ({fingerprint, samples, num_tokens} of its stats.json), not only what it
    was asked: a rerun that retried failed prompts has more samples."""
    return _capture_fingerprint(in_effect(s), made)


def checkpoint_fingerprint(s: RunSettings, capture_key: str) -> str:
    """What the checkpoints of a run depend on. The rank count is not part of it: a run resumes on another number
    of ranks (the checkpoints are converted)."""
    return _checkpoint_fingerprint(in_effect(s), capture_key)


def settings_fingerprint(s: RunSettings) -> str:
    """The checkpoint fingerprint less what the data stage made: equal for two commands whose data, capture and
    train settings are equal, whether or not the data stage has finished (a run folder's guard compares it)."""
    effective = in_effect(s)
    return _checkpoint_fingerprint(effective, _capture_fingerprint(effective, {}))


def eval_fingerprint(s: RunSettings, drafter_key: str, drafter_folder: str) -> str:
    """`drafter_key`: the measured drafter's own fingerprint; `drafter_folder`: which of the run's exports it is."""
    effective = in_effect(s)
    return fingerprint(drafter_key, stage_settings(effective.eval, "eval"), stage_settings(effective.target, "eval"),
                       drafter_folder)


def _data_fingerprint(effective: RunSettings) -> str:
    return fingerprint(stage_settings(effective.data, "data"), stage_settings(effective.target, "data"))


def _capture_fingerprint(effective: RunSettings, made: dict[str, Any]) -> str:
    taps = stage_settings(effective.drafter, "capture")
    if taps.get("target_layer_ids") is not None:
        # Fingerprinted as its text ("[1, 16, 31]") since runs first had fingerprints: kept so they keep theirs.
        taps["target_layer_ids"] = str(taps["target_layer_ids"])
    return fingerprint(_data_fingerprint(effective), taps, stage_settings(effective.capture, "capture"), made)


def _checkpoint_fingerprint(effective: RunSettings, capture_key: str) -> str:
    return fingerprint(capture_key, stage_settings(effective.train, "train"),
                       stage_settings(effective.drafter, "train"), *stage_settings(effective.target, "train").values(),
                       stage_settings(effective.deepspeed, "train"))
