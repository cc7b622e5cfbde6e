"""The block a run ends with (rank 0): what a person looks for after a run, where its drafter, plots and logs are,
its tau and what to run next, in the rows each stage gives (Stage.closing_rows, Stage.next_rows)."""

from __future__ import annotations

import os

from dflash.stages.stage import Stage


def closing_block(run_dir: str, stages: tuple[Stage, ...], log: str) -> str:
    """The stages' rows of what they left, the console log, then their rows of what to run next."""
    rows = [row for stage in stages for row in stage.closing_rows()]
    rows.append(("console log", shown(log)))
    rows += [row for stage in stages for row in stage.next_rows()]
    lines = [f"== done: {shown(run_dir)} =="]
    lines += [f"  {what:<26}  {value}" if what else f"  {value}" for what, value in rows]
    return "\n".join(lines)


def shown(path: str) -> str:
    """`path` relative to the working folder when it lies inside it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
