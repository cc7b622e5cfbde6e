"""A trained run is never lost: a run folder that holds a drafter trained under other data, capture or train
settings refuses a command of these settings before any work, unless it says overwrite=true (the data or train
stage then moves that drafter aside, never deletes it); so does a command whose data stage would rebuild the
drafter's data: an input file changed since the run's data stage, or evaluation sets its overlap check has not
covered. Other eval settings evaluate the same drafter and are fine."""

from __future__ import annotations

import os
import shlex

from omegaconf import OmegaConf, open_dict

from dflash.config import fingerprints
from dflash.config.errors import RunFolderError, as_typed
from dflash.run_files import CHECKPOINT_KEY, read_json_or_none
from dflash.stages.batch_split import counted_ranks, fingerprinted, keeping_batch, recorded_split, settings_record
from dflash.stages.context import RunContext
from dflash.stages.data import changed_input_files, changed_words
from dflash.stages.train import TrainStage


def trained_keys(train: TrainStage) -> tuple[str, str | None] | None:
    """(checkpoint fingerprint, settings fingerprint or None when not recorded) of the drafter trained in the run
    folder (its train or export done marker's, else its checkpoints'), or None when nothing was trained there."""
    from dflash.train.best_checkpoint import read_best
    from dflash.train.checkpoints import complete_tags

    marker = read_json_or_none(os.path.join(train.checkpoints, CHECKPOINT_KEY))
    checkpoints = marker.get("fingerprint") if isinstance(marker, dict) else "unfingerprinted"
    settings = settings_record(train.checkpoints).get("fingerprint")
    # export/done.json alone: a run folder where training and export were one stage, whose marker it held.
    for folder in (train.out, train.context.dirs["export"]):
        done = read_json_or_none(os.path.join(folder, "done.json"))
        if isinstance(done, dict) and "checkpoint" in done:
            return done["checkpoint"], settings if done["checkpoint"] == checkpoints else None
    if not complete_tags(train.checkpoints) and read_best(train.checkpoints) is None:
        return None
    return checkpoints, settings


def refuse_other_trained_settings(train: TrainStage) -> None:
    """RunFolderError (one line naming what changed and the ways on) when the run folder's trained drafter is of
    other data, capture or train settings than this command's, or when this command's data stage would read an
    input file (data.path, target.chat_template) whose contents changed since the run's data stage."""
    run = train.context
    trained = trained_keys(train)
    if run.settings.overwrite or trained is None:
        return
    # The settings alone when recorded: the data stage may not have (re)made its files yet.
    if not (trained[1] == train.settings_fingerprint() or
            trained[1] is None and trained[0] == train.checkpoint_fingerprint()):
        config, changes = trained_config(train)
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        shown = (shown or (f"see {config}" if config else "its config.yaml was not kept")) + split_note(train)
        if not set(run.settings.stages) & {"data", "capture", "train"}:
            # overwrite=true cannot help a command that trains nothing: it needs the drafter's own settings.
            raise RunFolderError(
                f"{run.run_dir} holds a drafter trained with other settings than this command's "
                f"({shown}); nothing was changed. This command trains nothing: give it the overrides the drafter "
                f"was trained with{f' (its settings: {config})' if config else ''}, e.g. the +experiment= of its "
                f"training command")
        raise RunFolderError(f"{run.run_dir} holds a drafter trained with other settings ({shown}); nothing was "
                             f"changed. {ways_on(train, 'train these settings')}")
    if "data" in run.settings.stages:
        refuse_rebuilt_data(train)


def split_note(train: TrainStage) -> str:
    """For a refusal of a launch whose global batch (micro_batch_size x ranks x grad_accum) is not the run folder's
    training's: that global batch, and the split of this launch's ranks that resumes it (batch_split.py)."""
    recorded = recorded_split(train.checkpoints)
    if recorded is None:
        return ""
    t, ranks = train.context.settings.train, counted_ranks(train.context.settings, train.context.world_size,
                                                           recorded)
    if t.micro_batch_size * ranks * t.grad_accum == recorded.global_batch:
        return ""
    keeping = keeping_batch(recorded.global_batch, t.micro_batch_size, ranks, t.grad_accum)
    return (f"; its global batch of {recorded.global_batch} sequences, split otherwise, is the same training"
            f"{f': {keeping} splits it on {ranks} rank(s)' if keeping else ''}")


def refuse_rebuilt_data(train: TrainStage) -> None:
    """RunFolderError when this command's data stage would rebuild the data of the run folder's trained drafter,
    its settings unchanged: an input file (data.path, target.chat_template) changed since, or evaluation sets its
    overlap check has not covered (DataStage.unchecked_eval_sets)."""
    run = train.context
    changed = changed_input_files(run.settings, run.dirs["data"])
    if changed:
        what = "the checkpoint" if changed[0][0] == "target.path" else "the file"
        since = "this run's data stage"
        raise RunFolderError(
            f"{changed_words(*changed[0], since)}, whose data trained the drafter in {run.run_dir}; nothing was "
            f"changed. {ways_on(train, f'train on {what} as it is now', data_kept=False)}")
    unchecked = train.capture.data.unchecked_eval_sets()
    if unchecked:
        sets = ", ".join(unchecked)
        raise RunFolderError(
            f"the training prompts of the drafter in {run.run_dir} were not checked for overlap with eval.prompt_sets "
            f"{sets} (added, or reading another source or file, since its data stage): this command's data stage "
            f"would check them and drop the training prompts that overlap, replacing the drafter's data if any do "
            f"(a training of these settings then trains it again); nothing was changed. To evaluate this drafter on "
            f"them as it was trained (its training prompts unchecked against them), run python -m dflash.eval with "
            f"the same overrides. {ways_on(train, 'train on the checked prompts', data_kept=False)}")


def trained_config(train: TrainStage) -> tuple[str | None, list[str]]:
    """(the config.yaml of the run folder's trained drafter, `key: trained -> now` of each data, capture or train
    setting of this command that differs from it, else each setting whose value there an older dflash fingerprinted
    and this one holds at a stand-in); (None, no changes: unknown) when no config.yaml was kept."""
    run = train.context
    for path in (os.path.join(train.checkpoints, "config.yaml"), os.path.join(run.run_dir, "config.yaml")):
        if os.path.exists(path):
            old = OmegaConf.to_container(OmegaConf.load(path))
            if not isinstance(old, dict):
                return path, []
            recorded, settings = recorded_split(train.checkpoints), run.settings
            if recorded is not None and isinstance(old.get("train"), dict):
                # Compared with the split the drafter is fingerprinted with, which a later launch of another split
                # of its global batch did not change (batch_split.py), not with that launch's; a split of the same
                # global batch here is no change either.
                old["train"].update(micro_batch_size=recorded.micro_batch_size, grad_accum=recorded.grad_accum)
                settings = fingerprinted(settings, recorded, counted_ranks(settings, run.world_size, recorded))
            changes = fingerprints.training_changes(old, settings)
            return path, ([with_chosen_taps(c, old, train) for c in changes]
                          or fingerprints.stand_in_changes(old, run.settings))
    return None, []


def with_chosen_taps(change: str, old: dict, train: TrainStage) -> str:
    """`change` with the taps an automatic `drafter.target_layer_ids` (null) chose for the trained drafter, where it
    is that setting's change and they were recorded: by its training (checkpoints/settings.json), else by its
    features (CaptureStage.layer_ids, in the capture mode it was trained with; a recapture since may have changed
    them)."""
    prefix = "drafter.target_layer_ids: null -> "
    if not change.startswith(prefix):
        return change
    taps = settings_record(train.checkpoints).get("target_layer_ids")
    if not isinstance(taps, list):
        taps = train.capture.layer_ids(fingerprints.recorded_value(old, "capture.mode", None))
    return change if taps is None else \
        f"drafter.target_layer_ids: null (automatic: {as_typed(taps)}) -> {change[len(prefix):]}"


def ways_on(train: TrainStage, doing: str, data_kept: bool = True) -> str:
    """The two ways on, for a refused command that would do `doing`: another run folder, or overwrite=true; and,
    where the folder's data and features are this command's already and it keeps them (`data_kept`: not where its
    data stage makes them again), that only the second keeps them."""
    ways = (f"To {doing} beside it, run the same command with {another_run_folder(train.context)}; to move the "
            f"trained drafter aside (kept in {train.checkpoints}.<its fingerprint>) and {doing} in its place, add "
            f"overwrite=true")
    if data_kept and train.capture.data.done() and train.capture.done():
        ways += (" (which keeps this folder's data and features, the same for these settings; a new folder makes "
                 "them again)")
    return ways


def another_run_folder(run: RunContext) -> str:
    """The override that gives the same command a run folder of its own that does not exist yet: name=<name>-<k>
    where the run folder follows the name (run_dir's default, runs/${name}), else run_dir=<its parent>/<its
    name>-<k> (a run_dir given outright, which name= does not move)."""
    for k in range(2, 10_000):
        named = run.cfg.copy()
        with open_dict(named):
            named.name = f"{run.settings.name}-{k}"
        folder = os.path.abspath(str(named.run_dir))
        if folder == run.run_dir:
            break
        if not os.path.exists(folder):
            return f"name={named.name}"
    parent, name = os.path.split(run.run_dir)
    free = next(f"{name}-{k}" for k in range(2, 10_000) if not os.path.exists(os.path.join(parent, f"{name}-{k}")))
    return "run_dir=" + shlex.quote(os.path.join(parent, free))
