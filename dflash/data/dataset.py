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

from dflash.data.chat import encode_conversation, prompt_ids_many
from dflash.data.prompts import Prompt
from dflash.data.regenerate import read_record, regenerate, scan_journal, with_target
from dflash.run_files import swap_in_dir

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
COLUMNS = ("id", "input_ids", "loss_mask", "prompt_set")
FEATURES = datasets.Features({
    "id": datasets.Value("string"),
    "input_ids": datasets.Sequence(datasets.Value("int32")),
    # 0/1 flags: int8 keeps the mask a quarter of the ids' size on disk.
    "loss_mask": datasets.Sequence(datasets.Value("int8")),
    "prompt_set": datasets.Value("string"),
})
ENCODE_CHUNK = 10_000  # samples per in-memory Arrow chunk (bounds the Python-list memory while encoding)


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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _save_dataset(ds: datasets.Dataset, target: Path, show_progress: bool) -> None:
    """save_to_disk into a temp folder, then swap it in: `target` is never half-written."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    # A build killed while saving or in the middle of the swap left its temp or old copy (a full dataset
    # each); this build replaces both, so they go.
    for leftover in sorted(target.parent.glob(f".{target.name}.tmp-*")) + sorted(target.parent.glob(
            f".{target.name}.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    if not show_progress:
        datasets.utils.disable_progress_bars()
    try:
        ds.save_to_disk(str(tmp))
    finally:
        if bars_were_on:
            datasets.utils.enable_progress_bars()
    swap_in_dir(str(tmp), str(target), aside=str(old))


def heldout_ids(ids: list[str], count: int, seed: int) -> set[str]:
    """The `count` ids with the smallest seeded hash.

    Whether an id is held out depends only on the seed and its rank among the hashes, not on prompt order, so
    adding prompts to a dataset moves at most the boundary of the held-out set.
    """
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}\n{i}".encode()).digest())
    return set(ranked[:count])


def _encode_record(tokenizer: Any, prompt: Prompt, prompt_tokens: list[int], record: dict, max_length: int,
                   journal_path: Path) -> tuple[list[int], list[int]]:
    """encode_conversation of a journal record, checked against what the generation saw."""
    input_ids, loss_mask = encode_conversation(tokenizer, prompt.messages, record["response_ids"], prompt_tokens)
    # A record with a prompt_hash matches its prompt: regenerate answered again every prompt whose tokens changed.
    # A record from before prompt hashes can only be checked by its length.
    if "prompt_hash" not in record and len(prompt_tokens) != record["prompt_len"]:
        raise ValueError(f"prompt {prompt.id!r} encodes to {len(prompt_tokens)} tokens but its journaled answer "
                         f"was generated from {record['prompt_len']}: the prompt's messages or the chat template "
                         f"changed since; delete {journal_path} (it predates prompt hashes, which would have "
                         f"answered the changed prompt again)")
    if len(input_ids) > max_length:
        raise ValueError(f"prompt {prompt.id!r}: {len(input_ids)} tokens > max_length {max_length} "
                         f"in {journal_path}")
    return input_ids, loss_mask


def build_dataset(prompts: list[Prompt], adapter: Any, out_dir: str | Path, *, max_length: int,
                  max_new_tokens: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0,
                  seed: int = 0, show_progress: bool = True, heldout: int = 0, engine: str = "hf",
                  compile_step: bool = False, refill: bool = True, target: dict | None = None,
                  before_replace: Callable[[], None] | None = None) -> dict:
    """Regenerate the responses (resumable), encode them and write out_dir/dataset + out_dir/stats.json.

    heldout > 0: that many of the regenerated prompts (a seeded choice, see heldout_ids) go to out_dir/heldout
    instead of out_dir/dataset. Returns the stats: the regeneration counts (total = done + skipped + failed),
    training samples written, held-out samples written (only with heldout > 0), samples dropped for having no
    loss token, and token counts. A finished build with the same fingerprint and no failed prompt is reused.
    target: the target's identity (a JSON-able dict such as its config), part of the fingerprint and of the journal
    header: answers of another target are never reused (regenerate). None: unknown, left out of both.
    before_replace: called once the new build is ready, right before it replaces the folder's dataset (the caller
    withdraws its own "done" marker there); a build refused or failing earlier leaves the folder as it was.
    """
    if heldout < 0 or (heldout and heldout >= len(prompts)):
        raise ValueError(f"heldout must be >= 0 and fewer than the {len(prompts)} prompts, got {heldout}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"max_length": max_length, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed}
    if heldout:  # absent at 0, so a build without a held-out set keeps the fingerprint it always had
        settings["heldout"] = heldout
    settings = with_target(settings, target)  # likewise absent when unknown
    tokenizer = adapter.tokenizer
    fp = fingerprint(prompts, tokenizer, settings)
    stats_path, dataset_path, heldout_path = out_dir / "stats.json", out_dir / "dataset", out_dir / "heldout"
    if stats_path.exists() and dataset_path.exists() and (heldout_path.exists() or not heldout):
        previous = json.loads(stats_path.read_text(encoding="utf-8"))
        # A build with failed prompts is redone: they are retried (the journal keeps everything that finished).
        if previous.get("fingerprint") == fp and not previous.get("failed"):
            logger.info("%s is up to date (fingerprint %s); not rebuilding", dataset_path, fp[:12])
            return previous
    journal_path = out_dir / "journal.jsonl"
    gen = regenerate(prompts, adapter, journal_path, max_length, max_new_tokens, batch_size,
                     temperature=temperature, top_p=top_p, seed=seed, show_progress=show_progress, engine=engine,
                     compile_step=compile_step, refill=refill, target=target)
    _, index = scan_journal(journal_path)
    done_ids = [p.id for p in prompts if p.id in index and index[p.id][0] == "done"]
    if heldout and heldout >= len(done_ids):
        raise ValueError(f"heldout={heldout} prompts, but only {len(done_ids)} were regenerated: no training "
                         f"sample would be left (journal: {journal_path})")
    held = heldout_ids(done_ids, heldout, seed)
    encode_started = time.perf_counter()

    chunks, rows = [], {c: [] for c in COLUMNS}
    held_rows = {c: [] for c in COLUMNS}
    samples = dropped = num_tokens = num_response_tokens = held_tokens = 0
    finished = [p for p in prompts if p.id in index and index[p.id][0] == "done"]
    with open(journal_path, "rb") as journal:
        for first in range(0, len(finished), ENCODE_CHUNK):
            batch = finished[first : first + ENCODE_CHUNK]
            for p, prompt_tokens in zip(batch, prompt_ids_many(tokenizer, [p.messages for p in batch])):
                record = read_record(journal, index[p.id][1])
                input_ids, loss_mask = _encode_record(tokenizer, p, prompt_tokens, record, max_length, journal_path)
                if not any(loss_mask):
                    dropped += 1
                    continue
                if p.id in held:
                    for column, value in zip(COLUMNS, (p.id, input_ids, loss_mask, p.prompt_set)):
                        held_rows[column].append(value)
                    held_tokens += len(input_ids)
                    continue
                for column, value in zip(COLUMNS, (p.id, input_ids, loss_mask, p.prompt_set)):
                    rows[column].append(value)
                samples += 1
                num_tokens += len(input_ids)
                num_response_tokens += sum(loss_mask)
            if len(rows["id"]) >= ENCODE_CHUNK:
                chunks.append(datasets.Dataset.from_dict(rows, features=FEATURES))
                rows = {c: [] for c in COLUMNS}
    if samples == 0:
        # datasets cannot load back an empty saved dataset; an empty training set is an error anyway.
        raise ValueError(f"no samples to write: of {gen['total']} prompts {gen['skipped']} were too long, "
                         f"{gen['failed']} failed and {dropped} had no response token (journal: {journal_path})")
    if rows["id"]:
        chunks.append(datasets.Dataset.from_dict(rows, features=FEATURES))
    ds = datasets.concatenate_datasets(chunks) if len(chunks) > 1 else chunks[0]
    encode_s = time.perf_counter() - encode_started
    if before_replace is not None:
        before_replace()
    # A stale stats.json next to a replaced dataset would claim the wrong fingerprint.
    stats_path.unlink(missing_ok=True)
    _save_dataset(ds, dataset_path, show_progress)
    if held_rows["id"]:
        _save_dataset(datasets.Dataset.from_dict(held_rows, features=FEATURES), heldout_path, show_progress)
    else:  # a held-out set left by an earlier build with other settings is not this build's
        shutil.rmtree(heldout_path, ignore_errors=True)

    stats = {"schema_version": SCHEMA_VERSION, "fingerprint": fp, "settings": settings,
             "total": gen["total"], "done": gen["done"], "skipped": gen["skipped"], "failed": gen["failed"],
             "stale": gen["stale"], "errors": gen["errors"], "engine": gen["engine"],
             "generated_tokens": gen["generated_tokens"],
             "generate_tokens_per_s": gen["generate_tokens_per_s"], "generate_seconds": gen["generate_seconds"],
             "template_seconds": gen["template_seconds"], "encode_seconds": round(encode_s, 3), "samples": samples, "dropped_no_loss": dropped,
             "num_tokens": num_tokens, "num_response_tokens": num_response_tokens}
    if heldout:
        stats.update(heldout=len(held_rows["id"]), heldout_num_tokens=held_tokens)
    assert stats["done"] + stats["skipped"] + stats["failed"] == stats["total"], stats
    assert stats["samples"] + stats.get("heldout", 0) + stats["dropped_no_loss"] == stats["done"], stats
    _write_json(stats_path, stats)
    return stats


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
