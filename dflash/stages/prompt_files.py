"""The check, before any stage runs, that the prompt files a stage will read are there, and that a user's own
file reads as prompts."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

from dflash.config.errors import ConfigError, ConfigPathError
from dflash.config.schema import RunSettings

T = TypeVar("T")


def eval_prompt_files(settings: RunSettings) -> list[tuple[str, str, str | None]]:
    """(key prefix, source, path) of every evaluation prompt set."""
    return [(f"eval.prompt_sets.{name}", spec.source, spec.path) for name, spec in settings.eval.prompt_sets.items()]


def refuse_unreadable_prompts(files: list[tuple[str, str, str | None]]) -> None:
    """ConfigPathError naming the key of the first of `files` ((key prefix, source, path): "data" or
    "eval.prompt_sets.<name>") that is not there (a packaged set whose package is not installed, a path that is no
    file); then ConfigError naming the key of an evaluation set's own file (a path given) that does not read as
    prompts (a malformed line, a record without a user turn), found here rather than after the stages before the
    evaluation. The data stage's own file is read by its preflight (read_prompt_file)."""
    from dflash.data.prompts import prompt_file_problem

    for prefix, source, path in files:
        problem = prompt_file_problem(source, path)
        if problem is not None:
            key, value = (f"{prefix}.path", path) if path else (f"{prefix}.source", source)
            raise ConfigPathError(f"{key}={value!r}: {problem}")
    for prefix, source, path in files:
        if path and prefix != "data":
            file = os.path.realpath(os.path.expanduser(path))
            stat = os.stat(file)
            read_prompt_file(prefix, source, lambda: _read_once(source, file, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=16)
def _read_once(source: str, path: str, mtime_ns: int, size: int) -> int:
    """The number of prompts of a file as it is now (its time and size in the key): the data stage's preflight and
    the evaluation's both check an evaluation set's file in one command."""
    from dflash.data.prompts import load_prompts

    return len(load_prompts(source, path=path))


def read_prompt_file(prefix: str, source: str, read: Callable[[], T]) -> T:
    """What `read` returns, reading the prompt file of setting `prefix`.path in the format of `source`; its
    ConfigError (which names the file and the line or record) again, led by the key, and for a packaged set's
    format with the source that reads a file of one's own."""
    try:
        return read()
    except ConfigError as error:
        hint = "" if source == "file" else (f" (read as {prefix}.source={source}'s format; {prefix}.source=file "
                                            f"reads a .jsonl or .json file of prompts)")
        raise ConfigError(f"{prefix}.path: {error}{hint}") from None
