"""What a stage is to the runner (dflash/pipeline.py): a name, an output folder, the ranks it runs on, a
fingerprint, its checks before any work, its work and the rows it adds to the block a run ends with. The runner, not
the stage, checks the done marker, says a stage is up to date and marks it done."""

from __future__ import annotations

from typing import Any

from dflash.run_files import stage_done


class Stage:
    """One stage of a run. On each rank that runs it, the runner calls prepare(), then kept() when up_to_date() (asked
    on rank 0, whose answer every rank takes), else run(), and rank 0 writes `out`/done.json with fingerprint() and
    the fields run() returned (None: the output is not finished, and the stage is not marked done)."""

    name: str
    out: str
    every_rank = False  # runs on every rank of a launch; else on rank 0 while the others wait at the next barrier
    barrier_before = False  # the ranks meet before it runs (a stage every rank runs on what rank 0 made)
    barrier_after = True  # the ranks meet after it, selected or not, before the next stage reads its output
    kept_line: str | None = "up to date"  # the runner's "[name] up to date: <out>"; None: the stage says nothing
    runs_with: str | None = None  # another stage whose selection selects this one too
    records_own_config = False  # keeps its config.yaml in its own folder; the others' runs write <run_dir>/config.yaml
    summary: dict[str, Any] | None = None  # what the stage measured, once it ran: what the run returns

    def fingerprint(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def preflight(self, selected: bool) -> None:
        """On every rank before any stage runs, selected or not: a ConfigError in one line for what would stop this
        stage later (a missing file, package or setting); nothing by default."""

    def prepare(self) -> None:
        """What comes before the done check (claiming the output folder); nothing by default."""

    def up_to_date(self) -> bool:
        return stage_done(self.out, self.fingerprint())

    def kept(self) -> None:
        """What an up-to-date stage still does; nothing by default."""

    def run(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def closing_rows(self) -> list[tuple[str, str]]:
        """(what, where) of what this stage left, for the block a run ends with (dflash/stages/closing.py); none by
        default."""
        return []

    def next_rows(self) -> list[tuple[str, str]]:
        """(what, command) of what to run next, for the end of that block; a row with no `what` is a note. None by
        default."""
        return []
