"""Stage fingerprints derived from the schema: each field's `affects` metadata says which stage takes it.

A stage is skipped when its done marker holds the fingerprint of the current settings (dflash/run_files.py), so a
field that decides a stage's output must enter that stage's fingerprint and a field that does not must stay out:
the first reruns the stage when changed, the second never does. Each stage's fingerprint also holds its input
stage's (data -> capture -> train -> export -> eval), so a change reruns the stage it affects and every stage after
it. No setting affects the export alone: its fingerprint is the train stage's (dflash/stages/export.py).

The parts keep one fixed layout, so that a run folder made by an earlier version of dflash keeps its fingerprints;
tests/test_config.py pins them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash.config.schema import RunSettings
from dflash.run_files import fingerprint


def stage_settings(node: Any, stage: str) -> dict[str, Any]:
    """The fields of a settings object that affect `stage`, as plain values; nested settings (a dataclass, or a
    dict of them) are taken the same way field by field. A field at its `neutral` value is left out."""
    taken: dict[str, Any] = {}
    for f in dataclasses.fields(node):
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


def training_changes(old: dict[str, Any], new: RunSettings) -> list[str]:
    """`key: old -> new` for each setting that decides the data, capture or train stage and differs between the
    resolved config `old` (a run folder's config.yaml, as a dict) and `new`."""
    changes: list[str] = []

    def walk(node: Any, before: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            value, key = getattr(node, f.name), prefix + f.name
            was = before.get(f.name, "(absent)") if isinstance(before, dict) else "(absent)"
            if dataclasses.is_dataclass(value):
                walk(value, was, key + ".")
            elif set(f.metadata["affects"]) & {"data", "capture", "train"} and _plain(value, "train") != was:
                neutral = "neutral" in f.metadata and _is_neutral(f.metadata["neutral"], value, node)
                if not (was == "(absent)" and neutral):  # a setting added since, at its neutral value
                    changes.append(f"{key}: {was} -> {_plain(value, 'train')}")

    walk(new, old, "")
    return changes


def target_identity(s: RunSettings) -> dict[str, Any]:
    """Which target wrote the data stage's answers: the target settings that affect the data stage, less the folder
    a GGUF target is dequantised into (the same weights wherever they are cached). Journals record it."""
    identity = stage_settings(s.target, "data")
    identity.pop("cache_dir", None)
    return identity


def data_fingerprint(s: RunSettings) -> str:
    return fingerprint(stage_settings(s.data, "data"), stage_settings(s.target, "data"))


def capture_fingerprint(s: RunSettings, made: dict[str, Any]) -> str:
    """`made`: what the data stage made ({fingerprint, samples, num_tokens} of its stats.json), not only what it
    was asked: a rerun that retried failed prompts has more samples."""
    taps = stage_settings(s.drafter, "capture")
    if taps.get("target_layer_ids") is not None:
        # Fingerprinted as its text ("[1, 16, 31]") since runs first had fingerprints: kept so they keep theirs.
        taps["target_layer_ids"] = str(taps["target_layer_ids"])
    return fingerprint(data_fingerprint(s), taps, stage_settings(s.capture, "capture"), made)


def checkpoint_fingerprint(s: RunSettings, capture_key: str) -> str:
    """What the checkpoints of a run depend on. The rank count is not part of it: a run resumes on another number
    of ranks (the checkpoints are converted)."""
    return fingerprint(capture_key, stage_settings(s.train, "train"), stage_settings(s.drafter, "train"),
                       *stage_settings(s.target, "train").values(), stage_settings(s.deepspeed, "train"))


def settings_fingerprint(s: RunSettings) -> str:
    """The checkpoint fingerprint less what the data stage made: equal for two commands whose data, capture and
    train settings are equal, whether or not the data stage has finished (a run folder's guard compares it)."""
    return checkpoint_fingerprint(s, capture_fingerprint(s, {}))


def eval_fingerprint(s: RunSettings, drafter_key: str, drafter_dir: str) -> str:
    return fingerprint(drafter_key, stage_settings(s.eval, "eval"), stage_settings(s.target, "eval"), drafter_dir)
