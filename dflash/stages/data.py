"""The data stage: prompts -> the target's chat template -> answers the target writes -> a token dataset with an
answer-only loss mask (dflash/data/), in `data/`."""

from __future__ import annotations

import logging
import os
import textwrap
import time
from collections.abc import Callable
from typing import Any

from dflash.config import ConfigError, fingerprints
from dflash.run_files import clear_done, file_sha256, read_json_or_none, stage_done, write_json, write_text
from dflash.stages.context import RunContext
from dflash.stages.prompt_files import eval_prompt_files, read_prompt_file, refuse_unreadable_prompts
from dflash.stages.shapes import check_drafter_fits
from dflash.stages.stage import Stage

logger = logging.getLogger(__name__)


def timed(seconds: dict[str, float], name: str, work: Callable[[], Any]) -> Any:
    """work(), its wall seconds recorded in seconds[name]."""
    started = time.perf_counter()
    result = work()
    seconds[name] = round(time.perf_counter() - started, 3)
    return result


# stats.json's mark of a build that recorded its chat template (DataStage.record_template), or that it needs none.
TEMPLATE_RECORDED = "chat_template_recorded"
# The target=hf weights first seen beside data made before the weights were recorded (DataStage.note_first_weights).
FIRST_WEIGHTS = "first_weights.json"


def training_prompts(data) -> list:
    """The source's training prompts for group `data` (DataSettings). data.turns applies to ShareGPT only; for any
    other source it is ignored, as the composed config's warning says."""
    from dflash.data.prompts import load_prompts

    turns = data.turns if data.source == "sharegpt" else "first"
    return load_prompts(data.source, path=data.path, limit=data.limit, seed=data.seed, turns=turns)


class DataStage(Stage):
    name = "data"
    made = "built"
    every_rank = False  # rank 0 writes the dataset; the other ranks read it after the next barrier
    barrier_after = False  # the ranks meet after the capture stage (or before it, when every rank captures)

    def __init__(self, run: RunContext) -> None:
        self.context = run
        self.out = run.dirs["data"]
        self.file_prompts: int | None = None  # how many prompts a user's file gave the preflight, which read it

    def fingerprint(self) -> str:
        return fingerprints.data_fingerprint(self.context.settings)

    def up_to_date(self) -> bool:
        """Marked done for these settings, built from the input files as they are now (changed_input_files), and
        (with the overlap check on) checked against every evaluation set eval.prompt_sets names now. A file changed
        or a set added since is named, and the stage runs again: the answers of unchanged prompts come from its
        journal, and the dataset changes only if its prompts did (then so does what follows)."""
        if not stage_done(self.out, self.fingerprint()):
            return False
        changed = changed_input_files(self.context.settings, self.out)
        for change in changed:
            reuse = "the answers are written again by these weights (the earlier ones' journals are moved aside)" \
                if change[0] == "target.path" else "the answers of unchanged prompts come from the journal"
            logger.warning(f"[data] {changed_words(*change, 'the dataset was built')}: building it again, {reuse}")
        unchecked = self.unchecked_eval_sets()
        if unchecked:
            logger.warning(f"[data] the training prompts were not checked for overlap with {', '.join(unchecked)} "
                           f"(added to eval.prompt_sets, or reading another source, since): checking them, the "
                           f"answers come from the journal")
        return not changed and not unchecked

    def done(self) -> bool:
        """Built for these settings: marked done, or built with prompts that failed to answer (its stats.json
        "built_for" these settings beside the dataset, no done marker: the stages after it go on without those
        prompts, and a rerun of this stage retries them)."""
        stats = read_json_or_none(os.path.join(self.out, "stats.json")) or {}
        return super().done() or (stats.get("built_for") == self.fingerprint()
                                  and os.path.isdir(os.path.join(self.out, "dataset")))

    def current(self) -> bool:
        """up_to_date without its warnings."""
        return stage_done(self.out, self.fingerprint()) and \
            not changed_input_files(self.context.settings, self.out) and not self.unchecked_eval_sets()

    def unchecked_eval_sets(self) -> list[str]:
        """The evaluation sets the finished build's overlap check did not cover (its stats.json eval_overlap): a
        name it did not check, or one whose source or file is another now; none when the check is off or the build
        predates it (a build before the sources were recorded is compared by name)."""
        settings = self.context.settings
        if not settings.data.eval_overlap_ngram:
            return []
        report = (read_json_or_none(os.path.join(self.out, "stats.json")) or {}).get("eval_overlap")
        if not isinstance(report, dict):
            return []
        checked = report.get("eval_set_sources")
        if not isinstance(checked, dict):
            return sorted(set(settings.eval.prompt_sets) - set(report.get("eval_sets", {})))
        return sorted(name for name, spec in settings.eval.prompt_sets.items()
                      if checked.get(name) != eval_set_source(spec))

    def preflight(self, selected: bool) -> None:
        """When it will run (selected, not up to date): its prompts and, for the overlap check, every evaluation
        prompt set must be readable. Rank 0 alone reads prompts; a launcher ends the other ranks when it stops."""
        s = self.context.settings
        if self.context.rank != 0 or not selected or self.current():
            return
        files = [("data", s.data.source, s.data.path)]
        if s.data.eval_overlap_ngram:
            files += eval_prompt_files(s)
        refuse_unreadable_prompts(files)
        if s.data.path:  # a user's file: a malformed line is found before the run folder is made
            # The stage reads it again, after hashing it.
            self.file_prompts = len(read_prompt_file("data", s.data.source, lambda: training_prompts(s.data)))
        if s.data.heldout and s.data.limit is None:  # with a limit, the schema checked it
            count = self.file_prompts if self.file_prompts is not None else len(training_prompts(s.data))
            most = count + s.data.synthetic.count
            if s.data.heldout >= most:
                raise ConfigError(f"data.heldout={s.data.heldout}: expected fewer than the {most} prompts the data "
                                  f"stage can answer ({count} from data.source={s.data.source}"
                                  f"{', data.path' if s.data.path else ''}, {s.data.synthetic.count} synthetic): "
                                  f"holding them all out leaves nothing to train on")

    def describe(self) -> str:
        s = self.context.settings
        d, kind = s.data, s.target.kind
        prompts = f"{d.limit} {d.source} prompts" if d.limit else f"every {d.source} prompt"
        if self.file_prompts is not None:
            prompts = f"{self.file_prompts} {'' if d.source == 'file' else d.source + ' '}prompts of {d.path}"
        if d.synthetic.count:
            prompts += f" and {d.synthetic.count} the target writes itself"
        answers = "greedily" if d.temperature == 0 else f"sampled at T={d.temperature}"
        if d.temperature and d.sampled_share < 1:
            answers = f"{d.sampled_share:.0%} sampled at T={d.temperature}, the others greedily,"
        return f"{prompts}, answered {answers} by the {kind} target (up to {d.max_new_tokens} new tokens)"

    def target_identity(self) -> dict[str, Any]:
        """The target's settings, and the weights of a checkpoint of one's own (target_weights): what the journals
        and the dataset's fingerprint record, so answers other weights wrote are moved aside, not reused. Data made
        before the weights were recorded is trusted as it is while the weights are those first seen beside it
        (FIRST_WEIGHTS, note_first_weights): its journals and fingerprint stay as they were made, without them;
        other weights there are told apart from them (and those first seen, coming back, find their data again)."""
        identity = fingerprints.target_identity(self.context.settings)
        weights = target_weights(self.context.settings)
        if weights is None:
            return identity
        first = read_json_or_none(os.path.join(self.out, FIRST_WEIGHTS))
        if isinstance(first, dict) and first.get("sha256") == weights:
            return identity
        return {**identity, "weights": weights}

    def note_first_weights(self) -> None:
        """FIRST_WEIGHTS, once, in a data folder made before the weights were recorded (a build, or a journal of
        one killed midway, whose target names none): the weights seen now, taken for those that made it. Kept
        whatever the stage does next (a kill inside a rebuild's swap included), so the folder stays trusted."""
        weights = target_weights(self.context.settings)
        path = os.path.join(self.out, FIRST_WEIGHTS)
        if weights is None or os.path.exists(path):
            return
        from dflash.data.journal import journal_header

        stats = read_json_or_none(os.path.join(self.out, "stats.json"))
        made = [stats.get("settings", {}).get("target") if isinstance(stats, dict) else None]
        made += [(journal_header(os.path.join(self.out, name)) or {}).get("target")
                 for name in ("journal.jsonl", "synthetic.jsonl")]
        if any(isinstance(target, dict) and "weights" not in target for target in made):
            write_json(path, {"sha256": weights, "path": self.context.settings.target.path})

    def run(self) -> dict[str, Any] | None:
        """The dataset; its stats for done.json, or None while some prompts failed."""
        from dflash.data.dataset import build_dataset, format_stats

        run, d, out = self.context, self.context.settings.data, self.out
        os.makedirs(out, exist_ok=True)
        self.note_first_weights()  # before anything of this run is written (a kill then keeps the folder trusted)
        inputs = input_files(run.settings)  # hashed before they are read: an edit made during the run shows next time
        seconds: dict[str, float] = {}  # where the stage's time goes before the answers (stats.json "before_answers")
        prompts = timed(seconds, "prompts", lambda: training_prompts(d))
        # The target loads here unless an earlier stage of this process loaded it (a GGUF converts once per cache).
        timed(seconds, "target", lambda: run.target)
        # Before minutes of answers: taps or a hidden size this target does not have stop the run at capture.
        check_drafter_fits(run.settings.drafter, run.target.num_layers, run.target.hidden_size)
        synthetic = None
        if d.synthetic.count > 0:
            written, synthetic = timed(seconds, "synthetic", self.synthetic_prompts)
            prompts = prompts + written
        prompts, overlap = timed(seconds, "overlap", lambda: self.drop_eval_overlaps(prompts))
        # The answers' settings as they take effect, a setting that changes no answer at its stand-in (top_p of
        # greedy answers, the temperature when no answer is sampled): the dataset's fingerprint and the journal's
        # header are then those of the same data made without it, as the stage's own fingerprint is.
        answers = fingerprints.in_effect(run.settings).data
        stats = build_dataset(prompts, run.target, out, max_length=d.max_length, max_new_tokens=d.max_new_tokens,
                              batch_size=d.batch_size, temperature=answers.temperature, top_p=answers.top_p,
                              seed=d.seed, show_progress=run.show_progress, heldout=d.heldout, engine=d.engine,
                              compile_step=d.compile_step, refill=d.refill, decode_attention=d.decode_attention,
                              target=self.target_identity(),
                              before_replace=self.before_replace,
                              template_kwargs=dict(d.chat_template_kwargs), sampled_share=answers.sampled_share,
                              as_given={"temperature": d.temperature, "top_p": d.top_p,
                                        "sampled_share": d.sampled_share})
        # What the synthetic draws and the overlap check found, and the time before the answers, go with the
        # dataset's stats (format_stats shows them).
        stats.update({key: value for key, value in (("synthetic", synthetic), ("eval_overlap", overlap))
                      if value is not None}, before_answers=seconds, input_files=inputs)
        if stats["failed"]:  # built for these settings though not marked done (done())
            stats["built_for"] = self.fingerprint()
        stats[TEMPLATE_RECORDED] = True
        write_json(os.path.join(out, "stats.json"), stats)
        self.record_template(run.target.tokenizer)
        logger.info(textwrap.indent(format_stats(stats), "[data] "))
        if stats["failed"]:
            # Not marked done: the next run of this stage retries them (the rest comes from the journal).
            logger.info(f"[data] {stats['failed']} prompt(s) failed (errors above and in stats.json); the stages go on "
                        "without them, and running the data stage again retries them")
            return None
        return {"stats": stats}

    def kept(self) -> None:
        """A build from before the weights of a target=hf checkpoint were recorded records those seen now (its
        stats.json's input_files), and one from before the template was recorded (its stats.json says so) gets
        data/chat_template.jinja now, from the target's tokenizer alone (no weights are read), so that its exports
        carry it (ExportStage)."""
        from dflash.models.targets.load import load_target_vocabulary

        self.note_first_weights()
        path = os.path.join(self.out, "stats.json")
        stats = record_first_weights(path, self.context.settings, create=True)
        if stats is None or stats.get(TEMPLATE_RECORDED):
            return
        t = self.context.settings.target
        vocabulary = load_target_vocabulary(t.kind, path=t.path, tiny=t.tiny, cache_dir=t.cache_dir,
                                            chat_template=t.chat_template)
        self.record_template(vocabulary.tokenizer)
        write_json(path, {**stats, TEMPLATE_RECORDED: True})

    def record_template(self, tokenizer) -> None:
        """data/chat_template.jinja: the template `tokenizer` renders the prompts with, where a serving engine would
        not use it by itself (a template file, a base model's plain format); the exports take it along."""
        from dflash.models.targets.chat_template import TEMPLATE_FILE, template_to_record

        template = template_to_record(tokenizer, self.context.settings.target.chat_template)
        path = os.path.join(self.out, TEMPLATE_FILE)
        if template is not None:
            write_text(path, template)
        elif os.path.exists(path):
            os.remove(path)

    def before_replace(self) -> None:
        """Right before a new dataset replaces the finished one: its done marker goes, and with overwrite=true the
        drafter trained in the run folder is moved aside (set_drafter_aside), as the train stage moves one of other
        settings. Its fingerprint follows data/: left beside other data, it would be no drafter of its own settings
        until data/ is rebuilt for them, and the next training of them would replace it."""
        clear_done(self.out)
        # Without overwrite=true the run-folder guard let only the drafter's own settings through: the train stage
        # decides whether it still fits the data rebuilt for them (failed prompts answered on a rerun).
        if self.context.settings.overwrite:
            from dflash.stages.train import set_drafter_aside  # imported here: train.py imports this module

            moved = set_drafter_aside(self.context)
            if moved:
                logger.info(f"[data] the drafter trained on the data replaced now moved aside to {moved} "
                            f"(overwrite=true); the training command of its settings brings it back")

    def synthetic_prompts(self) -> tuple[list, dict]:
        """data.synthetic: prompts the target writes itself (dflash/data/synthetic.py), journaled in the data folder,
        and the draws' stats."""
        from dflash.data.synthetic import format_synthetic, synthesize_prompts

        run, d = self.context, self.context.settings.data
        s = d.synthetic
        prompts, stats = synthesize_prompts(
            run.target, s.count, list(s.system_prompts), os.path.join(self.out, "synthetic.jsonl"),
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, min_chars=s.min_chars,
            max_oversample=s.max_oversample, keep_system=s.keep_system, batch_size=d.batch_size, seed=d.seed,
            engine=d.engine, decode_attention=d.decode_attention, show_progress=run.show_progress,
            target=self.target_identity())
        logger.info(f"[data] synthetic prompts: {format_synthetic(stats)}")
        return prompts, stats

    def drop_eval_overlaps(self, prompts: list) -> tuple[list, dict | None]:
        """data.eval_overlap_ngram > 0: the training prompts (the target-written ones included) that share no word
        n-gram with an evaluation prompt (dflash/data/eval_overlap.py), and what was dropped; else (prompts, None).
        The evaluation prompts: every prompt of the sets eval.prompt_sets names, not only the evaluated subset."""
        from dflash.data.eval_overlap import EvalIndex, drop_eval_overlaps
        from dflash.data.prompts import load_prompts

        settings = self.context.settings
        n = settings.data.eval_overlap_ngram
        if not n:
            return prompts, None
        specs = settings.eval.prompt_sets
        # As evaluate reads them: first turns (a turns=2 set's second turn is in follow_ups), not data.turns,
        # which picks the training prompts' turns.
        eval_prompts = [p for name, spec in specs.items()
                        for p in load_prompts(spec.source, path=spec.path, name=name, turns="first")]
        kept, report = drop_eval_overlaps(prompts, EvalIndex(eval_prompts, n))
        if prompts and not kept:
            # Training on an evaluation set's own prompts (data.source=gsm8k: the package ships its test split).
            given = f"data.path={settings.data.path}" if settings.data.path else f"data.source={settings.data.source}"
            raise ConfigError(f"{given}: all {len(prompts)} training prompts share a "
                              f"{n}-word run with an evaluation prompt of eval.prompt_sets and were dropped "
                              f"(data.eval_overlap_ngram={n}): train on another source, or set "
                              f"data.eval_overlap_ngram=0 to keep them")
        held = settings.data.heldout
        if held and held >= len(kept):  # found here, before any answer (preflight counted them before the drop)
            raise ConfigError(f"data.heldout={held}: expected fewer than the {len(kept)} training prompts the "
                              f"overlap check kept ({len(prompts) - len(kept)} of {len(prompts)} dropped for sharing "
                              f"{n} words in a row with an evaluation prompt): holding them all out leaves nothing "
                              f"to train on")
        report["eval_sets"] = {name: sum(p.prompt_set == name for p in eval_prompts) for name in specs}
        report["eval_set_sources"] = {name: eval_set_source(spec) for name, spec in specs.items()}
        return kept, report


def eval_set_source(spec) -> dict[str, Any]:
    """What an evaluation prompt set's overlap check read (PromptSetSettings): its source, and the sha256 of the
    file its path names (a packaged set without one is named by its source alone)."""
    path = os.path.expanduser(spec.path) if spec.path else None  # as the set is read: `~/set.jsonl` too
    return {"source": spec.source, "sha256": file_sha256(path) if path and os.path.isfile(path) else None}


def input_files(settings) -> dict[str, dict[str, str]]:
    """The files whose contents decide the dataset beyond the settings (RunSettings): {key: {"path", "sha256"}} for
    data.path and target.chat_template, each when set, and for a checkpoint of one's own (target=hf) target.path,
    whose "sha256" is its checkpoint_digest (the weights that wrote the answers)."""
    return {**hashed_files({"data.path": settings.data.path, "target.chat_template": settings.target.chat_template}),
            **target_weights_file(settings)}


def target_weights_file(settings) -> dict[str, dict[str, str]]:
    """{"target.path": {"path", "sha256": its target_weights}} for a target=hf checkpoint; {} for other targets."""
    weights = target_weights(settings)
    return {} if weights is None else {"target.path": {"path": settings.target.path, "sha256": weights}}


def record_first_weights(path: str, settings, *, create: bool) -> dict | None:
    """The JSON record at `path` (data/stats.json, eval/done.json), where it records no target=hf checkpoint's
    weights in its input_files (made before they were recorded), with the weights seen now added: taken for those
    that made it, so that weights trained into the folder later are told apart. create: also into a record without
    input_files (where an unrecorded file counts as unchanged; not an evaluation's, where it counts as changed).
    None without a record."""
    record = read_json_or_none(path)
    weights = target_weights_file(settings)
    files = record.get("input_files") if isinstance(record, dict) else None
    if weights and (isinstance(files, dict) or (create and isinstance(record, dict) and files is None)) \
            and "target.path" not in (files or {}):
        record = {**record, "input_files": {**(files or {}), **weights}}
        write_json(path, record)
    return record


def target_weights(settings) -> str | None:
    """The checkpoint_digest of a target=hf checkpoint (None for the packaged and tiny targets, which a setting
    names whole, and for a path that is not there: the preflight names it)."""
    from dflash.models.targets.checkpoint_digest import checkpoint_digest

    path = settings.target.path
    if settings.target.kind != "hf" or not path or not os.path.exists(os.path.expanduser(path)):
        return None
    return checkpoint_digest(path)


def hashed_files(named: dict[str, str | None]) -> dict[str, dict[str, str]]:
    """{key: {"path", "sha256"}} of each file `named` names (None: not set, left out)."""
    return {key: {"path": path, "sha256": sha256_once(os.path.expanduser(path))}
            for key, path in named.items() if path}


# sha256 by (path, size, modification time): a command asks for an input file's hash several times (the run
# folder's guard, the data stage's checks and its run); an edit changes the key, so it is hashed again.
_hashes: dict[tuple[str, int, int], str] = {}


def sha256_once(path: str) -> str:
    """file_sha256 of `path`, read once per process for each version of the file."""
    status = os.stat(path)
    key = (os.path.abspath(path), status.st_size, status.st_mtime_ns)
    if key not in _hashes:
        _hashes[key] = file_sha256(path)
    return _hashes[key]


def changed_input_files(settings, data_dir: str) -> list[tuple[str, str, str, str]]:
    """(key, path, recorded sha256, sha256 now) of each input file (input_files) whose contents differ from those
    the data stage's stats.json in `data_dir` recorded; none when it recorded none (a build from before the record,
    trusted as it is)."""
    recorded = (read_json_or_none(os.path.join(data_dir, "stats.json")) or {}).get("input_files")
    return changed_files(recorded, input_files(settings), unrecorded_changed=False)


def changed_words(key: str, path: str, recorded: str, now: str, since: str) -> str:
    """An input file that changed (changed_files' tuple), as a line says it: a file's sha256, or a target=hf
    checkpoint's digest of its weights."""
    if key == "target.path":
        return f"{key} {path} holds other weights since {since} (digest {recorded[:12]}... -> {now[:12]}...)"
    return f"{key} {path} changed since {since} (sha256 {recorded[:12]}... -> {now[:12]}...)"


def changed_files(recorded: Any, now: dict[str, dict[str, str]], *,
                  unrecorded_changed: bool) -> list[tuple[str, str, str, str]]:
    """(key, path, recorded sha256 or 'none', sha256 now) of each file of `now` (hashed_files) whose sha256 differs
    from the one `recorded` (a record's "input_files") holds, or, with unrecorded_changed, that it does not hold;
    none when there is no record (written before records were kept: trusted as it is)."""
    if not isinstance(recorded, dict):
        return []
    changed = []
    for key, file in now.items():
        then = recorded.get(key)
        was = then.get("sha256") if isinstance(then, dict) else None
        if was != file["sha256"] and (was is not None or unrecorded_changed):
            changed.append((key, file["path"], str(was or "none"), file["sha256"]))
    return changed
