"""The check, before any stage runs, that the prompt files a stage will read are there."""

from __future__ import annotations

from dflash.config.errors import ConfigPathError
from dflash.config.schema import RunSettings


def eval_prompt_files(settings: RunSettings) -> list[tuple[str, str, str | None]]:
    """(key prefix, source, path) of every evaluation prompt set."""
    return [(f"eval.prompt_sets.{name}", spec.source, spec.path) for name, spec in settings.eval.prompt_sets.items()]


def refuse_unreadable_prompts(files: list[tuple[str, str, str | None]]) -> None:
    """ConfigPathError naming the key of the first of `files` ((key prefix, source, path): "data" or
    "eval.prompt_sets.<name>") that is not there (a packaged set whose package is not installed, a path that is no
    file)."""
    from dflash.data.prompts import prompt_file_problem

    for prefix, source, path in files:
        problem = prompt_file_problem(source, path)
        if problem is not None:
            key, value = (f"{prefix}.path", path) if path else (f"{prefix}.source", source)
            raise ConfigPathError(f"{key}={value!r}: {problem}")
