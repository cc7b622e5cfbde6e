"""What a stage is to the runner (dflash/pipeline.py): a name, an output folder, the ranks it runs on, a
fingerprint, its checks before any work, its work and the rows it adds to the block a run ends with. The runner, not
the stage, checks the done marker, says a stage is up to date and marks it done."""

from __future__ import annotations

from itertools import takewhile
from typing import Any

from dflash.config.errors import RunFolderError
from dflash.config.schema import STAGES
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
    # Writes only a folder of its own beside the run's (several evaluations side by side): a command of such stages
    # alone shares the run folder's lock (dflash/stages/run_lock.py).
    shares_run_folder = False
    summary: dict[str, Any] | None = None  # what the stage measured, once it ran: what the run returns
    context: Any  # the run's RunContext (dflash/stages/context.py)
    input_stage: Stage | None = None  # the stage whose output it reads; None: none, or (eval) checks of its own
    made = "made"  # what its finished output is, in "<out> is not <made> for these settings"

    def fingerprint(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def warnings(self) -> list[str]:
        """What rank 0 warns about before any stage runs, where the command selects this stage: its settings that
        this launch cannot honour. None by default."""
        return []

    def preflight(self, selected: bool) -> None:
        """On every rank before any stage runs, selected or not: a ConfigError in one line for what would stop this
        stage later (a missing file, package or setting); by default, input stages it would run on unfinished
        (refuse_unfinished_input)."""
        self.refuse_unfinished_input(selected)

    def done(self) -> bool:
        """Whether its output is finished for these settings (its done marker), without up_to_date's other checks."""
        return stage_done(self.out, self.fingerprint())

    def selected_by(self, named: list[str]) -> bool:
        """Whether a command naming the stages `named` runs it (its name, or the stage it runs with)."""
        return self.name in named or self.runs_with in named

    def refuse_unfinished_input(self, selected: bool) -> None:
        """RunFolderError in one line naming the stages to add, when this stage will run (selected, not done) on the
        output of input stages the command does not run: the nearest not finished for these settings, or below a
        stage the command runs (which may remake what that output was made from)."""
        if not selected or self.input_stage is None or self.done():
            return
        named = self.context.settings.stages
        skipped, above = [], self.input_stage
        while above is not None and not above.selected_by(named):
            skipped.append(above)
            above = above.input_stage
        if not skipped:
            return
        if above is not None:
            add = skipped
            why = (f"this command runs the {above.name} stage but not {' or '.join(s.name for s in add)}, so "
                   f"{skipped[0].out} would not follow what it makes")
        else:
            add = list(takewhile(lambda stage: not stage.done(), skipped))  # a finished one feeds those after it
            if not add:
                return
            why = f"{skipped[0].out} is not {skipped[0].made} for these settings"
        names = [s.name for s in reversed(add)]
        stages = ",".join(name for name in STAGES if name in set(named) | set(names))
        raise RunFolderError(f"{why}: add {' and '.join(names)} to stages (stages=[{stages}])")

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
