"""Regenerate the responses with the target itself, resumably.

The drafter must imitate the target's own distribution (dflash-notes.md section 4), so every prompt is answered
by the target. Finished prompts go to an append-only JSON-lines journal, fsynced every batch's worth of prompts
(or every few seconds): an interrupted run restarts where it stopped and never generates a journaled prompt again.
A hard kill loses at most the answers finished since the last write; the next run generates those.

Journal lines: a header {"header": {...settings}} first (the settings include the target's identity when the
caller gives one), then one record per finished prompt:
{"id", "prompt_set", "status": "done", "prompt_len", "prompt_hash", "response_ids", "finish": "stop" | "length"} or
{"id", "prompt_set", "status": "failed", "error"} (failed prompts are retried on the next run), and
{"id", "prompt_set", "status": "stale"} when a done prompt's tokens changed since (it is answered again).
The latest line of an id is its state. prompt_hash (prompt_hash() of the templated prompt's ids) ties an answer to
the prompt it answers: ids alone do not (a file's default ids shift when a record is inserted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from dflash.data.chat import prompt_ids_many
from dflash.data.prompts import Prompt
from dflash.data.static_decode import StaticGenerator, resolve_engine

logger = logging.getLogger(__name__)
JOURNAL_EVERY_S = 30.0  # the static engine streams every prompt in one call: write what finished this often


Index = dict[str, tuple[str, int, str | None]]  # id -> (status, byte offset of its latest line, prompt_hash)


def prompt_hash(ids: list[int]) -> str:
    """A short digest of a templated prompt's token ids: a journaled answer is reused only for the same ids."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def with_target(settings: dict, target: dict | None) -> dict:
    """`settings` plus the target's identity as it reads back from a JSON header (so comparing the two is exact).
    An unknown target (None) adds nothing, so settings recorded before targets were keep matching."""
    if target is None:
        return settings
    try:
        return {**settings, "target": json.loads(json.dumps(target, sort_keys=True))}
    except (TypeError, ValueError) as e:
        raise ValueError(f"target identity must be JSON-serialisable, got {target!r} ({e})") from None


def _scan(path: Path) -> tuple[dict | None, Index, int]:
    """scan_journal, plus the byte length of the complete lines (where a partial last line starts)."""
    header, index, offset = None, {}, 0
    if not path.exists():
        return header, index, offset
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                break  # the partial line of an interrupted write
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: malformed journal line ({e.msg})") from None
                if "header" in record:
                    header = record["header"]
                else:
                    index[record["id"]] = (record["status"], offset, record.get("prompt_hash"))
            offset += len(line)
    return header, index, offset


def scan_journal(path: str | Path) -> tuple[dict | None, Index]:
    """(header settings or None, {id: (status, byte offset of its latest line, its prompt_hash or None)}); a partial
    last line is ignored.

    Streams the file and keeps no responses, so a journal of millions of long responses fits in memory.
    """
    header, index, _ = _scan(Path(path))
    return header, index


def read_record(f: Any, offset: int) -> dict:
    """The journal record at `offset` of the journal opened in binary mode as `f`."""
    f.seek(offset)
    return json.loads(f.readline())


def read_journal(path: str | Path) -> tuple[dict | None, dict[str, dict]]:
    """(header settings or None, {id: latest record}): the whole journal in memory, for inspection."""
    header, index = scan_journal(path)
    if not index:
        return header, {}
    with open(path, "rb") as f:
        return header, {pid: read_record(f, offset) for pid, (_, offset, _) in index.items()}


def _differences(header: dict, settings: dict, prefix: str = "") -> list[str]:
    """What differs between a journal's header and the settings now: `key: then -> now`, nested keys dotted."""
    parts = []
    for key in sorted(set(header) | set(settings)):
        then = header[key] if key in header else "not recorded"
        now = settings[key] if key in settings else "not given"
        if isinstance(then, dict) and isinstance(now, dict):
            parts += _differences(then, now, f"{prefix}{key}.")
        elif then != now:
            parts.append(f"{prefix}{key}: {then!r} -> {now!r}")
    return parts


def open_journal(path: Path, settings: dict) -> tuple[Any, dict[str, str | None]]:
    """Open the journal for appending after dropping a partial tail; check it was made with `settings`.

    Returns the open file and {id: prompt_hash (None in records from before hashes)} of the ids already done.
    """
    header, index, complete = _scan(path)
    if header is not None and header != settings:
        raise ValueError(f"{path} was written with other settings ({'; '.join(_differences(header, settings))}). "
                         f"Delete it or use another output folder.")
    if path.exists() and path.stat().st_size > complete:
        # Appending after a partial line would glue the next record onto it: cut it off first.
        logger.warning("%s: dropping a partial last line (%d bytes) from an interrupted run", path,
                       path.stat().st_size - complete)
        with open(path, "r+b") as f:
            f.truncate(complete)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a", encoding="utf-8")
    if header is None:
        f.write(json.dumps({"header": settings}) + "\n")
    return f, {pid: digest for pid, (status, _, digest) in index.items() if status == "done"}


def append_lines(f: Any, records: list[dict]) -> None:
    """Append `records` as JSON lines to the journal opened as `f`, and make them durable (flush + fsync)."""
    f.write("".join(json.dumps(r) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


def batch_seed(seed: int, ids: list[str]) -> int:
    """A sampling seed that depends only on the run seed and the prompts in the batch."""
    digest = hashlib.sha256(json.dumps([seed, ids]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def generation_config(max_new_tokens: int, stop_ids: list[int], pad_id: int, temperature: float,
                       top_p: float) -> GenerationConfig:
    """Plain greedy (temperature 0) or temperature + top-p sampling.

    Every knob a checkpoint's generation_config.json could set (and generate() would inherit, since it only
    fills unset values) is pinned to neutral: the responses must be the target's own distribution.
    """
    neutral = {"num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0}
    if temperature > 0:
        neutral.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, min_p=0.0, typical_p=1.0,
                       epsilon_cutoff=0.0, eta_cutoff=0.0)
    else:
        neutral.update(do_sample=False)
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                            use_cache=True, **neutral)


def cut_response(tokens: list[int], stop_ids: set[int], budget: int) -> tuple[list[int], str]:
    """Response up to and including the first stop token, at most `budget` tokens."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            tokens = tokens[: i + 1]
            break
    if len(tokens) > budget:
        tokens = tokens[:budget]
    return tokens, ("stop" if tokens and tokens[-1] in stop_ids else "length")


def hf_generate(adapter: Any, batch: list[list[int]], config: GenerationConfig, pad_id: int,
              seed: int) -> list[list[int]]:
    """New tokens for each left-padded prompt of the batch (one call of model.generate)."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    device = torch.device(adapter.device)
    # Sampling draws from the global RNG inside generate: seed it per batch and restore it afterwards.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
        torch.manual_seed(seed)
        out = adapter.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                     generation_config=config)
    return out[:, width:].tolist()


def _without_frames(error: Exception) -> Exception:
    """`error` without its traceback: the failed call's frames, and the caches they hold (after a CUDA
    out-of-memory error, the memory the retries need), are freed once the except block ends."""
    return error.with_traceback(None)


def _retry_one_by_one(error: Exception, generate_one: Callable[[int], list[int]],
                      indices: list[int]) -> Iterator[tuple[int, list[int] | Exception]]:
    """After a batch failed with `error`: (i, generate_one(i) or the exception it raises) for each index, so that
    one bad prompt fails alone."""
    logger.warning("generation failed (%s: %s); retrying %d prompt(s) one by one", type(error).__name__, error,
                   len(indices))
    for i in indices:
        try:
            out = generate_one(i)
        except Exception as e:  # noqa: BLE001 - recorded as a failed prompt
            out = e
        yield i, out


def _hf_results(adapter: Any, pending: list[tuple[Prompt, list[int]]], batch_size: int, max_new_tokens: int,
                max_length: int, stop_ids: list[int], pad_id: int, temperature: float, top_p: float, seed: int):
    """(index into pending, new tokens or the exception) per prompt, from model.generate over batches."""
    for start in range(0, len(pending), batch_size):
        chunk = pending[start: start + batch_size]
        budget = min(max_new_tokens, max_length - min(len(ids) for _, ids in chunk))
        config = generation_config(budget, stop_ids, pad_id, temperature, top_p)
        generate = partial(hf_generate, adapter, config=config, pad_id=pad_id,
                           seed=batch_seed(seed, [p.id for p, _ in chunk]))
        failure = None
        try:
            outputs = generate([ids for _, ids in chunk])
        except Exception as e:  # noqa: BLE001 - isolate the failing prompt(s)
            failure = _without_frames(e)
        if failure is not None:
            yield from _retry_one_by_one(failure, lambda i: generate([pending[i][1]])[0],
                                         list(range(start, start + len(chunk))))
            continue
        yield from enumerate(outputs, start)


def _static_results(generator: StaticGenerator, pending: list[tuple[Prompt, list[int]]], batch_size: int,
                    max_new_tokens: int, max_length: int, stop_ids: list[int], pad_id: int, temperature: float,
                    top_p: float, seed: int):
    """The same from the static engine: every prompt in one stream whose `batch_size` rows are refilled as prompts
    finish, results in finishing order. Each prompt samples from its own stream (run seed + its id), so a resumed
    run draws the same tokens. If the stream raises, the prompts it had not finished are retried one by one."""
    budgets = [min(max_new_tokens, max_length - len(ids)) for _, ids in pending]
    seeds = [batch_seed(seed, [p.id]) for p, _ in pending]
    options = dict(stop_token_ids=stop_ids, pad_id=pad_id, temperature=temperature, top_p=top_p)
    finished: set[int] = set()
    failure = None
    try:
        for i, tokens in generator.stream([ids for _, ids in pending], max_new_tokens=budgets, batch_size=batch_size,
                                          prompt_seeds=seeds, **options):
            finished.add(i)
            yield i, tokens
    except Exception as e:  # noqa: BLE001 - isolate the failing prompt(s)
        failure = _without_frames(e)
    if failure is None:
        return

    def generate_one(i: int) -> list[int]:
        return generator.generate([pending[i][1]], max_new_tokens=[budgets[i]], batch_size=1,
                                  prompt_seeds=[seeds[i]], **options)[0]

    yield from _retry_one_by_one(failure, generate_one, [i for i in range(len(pending)) if i not in finished])


def regenerate(prompts: list[Prompt], adapter: Any, journal_path: str | Path, max_length: int,
               max_new_tokens: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, show_progress: bool = True, engine: str = "hf", compile_step: bool = False,
               refill: bool = True, *, target: dict | None = None) -> dict:
    """Answer every prompt with the target; returns {"total", "done", "skipped", "failed", "stale", ...}.

    Prompts already done in the journal are not generated again, unless their templated tokens changed since
    (counted as "stale" and answered again). target: the target's identity (a JSON-able dict, e.g. its config),
    recorded in the journal header; a journal written for another target, or without a recorded target while one
    is given now, is refused like other settings. None (unknown) matches only a journal that records none.
    A prompt whose templated length + 1 exceeds max_length is skipped (no room for a response); a batch whose
    generation raises is retried prompt by prompt and the prompts that still raise are counted as failed with
    their error. Responses are cut so that prompt + response <= max_length. Greedy when temperature == 0.

    engine: "hf" (model.generate over batches of `batch_size`), "static" (static_decode: static KV cache + CUDA
    graphs; every prompt in one stream whose `batch_size` rows are refilled as answers end, journaled as they
    finish) or "auto" (static on a CUDA target it supports, else hf). Both give the same greedy tokens in
    float32, so the journal does not record which one ran. compile_step: the static engine also runs its decode
    step through torch.compile. refill=False: the static engine runs plain batches (a batch ends with its longest
    answer), for comparison.
    """
    if max_length < 2 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"need max_length >= 2, max_new_tokens >= 1, batch_size >= 1; got {max_length}, "
                         f"{max_new_tokens}, {batch_size}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}")
    engine = resolve_engine(engine, adapter)
    counts = Counter(p.id for p in prompts)
    if len(counts) != len(prompts):
        raise ValueError(f"prompt ids must be unique; duplicates: {[i for i, n in counts.items() if n > 1][:5]}")
    tokenizer = adapter.tokenizer
    stop_ids = [int(t) for t in adapter.stop_token_ids()]
    if not stop_ids:
        raise ValueError("adapter.stop_token_ids() is empty: generation would never stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    settings = {"max_length": max_length, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed, "stop_token_ids": stop_ids, "vocab": len(tokenizer)}
    settings = with_target(settings, target)
    journal_path = Path(journal_path)
    journal, done_hashes = open_journal(journal_path, settings)
    with journal:  # closed on every exit, a template or engine error included
        done = 0
        skipped, failures, stale, generated, new_tokens, generate_s = [], [], [], 0, 0, 0.0
        pending = []
        template_started = time.perf_counter()
        static = StaticGenerator(adapter, compile_step=compile_step, refill=refill) if engine == "static" else None
        for p, ids_p in zip(prompts, prompt_ids_many(tokenizer, [p.messages for p in prompts])):
            if p.id in done_hashes:
                # A record from before hashes (None) is checked by its length when the dataset is encoded.
                if done_hashes[p.id] in (None, prompt_hash(ids_p)):
                    done += 1
                    continue
                stale.append(p)
            if len(ids_p) + 1 > max_length:
                skipped.append((p.id, len(ids_p)))
            else:
                pending.append((p, ids_p))
        template_s = time.perf_counter() - template_started
        if stale:
            # Marked first, so that whatever happens to the new answer the old one is never taken for this prompt.
            logger.warning("%d prompt(s) changed since they were answered (e.g. %s): answering them again",
                           len(stale), ", ".join(p.id for p in stale[:5]))
            append_lines(journal, [{"id": p.id, "prompt_set": p.prompt_set, "status": "stale"} for p in stale])
        if skipped:
            logger.warning("skipped %d prompt(s) longer than max_length - 1 = %d tokens, e.g. %s", len(skipped),
                           max_length - 1, ", ".join(f"{i} ({n} tokens)" for i, n in skipped[:5]))
        # Longest first: similar lengths share a batch (less padding) and memory trouble shows up at once.
        pending.sort(key=lambda item: -len(item[1]))

        progress = None
        if show_progress:
            from tqdm.auto import tqdm
            progress = tqdm(total=len(pending), desc="regenerate", unit="prompt")
        arguments = (pending, batch_size, max_new_tokens, max_length, stop_ids, pad_id, temperature, top_p, seed)
        results = _hf_results(adapter, *arguments) if static is None else _static_results(static, *arguments)
        lines: list[dict] = []

        def write_journal() -> None:
            append_lines(journal, lines)
            if progress is not None:
                progress.update(len(lines))
            lines.clear()

        started = flushed = time.perf_counter()
        try:
            for i, out in results:
                p, ids_p = pending[i]
                if isinstance(out, Exception):
                    error = f"{type(out).__name__}: {out}"
                    failures.append({"id": p.id, "error": error})
                    lines.append({"id": p.id, "prompt_set": p.prompt_set, "status": "failed", "error": error})
                else:
                    response, finish = cut_response(out, set(stop_ids), max_length - len(ids_p))
                    lines.append({"id": p.id, "prompt_set": p.prompt_set, "status": "done", "prompt_len": len(ids_p),
                                  "prompt_hash": prompt_hash(ids_p), "response_ids": response, "finish": finish})
                    done += 1
                    generated += 1
                    new_tokens += len(response)
                # Journal every batch's worth of prompts, or every few seconds: a killed run loses little.
                if len(lines) >= batch_size or time.perf_counter() - flushed > JOURNAL_EVERY_S:
                    write_journal()
                    flushed = time.perf_counter()
            write_journal()
            generate_s = time.perf_counter() - started
        finally:
            # Finished answers are kept even when the run stops by an exception (Ctrl-C included); only a hard kill
            # loses the last unwritten batch's worth, which the next run regenerates.
            if lines:
                write_journal()
            if progress is not None:
                progress.close()

    stats = {"total": len(prompts), "done": done, "skipped": len(skipped), "failed": len(failures),
             "stale": len(stale), "generated": generated, "errors": failures, "engine": engine,
             "generated_tokens": new_tokens,
             "generate_seconds": round(generate_s, 3), "template_seconds": round(template_s, 3),
             # Kept response tokens per second of generation (what the data stage needs; work past a stop excluded).
             "generate_tokens_per_s": round(new_tokens / generate_s, 1) if generate_s > 0 else None}
    assert stats["done"] + stats["skipped"] + stats["failed"] == stats["total"], stats
    if failures:
        logger.warning("%d prompt(s) failed, e.g. %s: %s", len(failures), failures[0]["id"], failures[0]["error"])
    return stats
