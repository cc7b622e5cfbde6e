"""The eval stage: acceptance of the exported drafter per prompt set (dflash/eval/), in `eval/` or eval.out_dir."""

from __future__ import annotations

import logging
import os
import shlex
import shutil
from typing import Any

from omegaconf import OmegaConf

from dflash.config import fingerprints
from dflash.config.command_line import adopted_overrides, hydra_overrides, working_folder_overrides
from dflash.config.errors import ConfigError, CorruptFile, NothingToEvaluate
from dflash.config.unknown_keys import override_key
from dflash.data.journal import setting_differences
from dflash.run_files import (CHECKPOINT_KEY, SETTINGS_KEY, fingerprint, mark_done, read_json, read_json_or_none,
                              settle_swap, shown, stage_done, swap_in_dir, temp_path, write_text)
from dflash.stages.context import RunContext
from dflash.stages.data import (changed_files, changed_words, hashed_files, record_first_weights,
                                target_weights_file)
from dflash.stages.export import ExportStage, export_best, holds_drafter
from dflash.stages.prompt_files import eval_prompt_files, refuse_unreadable_prompts
from dflash.stages.stage import Stage

logger = logging.getLogger(__name__)

# What an evaluation writes in its folder besides its summary files (dflash/eval/evaluate.py, SUMMARY_FILES): its
# done marker (run_files.mark_done) and config.
DONE = "done.json"
RECORD_FILES = (DONE, "config.yaml")


# Files a training's checkpoint folder or an export holds, and no evaluation: what tells their folders from an
# evaluation's, whose done.json names a drafter as theirs do.
STAGE_FILES = {CHECKPOINT_KEY, SETTINGS_KEY, "latest", "model.safetensors", "checksums.json"}

class EvalStage(Stage):
    name = "eval"
    every_rank = False
    kept_line = "up to date (its table, measured before, follows)"
    records_own_config = True  # several evaluations of one run, each its config.yaml beside its summary
    shares_run_folder = True  # each evaluation writes its own eval.out_dir

    def __init__(self, run: RunContext, export: ExportStage) -> None:
        self.context, self.export, self.train = run, export, export.train
        self.out = run.dirs["eval"]
        self.drafter: tuple[str, str] | None = None  # (folder, fingerprint) of the drafter measured, by prepare()
        self.summary: dict[str, Any] | None = None  # what the evaluation measured (summary.json), once it ran

    def preflight(self, selected: bool) -> None:
        """Selected: every prompt set must be readable (rank 0, which alone reads them), a command that trains
        nothing needs a run folder to evaluate, eval.out_dir may hold neither another drafter's evaluation nor
        files that are no evaluation, and eval.live_engine=static needs a target family it can decode."""
        if selected and self.context.rank == 0:
            self.refuse_missing_run_folder()
            self.refuse_a_folder_of_other_files()
            self.refuse_another_drafters_evaluation()
            refuse_unreadable_prompts(eval_prompt_files(self.context.settings))
            refuse_static_engine_family(self.context.settings)

    def refuse_a_folder_of_other_files(self) -> None:
        """ConfigError when eval.out_dir is a folder of files that is no evaluation (no summary.json, no evaluation's
        done.json naming a drafter; or a file only a training or an export writes, STAGE_FILES): a run folder, a
        stage's folder (another run's checkpoints/ or export/ included) or one's own, which the evaluation would
        take over (its files carried into the evaluation's folder, a stage's done.json replaced by the
        evaluation's)."""
        out = self.out
        names = sorted(os.listdir(out)) if os.path.isdir(out) else []
        done = read_json_or_none(os.path.join(out, DONE))
        # The train and export stages' done.json name a drafter too: their own files tell their folders apart.
        evaluation = "summary.json" in names or (isinstance(done, dict) and "checkpoint" in done)
        if not names or (evaluation and not set(names) & STAGE_FILES):
            return
        held = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        beside = shlex.quote(shown(self.free_folder_beside()))
        raise ConfigError(f"eval.out_dir={shlex.quote(shown(out))} holds files that are no evaluation ({held}), which "
                          f"the evaluation would take over: give a new or empty folder, e.g. eval.out_dir={beside}")

    def refuse_another_drafters_evaluation(self) -> None:
        """ConfigError when eval.out_dir holds the evaluation of another training's drafter (its done.json names
        another checkpoint fingerprint than this run's drafter: its export's record, or before one the training this
        command runs), which this evaluation would replace: another run's evaluation folder given as this one's, or
        one deeper in this run folder, which overwrite=true left where it was. A folder right in the run folder
        travels with its drafter when overwrite=true moves it aside (eval_folders), and the drafter checks name what
        is missing; an evaluation of this run's drafter with other eval settings is replaced, as replacing_line
        says."""
        run_dir, out = os.path.realpath(self.context.run_dir), os.path.realpath(self.out)
        if os.path.dirname(out) == run_dir:
            return
        done = read_json_or_none(os.path.join(self.out, DONE))
        recorded = done.get("checkpoint") if isinstance(done, dict) else None
        exported = read_json_or_none(os.path.join(self.export.out, DONE))
        mine = exported.get("checkpoint") if isinstance(exported, dict) else None
        mine = mine or self.train.checkpoint_fingerprint()
        if recorded is None or recorded == mine:
            return
        beside = self.free_folder_beside()
        raise ConfigError(f"eval.out_dir={shlex.quote(shown(self.out))} holds the evaluation of another drafter "
                          f"(trained with settings {recorded[:12]}, this run's are {mine[:12]}), which this evaluation "
                          f"would replace: give eval.out_dir={shlex.quote(shown(beside))} (or remove that folder to "
                          f"measure this drafter there)")

    def free_folder_beside(self) -> str:
        """The first `<eval.out_dir>_<k>` that does not exist: where an evaluation goes to keep the one in out."""
        return next(f"{self.out}_{k}" for k in range(2, 10_000) if not os.path.exists(f"{self.out}_{k}"))

    def refuse_missing_run_folder(self) -> None:
        """NothingToEvaluate naming the run folder, and the runs beside it, when no stage of this command makes a
        drafter and the folder holds none: it does not exist (a misspelt name=), or its drafters were moved aside
        (checkpoints.<fingerprint>: overwrite=true) or never trained. Before the command writes its logs there."""
        run = self.context
        if set(run.settings.stages) & {"data", "capture", "train", "export"} or os.path.isdir(run.dirs["export"]) \
                or os.path.isdir(run.dirs["checkpoints"]):
            return
        # A folder holding only hydra/ (where Hydra wrote its log, in runs of earlier dflash versions) holds nothing
        # trained.
        if os.path.isdir(run.run_dir) and set(os.listdir(run.run_dir)) - {"hydra"}:
            aside = sorted(name for name in os.listdir(run.run_dir) if name.startswith("checkpoints."))
            held = (f"its drafters of other settings were moved aside ({', '.join(aside)}): the training command of "
                    f"their settings brings one back" if aside else "no drafter was trained there yet")
            command = train_command(run.settings)
            config = os.path.join(run.run_dir, "config.yaml")
            if os.path.isdir(run.dirs["data"]) and os.path.isfile(config) and \
                    not stage_done(run.dirs["data"], fingerprints.data_fingerprint(run.settings)):
                # Data made by another command (dflash.extract +experiment=...): this one's overrides would train
                # other settings there.
                command = f"python -m dflash.train and the overrides its data were made with (their settings: " \
                          f"{shown(config)})"
            raise NothingToEvaluate(f"{shown(run.run_dir)} holds no drafter to evaluate: {held}; train one with "
                                    f"{command}")
        parent = os.path.dirname(run.run_dir)
        runs = sorted(name for name in (os.listdir(parent) if os.path.isdir(parent) else [])
                      if os.path.isfile(os.path.join(parent, name, "config.yaml")))
        beside = f"runs in {shown(parent)}: {', '.join(runs)}" if runs else f"no run in {shown(parent)}"
        raise NothingToEvaluate(f"no run folder {shown(run.run_dir)} to evaluate ({beside}): name one with name=... "
                                f"or run_dir=..., or train it first with {train_command(run.settings)}")

    def describe(self) -> str:
        e = self.context.settings.eval
        drafts = f"{e.draft_sampling} drafts"
        if e.drafts_drawn_at is not None:
            drafts += f" drawn at T={e.drafts_drawn_at}"
        if e.mode == "replay" and e.temperature:
            how = f"the expected acceptance at T={e.temperature} ({drafts}, an estimate)"
        elif e.mode == "replay":
            how = "exact greedy replay"
        elif not e.temperature:
            how = "live greedy decoding"
        else:
            how = f"live sampling at T={e.temperature} ({drafts})"
        sets = ", ".join(f"{name} ({spec.limit or 'all'})" for name, spec in e.prompt_sets.items())
        return f"acceptance by {how} on {sets}, {e.max_new_tokens} new tokens per prompt"

    def drafter_dir(self) -> str:
        """export_best/ (the best held-out tau) when eval.checkpoint is 'best' and training kept one, else export/."""
        best = self.export.best
        if self.context.settings.eval.checkpoint == "best" and os.path.exists(os.path.join(best, "best.json")):
            return best
        return self.export.out

    def why_final(self, folder: str) -> str:
        """Why the final weights (export/) are measured where eval.checkpoint=best asks for the best held-out ones,
        as a parenthesis for the drafter's line; "" when the folder is what was asked for."""
        if self.context.settings.eval.checkpoint != "best" or folder != self.export.out:
            return ""
        if self.context.settings.data.heldout == 0:
            return " (the final weights: data.heldout=0 holds out no prompts to choose a best checkpoint by)"
        return " (the final weights: training kept no best held-out checkpoint)"

    def drafter_to_evaluate(self) -> tuple[str, str]:
        """(folder, fingerprint) of the drafter to measure. A run whose training stopped early (a time limit, a
        signal) has no export of its settings yet; with eval.checkpoint=best its best held-out checkpoint so far
        is exported and measured, so a stopped run can be evaluated without resuming it."""
        run = self.context
        folder, done = self.drafter_dir(), os.path.join(self.export.out, "done.json")
        current = self.train.checkpoint_fingerprint()
        marker = read_json_or_none(done)
        # A marker without the field predates it and is trusted as before.
        if marker is not None and marker.get("checkpoint", current) == current:
            return folder, marker["fingerprint"]
        owner = read_json_or_none(os.path.join(self.train.checkpoints, CHECKPOINT_KEY)) or {}
        best = None
        if run.settings.eval.checkpoint == "best" and owner.get("fingerprint") == current:
            best = export_best(run.run_dir, self.train.checkpoints, self.train.drafter_config())
        if best is None:
            raise NothingToEvaluate(
                f"no drafter of these settings to evaluate: the train and export stages have not finished ({done} is "
                f"{'missing' if marker is None else 'from other settings'}) and {self.train.checkpoints} holds no "
                f"best held-out checkpoint of these settings (data.heldout > 0 and eval.checkpoint=best make one); "
                f"rerun training ({train_command(run.settings)}), which resumes from its last checkpoint and exports")
        logger.info(f"[eval] training has not finished: evaluating its best held-out checkpoint so far "
                    f"(step {best['step']}, held-out tau {best['tau']:.3f})")
        return self.export.best, fingerprint(current, best)

    def prepare(self) -> None:
        """Settle what an evaluation killed around its swap left beside the folder (settle_swap), and pick the
        drafter to measure once: picking it may export the best checkpoint so far, and says so."""
        settle_evaluation_swap(os.path.realpath(self.out))
        self.drafter = self.drafter_to_evaluate()
        folder = self.drafter[0]
        if not holds_drafter(folder):
            best = folder == self.export.out and os.path.isfile(os.path.join(self.export.best, "best.json"))
            raise NothingToEvaluate(
                f"{shown(folder)} holds no drafter (no config.json): the export stage marked it done, but its files "
                f"are not there (a run folder copied without them); the training command exports it again where the "
                f"run's checkpoints are kept" + (", and eval.checkpoint=best measures export_best/" if best else ""))

    def measured(self) -> tuple[str, str]:
        """(folder, fingerprint) of the drafter measured: the one prepare() picked, else the one it would pick."""
        return self.drafter if self.drafter is not None else self.drafter_to_evaluate()

    def fingerprint(self) -> str:
        """Names the drafter's folder by its name in the run folder (export or export_best), so a moved or copied
        run folder keeps its evaluation."""
        folder, drafter_key = self.measured()
        return fingerprints.eval_fingerprint(self.context.settings, drafter_key, os.path.basename(folder))

    def up_to_date(self) -> bool:
        """Marked done for these settings and this drafter, with its summary, and measured on the input files as
        they are now (changed_eval_inputs): a file changed since is named, and the evaluation runs again."""
        folder, drafter_key = self.measured()
        # A marker of the older form, naming the drafter by its absolute path, counts where that folder is.
        named_by_path = fingerprints.eval_fingerprint(self.context.settings, drafter_key, folder)
        if not ((stage_done(self.out, self.fingerprint()) or stage_done(self.out, named_by_path))
                and os.path.exists(os.path.join(self.out, "summary.json"))):
            return False
        changed = changed_eval_inputs(self.context.settings, self.out)
        for change in changed:
            logger.warning(f"[eval] {changed_words(*change, 'this evaluation')}: evaluating again")
        return not changed

    def kept(self) -> None:
        """The table of the evaluation kept; one from before a target=hf checkpoint's weights were recorded records
        those seen now (record_first_weights)."""
        from dflash.eval.evaluate import format_table

        record_first_weights(os.path.join(self.out, "done.json"), self.context.settings, create=False)
        self.summary = read_json(os.path.join(self.out, "summary.json"))
        print(format_table(self.summary, timing=False))

    def run(self) -> dict[str, Any]:
        """Measure the drafter into a temporary folder beside `out` that takes its place once finished and marked
        done, so an earlier evaluation there stays whole until then (said by replacing_line). Its done.json names
        the drafter's checkpoint fingerprint, by which the evaluation folder travels with it when overwrite=true
        moves it aside (dflash/stages/train.py, eval_folders)."""
        from dflash.eval.evaluate import format_table

        inputs = eval_input_files(self.context.settings)  # hashed before they are read: an edit meanwhile shows next
        record = {"checkpoint": self.train.checkpoint_fingerprint(), "input_files": inputs}
        replacing = self.replacing_line()
        if replacing:
            logger.info(replacing)
        out = os.path.realpath(self.out)  # where `out` is a link to a folder, the link stays
        new = temp_path(out)
        try:
            self.summary = self.evaluate(self.measured()[0], new)
            carry_other_entries(out, new)
            # Marked before the swap, so the folder is done the moment it is in place; the runner then marks it
            # again with the same record.
            mark_done(new, self.fingerprint(), **record)
            swap_in_dir(new, out, aside=f"{new}.old")
        except BaseException:
            # Unmarked first: a folder half deleted by a kill must not pass for a finished evaluation (settle_swap).
            if os.path.exists(os.path.join(new, DONE)):
                os.remove(os.path.join(new, DONE))
            shutil.rmtree(new, ignore_errors=True)
            raise
        print(format_table(self.summary))
        return record

    def replacing_line(self) -> str | None:
        """The line saying that this evaluation replaces the one in `out` once it completes, with the eval settings
        that one was measured with where they differ, and how to keep both; None where `out` holds none."""
        if not os.path.exists(os.path.join(self.out, "summary.json")):
            return None
        config = os.path.join(self.out, "config.yaml")
        old = OmegaConf.to_container(OmegaConf.load(config)) if os.path.exists(config) else {}
        new = OmegaConf.to_container(self.context.cfg, resolve=True)
        recorded = old.get("eval") if isinstance(old, dict) else None  # None: its settings were not kept
        changes = [] if not isinstance(recorded, dict) else [
            change for change in setting_differences(recorded, new["eval"], "eval.")
            if not change.startswith("eval.out_dir:")]
        why = "an earlier measurement" if not changes else "measured with other eval settings: " + "; ".join(
            changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        beside = self.free_folder_beside()
        return (f"[eval] replacing {shown(self.out)} once this evaluation completes ({why}); to keep both, give "
                f"eval.out_dir={shlex.quote(shown(beside))} (Ctrl-C now leaves it as it is)")

    def closing_rows(self) -> list[tuple[str, str]]:
        if self.summary is None:
            return []
        def tau(entry: dict) -> str:
            return "-" if entry.get("tau") is None else f"{entry['tau']:.2f}"  # None: no draft step was made

        taus = ", ".join(f"{name} {tau(s)}" for name, s in self.summary.get("prompt_sets", {}).items())
        from dflash.eval.evaluate import SUMMARY_FILES

        made = [name for name in SUMMARY_FILES if os.path.exists(os.path.join(self.out, name))]
        return [("evaluation", f"{shown(self.out)}/: {', '.join(made)}"),
                ("tau", f"{taus}; overall {tau(self.summary['overall'])}")]

    def next_rows(self) -> list[tuple[str, str]]:
        """A tiny target's or a short CPU run's tau explained; after a replay on a GPU, or of a tiny target, the
        command that measures real decoding."""
        run = self.context
        if self.summary is None:
            return []
        rows = []
        if run.settings.target.kind == "tiny":
            rows.append(("", "A tiny random-weight target: its tau shows that the pipeline runs end to end, not how "
                             "good a drafter is (a random target's answers repeat themselves). A real drafter: python "
                             "-m dflash.train on a machine with a GPU (the real SmolLM2 target, about 10 minutes)."))
        elif run.device.type == "cpu" and (self.summary["overall"].get("tau") or 0.0) < 1.5:
            real = ("the same `python -m dflash.train` on a machine with a GPU (+experiment=smollm2_quick, about 10 "
                    "minutes), or the full recipe +experiment=smollm2 (about 23 minutes on one GPU, tau ~3.4, "
                    "docs/results.md)." if run.settings.target.kind == "smollm2" else
                    "this target on a machine with a GPU, with thousands of prompts and minutes of training "
                    "(data.limit, data.synthetic.count, train.max_minutes; conf/experiment/smollm2.yaml holds the "
                    "SmolLM2 recipe's values for these).")
            return [("", "This was a short CPU run: a drafter trained for minutes on a CPU accepts few tokens (tau "
                         f"near 1 is expected). A real drafter: {real}")]
        if run.settings.eval.mode == "replay":
            live = os.path.join(shown(run.run_dir), "eval_live")
            # Quoted for a shell: `[0,40]` is a glob to bash and zsh, and a path may hold spaces.
            kept = [w for w in command_overrides(run.settings) if override_key(w) not in ("eval.mode", "eval.out_dir")]
            words = [*kept, "eval.mode=live", f"eval.out_dir={live}"]
            rows.append(("next: real decoding", "python -m dflash.eval " + " ".join(shlex.quote(w) for w in words)))
        return rows

    def evaluate(self, folder: str, out: str) -> dict[str, Any]:
        """Measure the drafter in `folder`; summary.json, the plots and this evaluation's config.yaml in `out`."""
        from dflash.eval.evaluate import (TURN2_SUFFIX, check_compatible, evaluate, first_turn_answer_tokens,
                                          live_engine_of, load_prompt_sets, write_summary)
        from dflash.eval.export import load_drafter
        from dflash.eval.metrics import PhaseTimer

        run, e = self.context, self.context.settings.eval
        os.makedirs(out, exist_ok=True)
        logger.info(f"[eval] drafter {folder}{self.why_final(folder)}")
        target = run.target
        try:
            drafter = load_drafter(folder, dtype=target.dtype, device=str(run.device))
        except CorruptFile as error:
            raise CorruptFile(f"{error}; the export stage exports it again from the checkpoints: rerun training with "
                              f"the same settings (python -m dflash.train ...), which exports") from None
        # Both before the target answers the prompt sets (MT-Bench's first turns).
        check_compatible(drafter, target)
        if e.mode == "live" and e.compile_drafter:
            from dflash.train.compile_layers import compile_layers

            # A live drafting step of a drafter this small is bound by its kernel count (docs/benchmarks.md).
            compile_layers(drafter)
        live_engine = live_engine_of(e.live_engine, target) if e.mode == "live" else e.live_engine
        template_kwargs = dict(e.chat_template_kwargs)
        timer = PhaseTimer(target.device)  # summary["timing"]: where the eval's minutes go
        prompt_sets, categories, prompt_ids = load_prompt_sets(
            target, e.prompt_sets, max_new_tokens=e.max_new_tokens, template_kwargs=template_kwargs,
            batch_size=e.batch_size, timer=timer)
        summary = evaluate(drafter, target, prompt_sets, max_new_tokens=e.max_new_tokens,
                           show_progress=run.show_progress, mode=e.mode, temperature=e.temperature, seed=e.seed,
                           measure_target=e.measure_target, categories=categories, batch_size=e.batch_size,
                           timer=timer, live_engine=live_engine, draft_sampling=e.draft_sampling,
                           draft_temperature=e.draft_temperature, prompt_ids=prompt_ids)
        summary["chat_template_kwargs"] = template_kwargs
        answers = {name + TURN2_SUFFIX: first_turn_answer_tokens(spec, e.max_new_tokens)
                   for name, spec in e.prompt_sets.items() if spec.turns == 2}
        if answers:  # the first turn's answer each second-turn set is asked on top of: its tokens at most
            summary["first_turn_answer_max_new_tokens"] = answers
        if e.mode == "live" and e.compile_drafter:
            summary["compile_drafter"] = True  # what its step cost was measured with
        write_summary(summary, out)
        write_text(os.path.join(out, "config.yaml"), run.config_yaml())
        return summary


def carry_other_entries(out: str, new: str) -> None:
    """Copy into the finished evaluation `new` what the folder `out` it replaces holds beside an evaluation's own
    files (a user's notes, a plot of their own): the swap replaces the folder whole. Copies, so that an evaluation
    stopped before its swap leaves `out` as it was."""
    from dflash.eval.evaluate import SUMMARY_FILES

    ours = {*SUMMARY_FILES, *RECORD_FILES}
    for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        # An evaluation's own file, or its temporary copy (run_files.temp_path) left by a writer killed meanwhile.
        if name in ours or name.lstrip(".").split(".tmp-")[0] in ours:
            continue
        source, copy = os.path.join(out, name), os.path.join(new, name)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, copy, symlinks=True)
        elif os.path.islink(source) or os.path.isfile(source):  # not a pipe or a socket, which a copy would hang on
            shutil.copy2(source, copy, follow_symlinks=False)


def settle_evaluation_swap(out: str) -> None:
    """After an evaluation killed around its swap (EvalStage.run, run_files.swap_in_dir): where `out` is missing, the
    finished evaluation (marked done) takes its place, else the one set aside comes back; what is left beside `out`
    under its temporary names (temp_path's `.<name>.tmp-<pid>`, and `.old` for the one set aside) goes."""
    settle_swap(out, lambda path: all(os.path.isfile(os.path.join(path, file))
                                      for file in (DONE, "summary.json")))


def eval_input_files(settings) -> dict[str, dict[str, str]]:
    """The files whose contents decide an evaluation beyond its settings (RunSettings): {key: {"path", "sha256"}}
    for each prompt set's file (eval.prompt_sets.NAME.path) and target.chat_template, each when set, and a
    target=hf checkpoint's weights (target.path, its checkpoint_digest: the target the drafter is measured with)."""
    named = {f"eval.prompt_sets.{name}.path": spec.path for name, spec in settings.eval.prompt_sets.items()}
    return {**hashed_files({**named, "target.chat_template": settings.target.chat_template}),
            **target_weights_file(settings)}


def changed_eval_inputs(settings, eval_dir: str) -> list[tuple[str, str, str, str]]:
    """(key, path, recorded sha256 or 'none', sha256 now) of each input file (eval_input_files) whose contents differ
    from those the evaluation's done.json in `eval_dir` recorded, or that it did not record (a target=hf
    checkpoint's weights excepted: an evaluation from before they were recorded records those seen when it is kept);
    none when it recorded none (an evaluation from before the record, trusted as it is)."""
    recorded = (read_json_or_none(os.path.join(eval_dir, "done.json")) or {}).get("input_files")
    now = eval_input_files(settings)
    if isinstance(recorded, dict) and "target.path" not in recorded:
        now.pop("target.path", None)
    return changed_files(recorded, now, unrecorded_changed=True)


def refuse_static_engine_family(settings) -> None:
    """ConfigError in one line when eval.live_engine=static names a target whose family the static engines do not
    decode (a GDN hybrid such as Qwen3.5), known from its config without loading weights. Other reasons the engine
    refuses a target (its placement, its RoPE) are found once the target is loaded, before any prompt is answered."""
    from dflash.models.targets.layout import FAMILIES

    e = settings.eval
    if e.mode != "live" or e.live_engine != "static":
        return
    model_type = target_model_type(settings.target)
    if model_type is not None and model_type not in FAMILIES:
        raise ConfigError(f"eval.live_engine=static: the static engine cannot decode this target, of model_type "
                          f"{model_type!r} (it decodes {', '.join(FAMILIES)}); use eval.live_engine=auto or hf")


def target_model_type(target) -> str | None:
    """The model_type of the model the target settings load, from its config alone (no weights); None for the
    smollm2 GGUF (a llama) and an unknown tiny family (which loading names)."""
    if target.kind == "tiny":
        import transformers

        from dflash.models.targets.tiny import TINY_FAMILIES

        family = TINY_FAMILIES.get(target.tiny["family"])
        return None if family is None else getattr(transformers, family[0]).model_type
    if target.kind != "hf":
        return None
    import torch

    from dflash.models.targets.placement import empty_model
    from dflash.models.targets.preflight import checkpoint_config

    # The model AutoModelForCausalLM builds, as loading does, on the meta device: a multimodal checkpoint's config
    # may name another model_type than the model loaded from it.
    return empty_model(checkpoint_config(str(target.path), target.cache_dir), torch.bfloat16).config.model_type


def command_overrides(settings, without_eval: bool = False, with_adopted: bool = False) -> list[str]:
    """The overrides of the command that is running (Hydra's record), less `stages` and `overwrite` (a command
    suggested next must never move a drafter aside), less those an evaluation adopted from the run folder's
    training command unless `with_adopted` (the next evaluation adopts them again; a training command needs them),
    and with `without_eval` the eval group's; `name=...` outside Hydra."""
    overrides = hydra_overrides(settings)
    if overrides is None:
        return [f"name={settings.name}"]
    kept, adopted = [], [] if with_adopted else adopted_overrides()
    for override in overrides:
        key = override_key(override)
        if key in ("stages", "overwrite") or override in adopted:
            continue
        if not (without_eval and (key == "eval" or key.startswith("eval."))):
            kept.append(override)
    return kept + working_folder_overrides()


def train_command(settings) -> str:
    """The training command of this command's settings, quoted for a shell: an evaluation's suggests the overrides it
    adopted from the run folder's training command too (without them that training is refused there)."""
    return " ".join(["python -m dflash.train", *(shlex.quote(w) for w in command_overrides(settings, True, True))])
