"""The block a run ends with (rank 0): what a person looks for after a run, where its drafter, plots and logs are,
its tau and what to run next, in the rows each stage gives (Stage.closing_rows, Stage.next_rows)."""

from __future__ import annotations

import contextlib
import os
import shlex

from dflash.run_files import shown
from dflash.stages.stage import Stage


def closing_block(run_dir: str, stages: tuple[Stage, ...], log: str,
                  next_rows: list[tuple[str, str]] = ()) -> str:
    """The stages' rows of what they left, the console log and the run folder's size, then their rows of what to
    run next and `next_rows` (the command's own: next_command_rows)."""
    rows = [("working folder", folder) for folder in [changed_working_folder()] if folder]
    rows += [row for stage in stages for row in stage.closing_rows()]
    rows.append(("console log", shown(log)))
    if os.path.isdir(run_dir):
        rows.append(("on disk", disk_use(run_dir)))
    rows += [row for stage in stages for row in stage.next_rows()] + list(next_rows)
    lines = [f"== done: {shown(run_dir)} =="]
    lines += [f"  {what:<26}  {value}" if what else f"  {value}" for what, value in rows]
    return "\n".join(lines)


def changed_working_folder() -> str | None:
    """The folder this command runs in, where Hydra moved it there from the one it was started in
    (`hydra.job.chdir=true`), said because every path of the block, and of the commands it suggests, is relative to
    it; None otherwise."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    if os.path.realpath(HydraConfig.get().runtime.cwd) == os.path.realpath(os.getcwd()):  # never raises
        return None
    return f"{os.getcwd()} (hydra.job.chdir=true: the paths below are inside it)"


def disk_use(run_dir: str) -> str:
    """The run folder's size, with its two largest entries: feature stores and checkpoints grow with the target
    and the data, and a person deciding what to keep wants to know where the bytes are."""
    sizes = {name: tree_bytes(os.path.join(run_dir, name)) for name in os.listdir(run_dir)}
    largest = sorted((size, name) for name, size in sizes.items() if size > 0)[::-1][:2]
    parts = ", ".join(f"{name} {readable_bytes(size)}" for size, name in largest)
    return f"{readable_bytes(sum(sizes.values()))} in {shown(run_dir)}" + (f" ({parts})" if parts else "")


def tree_bytes(path: str) -> int:
    """Bytes of the file at `path`, or of every file under the folder (links not followed). A file gone before it
    is read (another process's temporary file) counts 0: a size must never fail a run that has finished."""
    paths = [path] if not os.path.isdir(path) or os.path.islink(path) else \
        (os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)
    total = 0
    for file in paths:
        with contextlib.suppress(OSError):
            total += os.lstat(file).st_size
    return total


def readable_bytes(size: int) -> str:
    """`size` bytes in kB, MB or GB (powers of 1000) to three significant digits: 87.4 MB, 404 MB, 1 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale * 0.9995:  # 999.7 MB reads 1 GB, not 1000 MB
            value = size / scale
            return f"{value:.0f} {unit}" if value >= 99.95 else f"{value:.3g} {unit}"
    return f"{size} B"


def next_command_rows(context, selected: list[str], trained: bool = False) -> list[tuple[str, str]]:
    """The command after one whose stages (`selected`) stopped short of evaluation, none after one that evaluated:
    training after data or capture (dflash.extract; under the same launcher where the run had several ranks) unless
    the run holds its drafter already (`trained`), evaluation after training (stages=[train]; one process,
    docs/distributed.md); the same overrides, quoted for a shell."""
    from dflash.stages.evaluation import command_overrides, train_command

    if "eval" in selected:
        return []
    if "train" in selected or trained:
        words = " ".join(shlex.quote(w) for w in command_overrides(context.settings))
        return [("next: evaluation", f"python -m dflash.eval {words}")]
    if "data" in selected or "capture" in selected:
        launcher = " (with the same launcher)" if context.world_size > 1 else ""
        return [("next: training", f"{train_command(context.settings)}{launcher}")]
    return []
