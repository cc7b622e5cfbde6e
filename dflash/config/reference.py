"""The reference table of every setting (key, type, default, the stages it reruns, what it is), made from the
schema; docs/config.md holds it, and a test checks that it is current (`python -m dflash.config` prints it). One
setting, or a group's, is described for a terminal (`python -m dflash.config train.lr`)."""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any

from omegaconf import MISSING

from dflash.config.schema import (
    STAGES, CaptureSettings, ColocatedCapture, DataSettings, DeepSpeedSettings, DrafterSettings, EvalSettings,
    LoggingSettings, OfflineCapture, OnlineCapture, PromptSetSettings, RunSettings, SyntheticSettings,
    TargetSettings, TrainSettings, WandbSettings,
)
from dflash.config.unknown_keys import lookup_setting

SECTIONS: list[tuple[str, type, type | None]] = [
    ("(top level)", RunSettings, None),
    ("target", TargetSettings, None),
    ("drafter", DrafterSettings, None),
    ("data", DataSettings, None),
    ("data.synthetic", SyntheticSettings, None),
    ("capture (every mode)", CaptureSettings, None),
    ("capture=offline", OfflineCapture, CaptureSettings),
    ("capture=online", OnlineCapture, CaptureSettings),
    ("capture=colocated", ColocatedCapture, CaptureSettings),
    ("train", TrainSettings, None),
    ("deepspeed", DeepSpeedSettings, None),
    ("eval", EvalSettings, None),
    ("eval.prompt_sets.NAME", PromptSetSettings, None),
    ("logging", LoggingSettings, None),
    ("logging.wandb", WandbSettings, None),
]
START = "<!-- settings reference: made by `python -m dflash.config`; tests/test_config.py checks it -->"
END = "<!-- end of settings reference -->"


def _type_name(annotation: Any) -> str:
    if annotation is Any:
        return "any"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union and len(args) == 1:
        return _type_name(args[0]) + " or null"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "(group)" if dataclasses.is_dataclass(value) else f"`{value}`"
    if f.default is MISSING:
        return "(required)"
    return "`null`" if f.default is None else f"`{f.default}`"


def _reruns(f: dataclasses.Field) -> str:
    """The stages a change reruns: those the field affects and every stage after the first of them."""
    affects = f.metadata["affects"]
    if not affects:
        return "nothing"
    first = min(STAGES.index(stage) for stage in affects)
    return ", ".join(stage for i, stage in enumerate(STAGES) if i >= first or stage in affects)


def _group(cls: type) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def section_fields(cls: type, base: type | None) -> list[dataclasses.Field]:
    """The settings a section of the reference lists: its fields but the groups, and those a mode's class adds or
    redefines over the class common to every mode."""
    inherited = {f.name: f for f in dataclasses.fields(base)} if base else {}
    return [f for f in dataclasses.fields(cls)
            if not _group(f.type) and not (base and f.name in inherited and f.metadata == inherited[f.name].metadata)]


def redefined_by_a_mode(base: type) -> set[str]:
    """The names of `base`'s settings that a section's class redefines over it (a capture mode's own default or
    what it reruns): the base's entry holds for the other modes only."""
    return {f.name for _, cls, of in SECTIONS if of is base for f in section_fields(cls, of)}


def dotted_key(title: str, cls: type, name: str) -> str:
    """A setting's key on the command line: `train.lr`, `capture.batch_tokens`, `eval.prompt_sets.NAME.limit`."""
    return name if cls is RunSettings else f"{title.split(' ')[0].split('=')[0]}.{name}"


def reference() -> str:
    lines = [START, ""]
    for title, cls, base in SECTIONS:
        rows, redefined = [], redefined_by_a_mode(cls)
        for f in section_fields(cls, base):
            doc = f.metadata["doc"].replace("|", "\\|")
            reruns = _reruns(f) + (" (the other modes; see its mode's row)" if f.name in redefined else "")
            rows.append(f"| `{f.name}` | {_type_name(f.type)} | {_default(f)} | {reruns} | {doc} |")
        if not rows:
            continue
        lines += [f"**{title}**", "", "| key | type | default | changing it reruns | what it is |",
                  "|---|---|---|---|---|", *rows, ""]
    lines.append(END)
    return "\n".join(lines)


def describe(asked: str) -> str:
    """The settings whose key is `asked` or begins with it (`train.lr`, `train`, `capture.batch_tokens`), each as a
    few lines for a terminal: its key (with the capture modes it belongs to), type, default, what a change reruns,
    and what it is; ValueError when no key matches."""
    parts = asked.strip(".").split(".")
    if parts[:2] == ["eval", "prompt_sets"] and len(parts) > 2:
        parts[2] = "NAME"  # eval.prompt_sets.humaneval.limit is eval.prompt_sets.NAME.limit
    looked_up = ".".join(parts)
    blocks = []
    for title, cls, base in SECTIONS:
        redefined = redefined_by_a_mode(cls)
        for f in section_fields(cls, base):
            key = dotted_key(title, cls, f.name)
            if looked_up and (key == looked_up or key.startswith(looked_up + ".")):
                # A capture setting can differ by mode (its default, what it reruns): each row says whose it is.
                where = f" ({title.split(' ', 1)[1].strip('()')})" if title.startswith("capture (") else \
                    f" ({title})" if "=" in title else ""
                if f.name in redefined:
                    where = " (the other modes)"
                default = _default(f).replace("`", "")
                blocks.append(f"{key}{where}: {_type_name(f.type)}, default {default}; a change reruns {_reruns(f)}\n"
                              + textwrap.fill(f.metadata["doc"], width=100, initial_indent="    ",
                                              subsequent_indent="    "))
    if not blocks:
        why = lookup_setting(looked_up)[1] if looked_up else None
        raise ValueError(why or f"{asked!r}: no setting has that key or begins with it (python -m dflash.config "
                                f"lists every one)")
    return "\n".join(blocks)
