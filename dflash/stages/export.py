"""The export stage: the trained drafter in the z-lab DFlashDraftModel format that vLLM and SGLang serve, the final
one (the train stage's `checkpoints/final/`) to `export/` and the best held-out checkpoint (`checkpoints/best/`) to
`export_best/`, and the training curve (`metrics.jsonl` -> `training_curve.png`).

It has no settings of its own: its fingerprint is the train stage's, so a drafter trained again is exported again
and one that is not is kept. It runs whenever the train stage is selected (runs_with).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from typing import Any

import torch

from dflash.config.errors import RunFolderError
from dflash.run_files import checksum_problem, read_json_or_none, shown, stage_done, write_json
from dflash.stages.context import RunContext
from dflash.stages.stage import Stage
from dflash.stages.train import TrainStage

logger = logging.getLogger(__name__)


class ExportStage(Stage):
    name = "export"
    made = "exported"
    runs_with = "train"  # a drafter trained is always exported: `stages=[train]` trains and exports

    def __init__(self, run: RunContext, train: TrainStage) -> None:
        self.context, self.train = run, train
        self.input_stage = train
        self.out = run.dirs["export"]
        self.best = os.path.join(run.run_dir, "export_best")

    def describe(self) -> str:
        best = " and the best held-out checkpoint" if self.context.settings.data.heldout else ""
        return f"the final drafter{best} in the z-lab format (vLLM, SGLang)"

    def fingerprint(self) -> str:
        """The train stage's: export/done.json holds the key the eval stage takes as its drafter's."""
        return self.train.fingerprint()

    def up_to_date(self) -> bool:
        return stage_done(self.out, self.fingerprint()) and self.exports_intact() and self.templates_carried()

    def templates_carried(self) -> bool:
        """Whether export/ and export_best/ carry the chat template the data stage recorded (recorded_template):
        one recorded since they were written (a run folder from before the record) or changed is exported again."""
        recorded = recorded_template(self.context.run_dir)
        for folder in (self.out, self.best):
            if os.path.exists(os.path.join(folder, "config.json")) and carried_template(folder) != recorded:
                logger.info(f"[export] {folder} does not carry the chat template data/ records: exporting it again "
                            f"from {self.train.checkpoints}")
                return False
        return True

    def exports_intact(self) -> bool:
        """Whether export/ and export_best/ hold the files they were written with (their checksums.json). A corrupt
        one is named, and the stage exports again from the checkpoints."""
        for folder in (self.out, self.best):
            problem = checksum_problem(folder)
            if problem is None and os.path.isdir(folder) and not holds_drafter(folder):
                problem = "config.json is missing"  # a folder brought back with its marks alone
            if problem is not None:
                logger.warning(f"[export] warning: {folder} is corrupt: {problem}; exporting it again from "
                               f"{self.train.checkpoints}")
                return False
        return True

    def closing_rows(self) -> list[tuple[str, str]]:
        """The drafter to serve first: the one the eval stage measures (eval.checkpoint: export_best/, the best
        held-out checkpoint, where training kept one, by default; else export/), then the other export, the curve
        with the metrics it is plotted from, and the loggers' folders (logger_rows)."""
        final = os.path.exists(os.path.join(self.out, "done.json")) and holds_drafter(self.out)
        best = read_json_or_none(os.path.join(self.best, "best.json")) if holds_drafter(self.best) else None
        held_out = f"step {best['step']}, held-out tau {best['tau']:.2f}" if best else ""
        rows = []
        if best and self.context.settings.eval.checkpoint == "best":
            rows.append(("drafter (z-lab format)", f"{shown(self.best)} (the best held-out checkpoint, {held_out}; "
                                                   f"what eval measures)   {serving_line(self.best)}"))
            if final:
                rows.append(("final weights", f"{shown(self.out)} (eval.checkpoint=final measures them)"))
        else:
            if final:
                rows.append(("drafter (z-lab format)", f"{shown(self.out)}   {serving_line(self.out)}"))
            if best:
                rows.append(("best held-out checkpoint", f"{shown(self.best)} ({held_out})"))
        here = shown(self.context.run_dir)
        for name, what in (("training_curve.png", "training curve"), ("metrics.jsonl", "metrics per step")):
            if os.path.exists(os.path.join(self.context.run_dir, name)):
                rows.append((what, os.path.join(here, name)))
        return rows + logger_rows(self.context.run_dir)

    def run(self) -> dict[str, Any]:
        """export/, export_best/ and the curve; done.json carries the settings of the checkpoints behind them, which
        the eval stage checks. RunFolderError when the train stage has not finished for these settings."""
        from dflash.train.final_weights import final_state_dict

        train, run_dir = self.train, self.context.run_dir
        if not stage_done(train.out, train.fingerprint()):
            raise RunFolderError(
                f"nothing to export: the train stage has not finished for these settings ({train.out}/done.json "
                f"is missing or of other settings); run it, which exports too: python -m dflash.train ... "
                f"(stages=[train])")
        config = train.drafter_config()
        export_state(final_state_dict(train.checkpoints), config, self.out, recorded_template(run_dir))
        export_best(run_dir, train.checkpoints, config)
        plot_training_curve(run_dir)
        logger.info(f"[export] drafter -> {self.out}")
        return {"checkpoint": train.checkpoint_fingerprint()}


def holds_drafter(folder: str) -> bool:
    """Whether the export folder holds its drafter's config.json, which a folder brought back with its marks alone
    (done.json, best.json) lacks."""
    return os.path.isfile(os.path.join(folder, "config.json"))


def serving_line(folder: str) -> str:
    """How to serve the export in `folder`, with what an engine must be given beside it: the chat template it was
    trained with, where it is not the target's own, and, for a drafter that mixes sliding and full layers, a vLLM
    that serves those (docs/serving.md)."""
    from dflash.models.targets.chat_template import PLAIN_ANSWER_END, PLAIN_TEMPLATES, TEMPLATE_FILE

    engines = "vLLM or SGLang"
    layer_types = set((read_json_or_none(os.path.join(folder, "config.json")) or {}).get("layer_types") or [])
    if len(layer_types) > 1:
        engines = "SGLang, or a vLLM with PR 40898 for mixed sliding and full drafter layers"
    template, given = carried_template(folder), ""
    if template is not None:
        given = f" with the chat template {shown(os.path.join(folder, TEMPLATE_FILE))}"
        if template in PLAIN_TEMPLATES:  # no end-of-turn token: the next turn's start ends an answer
            given += f" and the stop string {PLAIN_ANSWER_END!r}"
    # The long form takes a comma before what an engine must be given, so that it does not read as the vLLM's.
    if given and len(layer_types) > 1:
        given = "," + given
    return f"serve it with {engines}{given} (docs/serving.md)"


def export_state(state: dict[str, torch.Tensor], config, folder: str, chat_template: str | None) -> None:
    """A drafter state dict (any dtype) exported to `folder`, with the template it was trained with when it is
    not the target's own (recorded_template)."""
    from dflash.eval.export import export_zlab
    from dflash.models.drafter import DFlashDraftModel

    drafter = DFlashDraftModel(config)
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    export_zlab(drafter, folder, chat_template=chat_template)


def recorded_template(run_dir: str) -> str | None:
    """The chat template the run's data stage recorded (DataStage.record_template), or None: the target's own."""
    return carried_template(os.path.join(run_dir, "data"))


def carried_template(folder: str) -> str | None:
    """The chat template file `folder` holds (a data folder's record, an export's copy), or None."""
    from dflash.models.targets.chat_template import TEMPLATE_FILE

    path = os.path.join(folder, TEMPLATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def logger_rows(run_dir: str) -> list[tuple[str, str]]:
    """The training loggers' folders in `run_dir`, each with the command that shows it (its files mean nothing
    opened by hand): TensorBoard's; wandb's online run, by its page; and wandb's runs where it ran offline, one per
    start of the training (wandb resumes no offline run, so a training resumed after a stop is several; those of a
    drafter of other settings moved aside with it)."""
    from dflash.train.metrics_log import WANDB_RUN_ID, read_run_id

    rows = []
    board, folder = os.path.join(run_dir, "tensorboard"), os.path.join(run_dir, "wandb")
    if os.path.isdir(board):
        rows.append(("TensorBoard", f"tensorboard --logdir {shlex.quote(shown(board))}"))
    online = read_run_id(os.path.join(run_dir, WANDB_RUN_ID))
    if online is not None and online["mode"] == "online" and isinstance(online.get("url"), str):
        rows.append(("wandb", online["url"]))
    offline = sorted(name for name in os.listdir(folder) if name.startswith("offline-run-")) \
        if os.path.isdir(folder) else []
    if len(offline) == 1:
        rows.append(("wandb (offline)", f"wandb sync {shlex.quote(shown(os.path.join(folder, offline[0])))}"))
    elif offline:
        rows.append(("wandb (offline)", f"wandb sync {shlex.quote(shown(folder))}/offline-run-*   ({len(offline)} "
                                        f"runs, one per start of the training)"))
    return rows


def export_best(run_dir: str, checkpoints: str, config) -> dict[str, Any] | None:
    """export_best/: the checkpoint with the best held-out tau (removed when there is none); returns its best.json
    (step, tau, acceptance rate), or None. An export of this best whose files differ from its checksums.json is
    named and exported again."""
    from dflash.train.best_checkpoint import best_state_dict, read_best

    folder = os.path.join(run_dir, "export_best")
    exported = read_json_or_none(os.path.join(folder, "best.json"))  # written last: the export is whole
    if exported is not None and exported == read_best(checkpoints) and \
            carried_template(folder) == recorded_template(run_dir):
        problem = checksum_problem(folder)
        if problem is None:
            return exported  # this best checkpoint is exported already (an eval of a stopped run, rerun)
        logger.warning(f"[export] warning: {folder} is corrupt: {problem}; exporting it again from {checkpoints}")
    best = best_state_dict(checkpoints)
    if best is None:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    export_state(best[0], config, folder, recorded_template(run_dir))
    write_json(os.path.join(folder, "best.json"), best[1])
    logger.info(f"[export] best held-out checkpoint (step {best[1]['step']}, tau {best[1]['tau']:.3f}) -> {folder}")
    return best[1]


def plot_training_curve(run_dir: str) -> None:
    from dflash.train.curve_plot import plot_training_curve as plot

    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        path = plot(metrics, os.path.join(run_dir, "training_curve.png"))
        logger.info(f"[export] training curve -> {path}")
