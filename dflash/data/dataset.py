"""The training dataset on disk: prompts + the target's regenerated responses, tokenised with a loss mask.

out_dir/journal.jsonl   the regeneration journal (resumable, see regenerate.py)
out_dir/dataset/        a HF `datasets` dataset (save_to_disk): id, input_ids, loss_mask, prompt_set
out_dir/heldout/        only with heldout > 0: the same schema, prompts kept out of dataset/ for the held-out
                        acceptance evaluation during training (dflash/train/heldout.py)
out_dir/stats.json      counts + the fingerprint of the inputs; written last, so it marks a finished build
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from dflash.config.errors import ConfigError
from dflash.data.chat import prompt_ids_many
from dflash.data.encode import COLUMNS, Encoded, Rows, encode_answers
from dflash.data.encode import FEATURES  # noqa: F401 - the dataset's schema, where readers look for it
from dflash.data.journal import scan_journal, with_target
from dflash.data.prompts import Prompt
from dflash.data.regenerate import answer_is_sampled, mixes_answers, regenerate
from dflash.data.synthetic import format_synthetic
from dflash.run_files import atomic_write, swap_in_dir
from dflash.console import verbose

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


def fingerprint(prompts: list[Prompt], tokenizer: Any, settings: dict) -> str:
    """Hash of what determines the dataset: prompts, generation settings (the target's identity included, when
    known), tokenizer and its chat template."""
    h = hashlib.sha256()
    h.update(json.dumps({"schema_version": SCHEMA_VERSION, "settings": settings,
                         "tokenizer": getattr(tokenizer, "name_or_path", ""), "vocab": len(tokenizer),
                         "chat_template": getattr(tokenizer, "chat_template", None)}, sort_keys=True).encode())
    for p in prompts:
        h.update(json.dumps([p.id, p.prompt_set, p.messages], sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=2) + "\n")


def _save_dataset(ds: datasets.Dataset, target: Path) -> None:
    """save_to_disk into a temp folder, then swap it in: `target` is never half-written."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    remove_save_leftovers(target)
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    if not verbose():  # datasets' "Saving the dataset" bar is third-party output (dflash/train/third_party_output.py)
        datasets.utils.disable_progress_bars()
    try:
        ds.save_to_disk(str(tmp))
    finally:
        if bars_were_on:
            datasets.utils.enable_progress_bars()
    swap_in_dir(str(tmp), str(target), aside=str(old))


def remove_save_leftovers(target: Path) -> None:
    """The temp and old copies (a full dataset each) that a build killed while saving `target`, or in the middle of
    its swap, left beside it: the next build replaces them, or holds no such split."""
    for leftover in sorted(target.parent.glob(f".{target.name}.tmp-*")) + sorted(target.parent.glob(
            f".{target.name}.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def heldout_ids(ids: list[str], count: int, seed: int) -> set[str]:
    """The `count` ids with the smallest seeded hash.

    Whether an id is held out depends only on the seed and its rank among the hashes, not on prompt order, so
    adding prompts to a dataset moves at most the boundary of the held-out set.
    """
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}\n{i}".encode()).digest())
    return set(ranked[:count])


def build_dataset(prompts: list[Prompt], adapter: Any, out_dir: str | Path, *, max_length: int,
                  max_new_tokens: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0,
                  seed: int = 0, show_progress: bool = True, heldout: int = 0, engine: str,
                  compile_step: bool = False, refill: bool, decode_attention: str, target: dict | None = None,
                  before_replace: Callable[[], None] | None = None,
                  template_kwargs: dict[str, Any] | None = None, sampled_share: float = 1.0,
                  as_given: dict[str, float] | None = None) -> dict:
    """Regenerate the responses (resumable), encode them and write out_dir/dataset + out_dir/stats.json.

    heldout > 0: that many of the regenerated prompts (a seeded choice, see heldout_ids) go to out_dir/heldout
    instead of out_dir/dataset. Returns the stats: the regeneration counts (total = done + skipped + failed),
    training samples written, held-out samples written (only with heldout > 0), samples dropped for having no
    loss token, and token counts. A finished build with the same fingerprint and no failed prompt is reused.
    target: the target's identity (a JSON-able dict such as its config), part of the fingerprint and of the journal
    header: answers of another target are never reused (regenerate). None: unknown, left out of both.
    before_replace: called once the new build is ready, right before it replaces the folder's dataset (the caller
    withdraws its own "done" marker there); a build refused or failing earlier leaves the folder as it was.
    template_kwargs: the chat template's options for the prompts (enable_thinking...), part of the fingerprint.
    sampled_share < 1 with temperature > 0: that share of the prompts (answer_is_sampled) is answered by sampling,
    the rest greedily; part of the fingerprint then, and stats["answer_mix"] counts both kinds per split.
    as_given: the answers' temperature, top_p and sampled_share as the command gave them, where the caller passes
    stand-ins for those that change no answer: a finished build fingerprinted with the values as given holds the
    same answers, so it is reused too, keeping its fingerprint.
    """
    if heldout < 0 or (heldout and heldout >= len(prompts)):
        raise ValueError(f"heldout must be >= 0 and fewer than the {len(prompts)} prompts, got {heldout}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    answers = {"temperature": temperature, "top_p": top_p, "sampled_share": sampled_share}
    settings = _settings(max_length, max_new_tokens, seed, heldout, target, template_kwargs, **answers)
    fp = fingerprint(prompts, adapter.tokenizer, settings)
    previous = _finished_build(out_dir, fp, heldout)
    given = _settings(max_length, max_new_tokens, seed, heldout, target, template_kwargs,
                      **{**answers, **(as_given or {})})
    if previous is None and given != settings:
        previous = _finished_build(out_dir, fingerprint(prompts, adapter.tokenizer, given), heldout)
    if previous is not None:
        logger.info("%s is up to date (fingerprint %s); not rebuilding", out_dir / "dataset", fp[:12])
        return {**previous, "reused": True}  # its answers' counts and times are the earlier build's
    journal_path = out_dir / "journal.jsonl"
    # Templated once: regeneration and encoding read the same ids (tokenising every multi-turn prompt is most of
    # the CPU time a data stage spends outside generation).
    template_started = time.perf_counter()
    prompt_tokens = prompt_ids_many(adapter.tokenizer, [p.messages for p in prompts], template_kwargs,
                                    [p.id for p in prompts])
    template_s = time.perf_counter() - template_started
    _check_heldout_fits(prompt_tokens, heldout, max_length)
    gen = regenerate(prompts, adapter, journal_path, max_length, max_new_tokens, batch_size,
                     temperature=temperature, top_p=top_p, seed=seed, show_progress=show_progress, engine=engine,
                     compile_step=compile_step, refill=refill, decode_attention=decode_attention, target=target,
                     template_kwargs=template_kwargs, sampled_share=sampled_share, prompt_tokens=prompt_tokens)
    gen["template_seconds"] = round(template_s + gen["template_seconds"], 3)
    _, index = scan_journal(journal_path)
    templated = {p.id: ids for p, ids in zip(prompts, prompt_tokens) if p.id in index and index[p.id][0] == "done"}
    del prompt_tokens  # only the answered prompts' ids are kept for encoding
    finished = [p for p in prompts if p.id in templated]
    held = _choose_heldout(finished, heldout, seed, journal_path)
    encode_started = time.perf_counter()
    encoded = encode_answers(finished, templated, index, journal_path, adapter.tokenizer, max_length, held,
                             is_sampled=lambda i: temperature > 0 and answer_is_sampled(i, seed, sampled_share))
    if encoded.train.samples == 0:
        # datasets cannot load back an empty saved dataset; an empty training set is an error anyway, and the
        # user's to mend (a one-line ConfigError): the settings, not the code, left nothing to train on.
        raise ConfigError(f"no samples to write: of {gen['total']} prompts {gen['skipped']} were too long (a prompt "
                          f"may have at most data.max_length - 1 = {max_length - 1} tokens), {gen['failed']} failed, "
                          f"{encoded.dropped} had no response token and {len(held)} were held out (data.heldout) "
                          f"(journal: {journal_path})")
    ds = encoded.train.dataset()
    encode_s = time.perf_counter() - encode_started
    if before_replace is not None:
        before_replace()
    # A stale stats.json next to a replaced dataset would claim the wrong fingerprint.
    (out_dir / "stats.json").unlink(missing_ok=True)
    _save_splits(out_dir, ds, encoded.heldout)
    stats = _stats(fp, settings, gen, encoded, encode_s, heldout)
    _write_json(out_dir / "stats.json", stats)
    return stats


def _settings(max_length: int, max_new_tokens: int, seed: int, heldout: int, target: dict | None,
              template_kwargs: dict[str, Any] | None, *, temperature: float, top_p: float,
              sampled_share: float) -> dict:
    """What the dataset depends on besides the prompts and the tokenizer (the fingerprint's settings)."""
    settings = {"max_length": max_length, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed}
    if heldout:  # absent at 0, so a build without a held-out set keeps the fingerprint it always had
        settings["heldout"] = heldout
    settings = with_target(settings, target)  # likewise absent when unknown
    # Absent when every answer is made alike, so those builds keep their fingerprints.
    if mixes_answers(temperature, sampled_share):
        settings["sampled_share"] = sampled_share
    if template_kwargs:  # absent when there are none, so builds without them keep their fingerprints
        settings["chat_template_kwargs"] = dict(template_kwargs)
    return settings


def _finished_build(out_dir: Path, fp: str, heldout: int) -> dict | None:
    """The stats of a finished build in out_dir with fingerprint `fp` and no failed prompt, else None."""
    stats_path, held_path = out_dir / "stats.json", out_dir / "heldout"
    if not stats_path.exists() or not (out_dir / "dataset").exists() or (heldout and not held_path.exists()):
        return None
    previous = json.loads(stats_path.read_text(encoding="utf-8"))
    # A build with failed prompts is redone: they are retried (the journal keeps everything that finished).
    if previous.get("fingerprint") == fp and not previous.get("failed"):
        return previous
    return None


def _check_heldout_fits(prompt_tokens: list[list[int]], heldout: int, max_length: int) -> None:
    """ConfigError naming data.heldout when it holds out every prompt that max_length leaves room to answer (no
    training sample would be left), found before any answer is generated. Prompts that fail while answering are
    counted later (_choose_heldout)."""
    if not heldout:
        return
    # regenerate skips a prompt with no room for one answer token, as here.
    skipped = sum(len(ids) + 1 > max_length for ids in prompt_tokens)
    left = len(prompt_tokens) - skipped
    if heldout >= left:
        raise ConfigError(f"data.heldout={heldout}: expected fewer than the {left} prompts left after skipping the "
                          f"{skipped} longer than data.max_length - 1 = {max_length - 1} tokens once templated")


def _choose_heldout(finished: list[Prompt], heldout: int, seed: int, journal_path: Path) -> set[str]:
    """The ids of the `heldout` done prompts kept out of training (heldout_ids)."""
    done_ids = [p.id for p in finished]
    if heldout and heldout >= len(done_ids):
        raise ConfigError(f"data.heldout={heldout}: expected fewer than the {len(done_ids)} prompts answered (the "
                          f"others were too long or failed): no training sample would be left (journal: "
                          f"{journal_path})")
    return heldout_ids(done_ids, heldout, seed)


def _save_splits(out_dir: Path, train: datasets.Dataset, held: Rows) -> None:
    """Swap in out_dir/dataset and out_dir/heldout (removed when this build holds nothing out)."""
    _save_dataset(train, out_dir / "dataset")
    if held.samples:
        _save_dataset(held.dataset(), out_dir / "heldout")
    else:  # a held-out set left by an earlier build with other settings is not this build's
        shutil.rmtree(out_dir / "heldout", ignore_errors=True)
        remove_save_leftovers(out_dir / "heldout")


def _stats(fp: str, settings: dict, gen: dict, encoded: Encoded, encode_s: float, heldout: int) -> dict:
    """stats.json: the regeneration's counts and timings, and what was written."""
    stats = {"schema_version": SCHEMA_VERSION, "fingerprint": fp, "settings": settings,
             "total": gen["total"], "done": gen["done"], "skipped": gen["skipped"], "failed": gen["failed"],
             "stale": gen["stale"], "errors": gen["errors"], "engine": gen["engine"],
             "generated_tokens": gen["generated_tokens"],
             "generate_tokens_per_s": gen["generate_tokens_per_s"], "generate_seconds": gen["generate_seconds"],
             "template_seconds": gen["template_seconds"], "encode_seconds": round(encode_s, 3),
             "samples": encoded.train.samples, "dropped_no_loss": encoded.dropped,
             "dropped_heldout_copies": encoded.heldout_copies,
             "num_tokens": encoded.train.num_tokens, "num_response_tokens": encoded.train.num_response_tokens}
    if heldout:
        stats.update(heldout=encoded.heldout.samples, heldout_num_tokens=encoded.heldout.num_tokens)
    if "sampled_share" in settings:
        stats["answer_mix"] = {name: {"greedy": rows.samples - rows.sampled, "sampled": rows.sampled}
                               for name, rows in (("samples", encoded.train), ("heldout", encoded.heldout))}
    assert stats["done"] + stats["skipped"] + stats["failed"] == stats["total"], stats
    assert stats["samples"] + stats.get("heldout", 0) + stats["dropped_no_loss"] + stats["dropped_heldout_copies"] \
        == stats["done"], stats
    return stats


# What the data stage's steps before the answers (stats.json "before_answers") are called in its table.
BEFORE_ANSWERS = {"prompts": "reading prompts", "target": "loading the target", "synthetic": "synthetic prompts",
                  "overlap": "overlap check"}


def format_stats(stats: dict) -> str:
    """The data stage's stats (build_dataset's, or a stats.json) as a short table for a person to read: the
    prompts' counts, what was written, the answers' tokens per second and the time; lines without a trailing
    newline. The full dict stays in stats.json."""
    prompts = (f"total {stats['total']:,} | done {stats['done']:,} | skipped {stats['skipped']:,} (too long) | "
               f"failed {stats['failed']:,}")
    if stats.get("stale"):
        prompts += f" | stale {stats['stale']:,} (prompt changed: answered again)"
    rows = [("prompts", prompts)]
    if "heldout" in stats:
        rows.append(("held out", f"{stats['heldout']:,} ({stats['heldout_num_tokens']:,} tokens)"
                                 f"{_mix(stats, 'heldout')}"))
    dropped = f", {stats['dropped_no_loss']:,} dropped (no answer token)" if stats.get("dropped_no_loss") else ""
    if stats.get("dropped_heldout_copies"):
        dropped += f", {stats['dropped_heldout_copies']:,} dropped (copies of a held-out prompt)"
    rows.append(("samples", f"{stats['samples']:,} ({stats['num_tokens']:,} tokens, "
                            f"{stats['num_response_tokens']:,} in answers){dropped}{_mix(stats, 'samples')}"))
    if "synthetic" in stats:
        rows.append(("synthetic", format_synthetic(stats["synthetic"])))
    if "eval_overlap" in stats:
        rows.append(("eval overlap", _overlap(stats["eval_overlap"])))
    earlier = " (the earlier build's: this run reused its dataset)" if stats.get("reused") else ""
    rows.append(("answers", _answers(stats) + earlier))
    rows.append(("time", _times(stats) + earlier))
    if stats.get("before_answers"):  # the data stage's: reading prompts, loading the target, synthetic, overlap
        before = stats["before_answers"]
        rows.append(("before that", f"{sum(before.values()):,.1f} s: " + ", ".join(
            f"{BEFORE_ANSWERS.get(name, name)} {seconds:,.1f} s" for name, seconds in before.items())))
    if stats.get("errors"):
        first = stats["errors"][0]
        message = (first["error"].splitlines() or [""])[0]
        rows.append(("first error", f"{first['id']}: {message[:80]} (all in stats.json)"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _mix(stats: dict, split: str) -> str:
    """', 40 greedy and 40 sampled answers' for a split of a build that mixes them, else ''."""
    if "answer_mix" not in stats:
        return ""
    counts = stats["answer_mix"][split]
    return f", {counts['greedy']:,} greedy and {counts['sampled']:,} sampled answers"


def _overlap(report: dict) -> str:
    """The eval-overlap check of the data stage (dflash/data/eval_overlap.py) in one line."""
    dropped, checked = sum(report["dropped"].values()), sum(report["checked"].values())
    sets = ", ".join(report.get("eval_sets", {}))
    return (f"{dropped:,} of {checked:,} training prompts dropped: they share {report['ngram']} words in a row "
            f"with a prompt of {sets or 'the eval sets'}")


def _answers(stats: dict) -> str:
    """Tokens generated by this build and their rate (none when every answer came from the journal)."""
    tokens, rate = stats.get("generated_tokens"), stats.get("generate_tokens_per_s")
    if not tokens:
        return "none generated: every answer was in the journal"
    engine = f" ({stats['engine']} engine)" if stats.get("engine") else ""
    return f"{tokens:,} tokens generated" + (f" at {rate:,.1f} tok/s" if rate else "") + engine


def _times(stats: dict) -> str:
    """The build's time in all and per step (the steps a stats.json records)."""
    steps = {name: stats.get(f"{name}_seconds") for name in ("template", "generate", "encode")}
    known = {name: seconds for name, seconds in steps.items() if seconds is not None}
    detail = ", ".join(f"{name} {seconds:,.1f} s" for name, seconds in known.items())
    return f"{sum(known.values()):,.1f} s to answer ({detail})" if known else "not recorded"


def load_dataset_dir(out_dir: str | Path) -> datasets.Dataset:
    """The dataset that build_dataset wrote into out_dir (out_dir/dataset)."""
    path = Path(out_dir) / "dataset"
    if not (path / "dataset_info.json").exists():
        raise FileNotFoundError(f"no dataset at {path}: run build_dataset with out_dir={out_dir} first")
    ds = datasets.load_from_disk(str(path))
    return _checked_columns(ds, path)


def load_heldout_dir(out_dir: str | Path) -> datasets.Dataset | None:
    """The held-out prompts that build_dataset(heldout > 0) wrote into out_dir/heldout; None when it wrote none."""
    path = Path(out_dir) / "heldout"
    if not (path / "dataset_info.json").exists():
        return None
    return _checked_columns(datasets.load_from_disk(str(path)), path)


def _checked_columns(ds: datasets.Dataset, path: Path) -> datasets.Dataset:
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise ValueError(f"{path} lacks columns {missing} (has {ds.column_names})")
    return ds
