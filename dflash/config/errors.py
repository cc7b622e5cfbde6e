"""The error a bad setting raises: one line that names the key and what it accepts."""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A setting that cannot run, found before any stage starts. Its message names the key (`train.lr`)."""


class ConfigPathError(ConfigError, FileNotFoundError):
    """A path a setting names that does not exist."""


class RunFolderError(ConfigError):
    """A run folder whose contents do not fit the command: a drafter of other settings, nothing to evaluate."""


class NothingToEvaluate(RunFolderError, FileNotFoundError):
    """The eval stage finds no drafter of these settings."""


class CorruptFile(RunFolderError):
    """A file of a folder of weights differs from its checksums.json; the message names the folder, the file, and
    what to do."""


def as_typed(value: Any) -> str:
    """`value` as a command line writes it: null, true/false, [1,5,9], {family: llama, seed: 0}, '' for an empty
    string; anything else as str() writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {as_typed(item)}" for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(as_typed(item) for item in value) + "]"
    return str(value) if value != "" else "''"


def require(condition: bool, key: str, value: Any, expected: str) -> None:
    """ConfigError `key=value: expected ...` unless `condition` (None written as the command line writes it)."""
    if not condition:
        raise ConfigError(f"{key}={'null' if value is None else repr(value)}: expected {expected}")


def require_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    require(value in choices, key, value, "one of " + ", ".join(repr(c) for c in choices))
