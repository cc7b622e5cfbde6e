"""Regenerate the responses with the target itself, resumably.

The drafter must imitate the target's own distribution (dflash-notes.md section 4), so every prompt is answered
by the target. Finished prompts go to an append-only journal (journal.py), written every batch's worth of prompts
(or every few seconds): an interrupted run restarts where it stopped and never generates a journaled prompt again.
A hard kill loses at most the answers finished since the last write; the next run generates those.

Journal lines: a header {"header": {...settings}} first (the settings include the target's identity when the
caller gives one, and the share of sampled answers when some answers are greedy and others sampled), then one record
per finished prompt:
{"id", "prompt_set", "status": "done", "prompt_len", "prompt_hash", "response_ids", "finish": "stop" | "length"} or
{"id", "prompt_set", "status": "failed", "error"} (failed prompts are retried on the next run), and
{"id", "prompt_set", "status": "stale"} when a done prompt's tokens changed since (it is answered again).
The latest line of an id is its state. prompt_hash (prompt_hash() of the templated prompt's ids) ties an answer to
the prompt it answers: ids alone do not (a file's default ids shift when a record is inserted).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.data.chat import prompt_ids_many
from dflash.inference.generation import batch_seed, cut_response, generation_config, hf_generate
from dflash.inference.keyed_sampling import prompt_key
from dflash.data.journal import JournalBuffer, append_lines, open_journal, with_target
from dflash.data.journal import read_journal  # noqa: F401 - callers read the answer journal back from here
from dflash.data.progress import GenerationProgress
from dflash.data.prompts import Prompt
from dflash.inference.static_decode import StaticGenerator, resolve_engine

logger = logging.getLogger(__name__)


def prompt_hash(ids: list[int]) -> str:
    """A short digest of a templated prompt's token ids: a journaled answer is reused only for the same ids."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def mixes_answers(temperature: float, sampled_share: float) -> bool:
    """Whether some answers are greedy and others sampled: sampling on (temperature > 0) for a share below 1. Else
    every answer is made alike (greedy at temperature 0, sampled above), and the share is recorded nowhere."""
    return temperature > 0 and sampled_share < 1


def answer_is_sampled(prompt_id: str, seed: int, sampled_share: float) -> bool:
    """Whether the answer to prompt `prompt_id` is sampled (else greedy) when a share `sampled_share` of the
    answers is: a seeded hash of the id, read as a number in [0, 1), below the share. A function of the id alone,
    so resumes, reruns and the prompts' order keep each prompt's choice. Its hash is not the held-out choice's
    (dataset.heldout_ids), so the held-out prompts get the same mix as the training ones."""
    if sampled_share >= 1:
        return True
    digest = hashlib.sha256(f"sampled answer\n{seed}\n{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < sampled_share


def _answer_parts(pending: list[tuple[Prompt, list[int]]], temperature: float, sampled_share: float,
                  seed: int) -> list[tuple[float, list[int]]]:
    """The pending prompts by how they are answered: (temperature, indices into pending), each part in pending's
    order (longest first); greedy answers first when they are mixed with sampled ones."""
    everyone = list(range(len(pending)))
    if not mixes_answers(temperature, sampled_share):
        return [(temperature, everyone)]
    sampled = [answer_is_sampled(p.id, seed, sampled_share) for p, _ in pending]
    return [(0.0, [i for i in everyone if not sampled[i]]), (temperature, [i for i in everyone if sampled[i]])]


def _budgets(pending: list[tuple[Prompt, list[int]]], max_new_tokens: int, max_length: int) -> list[int]:
    """The most tokens each pending prompt's answer may take: max_new_tokens, less where max_length comes first."""
    return [min(max_new_tokens, max_length - len(ids)) for _, ids in pending]


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
                max_length: int, stop_ids: list[int], pad_id: int, temperature: float, top_p: float, seed: int,
                progress: GenerationProgress | None = None, part: list[int] | None = None):
    """(index into pending, new tokens or the exception) per prompt of `part` (indices into pending; None: all),
    from model.generate over batches; at T > 0 each prompt samples from its own stream (run seed + its id), as in the
    static engine, so a resumed run draws the same tokens. `progress` (keyed by index into pending) is shown every
    step's tokens."""
    part = list(range(len(pending))) if part is None else part
    for start in range(0, len(part), batch_size):
        rows = part[start: start + batch_size]
        chunk = [pending[i] for i in rows]
        budget = min(max_new_tokens, max_length - min(len(ids) for _, ids in chunk))
        config = generation_config(budget, stop_ids, pad_id, temperature, top_p)
        chunk_seed = batch_seed(seed, [p.id for p, _ in chunk])

        def generate(indices: list[int]) -> list[list[int]]:
            streamer = progress.streamer(indices, stop_ids) if progress is not None else None
            # Each prompt's own stream, as the static engine keys it: the same answer in any batch, or after a resume.
            keys = [prompt_key(batch_seed(seed, [pending[i][0].id])) for i in indices]
            return hf_generate(adapter, [pending[i][1] for i in indices], config, pad_id, chunk_seed, streamer, keys)

        failure = None
        try:
            outputs = generate(rows)
        except Exception as e:  # noqa: BLE001 - isolate the failing prompt(s)
            failure = _without_frames(e)
        if failure is not None:
            yield from _retry_one_by_one(failure, lambda i: generate([i])[0], rows)
            continue
        yield from zip(rows, outputs)


def _static_results(generator: StaticGenerator, pending: list[tuple[Prompt, list[int]]], batch_size: int,
                    max_new_tokens: int, max_length: int, stop_ids: list[int], pad_id: int, temperature: float,
                    top_p: float, seed: int, part: list[int] | None = None):
    """The same from the static engine: every prompt of `part` (None: all) in one stream whose `batch_size` rows
    are refilled as prompts finish, results in finishing order. Each prompt samples from its own stream (run seed +
    its id), so a resumed run draws the same tokens. If the stream raises, the prompts that were in its rows are
    retried one by one and the ones it had not reached go on in a new stream (all one by one when it failed before
    any was in a row)."""
    part = list(range(len(pending))) if part is None else part
    prompts = [pending[i] for i in part]
    budgets = _budgets(prompts, max_new_tokens, max_length)
    seeds = [batch_seed(seed, [p.id]) for p, _ in prompts]
    options = dict(stop_token_ids=stop_ids, pad_id=pad_id, temperature=temperature, top_p=top_p)
    finished: set[int] = set()
    failure = None
    try:
        for j, tokens in generator.stream([ids for _, ids in prompts], max_new_tokens=budgets, batch_size=batch_size,
                                          prompt_seeds=seeds, **options):
            finished.add(j)
            yield part[j], tokens
    except Exception as e:  # noqa: BLE001 - isolate the failing prompt(s)
        failure = _without_frames(e)
    if failure is None:
        return

    def generate_one(j: int) -> list[int]:
        return generator.generate([prompts[j][1]], max_new_tokens=[budgets[j]], batch_size=1,
                                  prompt_seeds=[seeds[j]], **options)[0]

    unfinished = [j for j in range(len(prompts)) if j not in finished]
    in_rows = set(generator.last_stats.in_rows) if generator.last_stats is not None else set()
    alone = [j for j in unfinished if j in in_rows] or unfinished
    yield from ((part[j], out) for j, out in _retry_one_by_one(failure, generate_one, alone))
    rest = [part[j] for j in unfinished if j not in set(alone)]
    if rest:
        yield from _static_results(generator, pending, batch_size, max_new_tokens, max_length, stop_ids, pad_id,
                                   temperature, top_p, seed, part=rest)


def regenerate(prompts: list[Prompt], adapter: Any, journal_path: str | Path, max_length: int,
               max_new_tokens: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, show_progress: bool = True, *, engine: str, compile_step: bool = False,
               refill: bool, decode_attention: str, target: dict | None = None,
               template_kwargs: dict[str, Any] | None = None, sampled_share: float = 1.0,
               prompt_tokens: list[list[int]] | None = None) -> dict:
    """Answer every prompt with the target; returns {"total", "done", "skipped", "failed", "stale", ...}.

    Prompts already done in the journal are not generated again, unless their templated tokens changed since
    (counted as "stale" and answered again). target: the target's identity (a JSON-able dict, e.g. its config),
    recorded in the journal header; a journal written for another target, or without a recorded target while one
    is given now, is of other settings: it is moved aside (journal.switch_journal) and these settings' own journal,
    if one was moved aside earlier, is used. None (unknown) matches only a journal that records none.
    template_kwargs: the chat template's options for the prompts (enable_thinking...). prompt_tokens: each prompt's
    templated ids (prompt_ids_many with the same options), in the order of `prompts`, when the caller already has
    them; None: templated here.
    A prompt whose templated length + 1 exceeds max_length is skipped (no room for a response); a batch whose
    generation raises is retried prompt by prompt and the prompts that still raise are counted as failed with
    their error. Responses are cut so that prompt + response <= max_length. Greedy when temperature == 0.
    sampled_share < 1 with temperature > 0: only the prompts answer_is_sampled() picks (that share of them) are
    sampled, the others answered greedily; the share is then part of the journal's header.

    engine: "hf" (model.generate over batches of `batch_size`), "static" (static_decode: static KV cache + CUDA
    graphs; every prompt in one stream whose `batch_size` rows are refilled as answers end, journaled as they
    finish) or "auto" (static on a CUDA target it supports, else hf). Both give the same greedy tokens in
    float32, so the journal does not record which one ran. compile_step: the static engine also runs its decode
    step through torch.compile. refill=False: the static engine runs plain batches (a batch ends with its longest
    answer), for comparison. decode_attention: the static engine's decode attention (StaticGenerator's
    `attention`: sdpa, flex or auto); the same tokens either way up to float rounding. show_progress: a bar that
    moves with the generated tokens (GenerationProgress).
    """
    _check_settings(max_length, max_new_tokens, batch_size, temperature, top_p, sampled_share)
    engine = resolve_engine(engine, adapter)
    _check_unique_ids(prompts)
    stop_ids = _stop_ids(adapter)
    pad_id = adapter.tokenizer.pad_token_id if adapter.tokenizer.pad_token_id is not None else stop_ids[0]
    settings = {"max_length": max_length, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "seed": seed, "stop_token_ids": stop_ids, "vocab": len(adapter.tokenizer)}
    stop_strings = adapter.stop_strings()
    if stop_strings:  # absent otherwise: journals written before it stay valid
        settings["stop_strings"] = stop_strings
    if mixes_answers(temperature, sampled_share):  # absent otherwise: journals written before it stay valid
        settings["sampled_share"] = sampled_share
    # Greedy answers do not depend on the seed or top_p: a journal of other values answers the same.
    unused = ("seed", "top_p") if temperature == 0 else ()
    journal, done_hashes = open_journal(Path(journal_path), with_target(settings, target), unused)
    with journal:  # closed on every exit, a template or engine error included
        static = StaticGenerator(adapter, compile_step=compile_step, refill=refill,
                                 attention=decode_attention) if engine == "static" else None
        started = time.perf_counter()
        if prompt_tokens is None:
            prompt_tokens = prompt_ids_many(adapter.tokenizer, [p.messages for p in prompts], template_kwargs,
                                            [p.id for p in prompts])
        elif len(prompt_tokens) != len(prompts):
            raise ValueError(f"prompt_tokens holds {len(prompt_tokens)} prompts' ids for {len(prompts)} prompts")
        work = _sort_out(prompts, prompt_tokens, done_hashes, max_length)
        work.template_seconds = time.perf_counter() - started
        _mark_stale(journal, work.stale)
        _warn_skipped(work.skipped, max_length)
        if work.reused and work.pending:  # a stage resumed after a stop: the bar counts only what is left
            logger.info("[data] %d answer(s) kept from the journal (%s); answering the other %d", work.reused,
                        journal_path, len(work.pending))
        arguments = (work.pending, batch_size, max_new_tokens, max_length, stop_ids, pad_id)
        with GenerationProgress("regenerate", "answers", show_progress) as progress:
            progress.expect(dict(enumerate(_budgets(work.pending, max_new_tokens, max_length))))

            def part_results(part: list[int], part_temperature: float):
                if static is None:
                    return _hf_results(adapter, *arguments, part_temperature, top_p, seed, progress, part=part)
                return _static_results(static, *arguments, part_temperature, top_p, seed, part=part)

            parts = _answer_parts(work.pending, temperature, sampled_share, seed)
            results = itertools.chain.from_iterable(part_results(part, t) for t, part in parts if part)
            def cut(tokens: list[int], budget: int) -> tuple[list[int], str]:
                return cut_response(tokens, set(stop_ids), budget, stop_strings, adapter.tokenizer)

            tally = _journal_answers(journal, work.pending, results, cut, max_length, batch_size, progress)
    return _stats(len(prompts), engine, work, tally)


def _check_settings(max_length: int, max_new_tokens: int, batch_size: int, temperature: float, top_p: float,
                    sampled_share: float) -> None:
    if max_length < 2 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"need max_length >= 2, max_new_tokens >= 1, batch_size >= 1; got {max_length}, "
                         f"{max_new_tokens}, {batch_size}")
    if temperature < 0 or not 0 < top_p <= 1 or not 0 <= sampled_share <= 1:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and 0 <= sampled_share <= 1; got {temperature}, "
                         f"{top_p}, {sampled_share}")


def _check_unique_ids(prompts: list[Prompt]) -> None:
    counts = Counter(p.id for p in prompts)
    if len(counts) != len(prompts):
        raise ValueError(f"prompt ids must be unique; duplicates: {[i for i, n in counts.items() if n > 1][:5]}")


def _stop_ids(adapter: Any) -> list[int]:
    stop_ids = [int(t) for t in adapter.stop_token_ids()]
    if not stop_ids:
        raise ValueError("adapter.stop_token_ids() is empty: generation would never stop")
    return stop_ids


@dataclass
class _Work:
    """The prompts sorted out against the journal's done records."""

    reused: int = 0  # done in the journal for the same tokens
    stale: list[Prompt] = field(default_factory=list)  # done for other tokens: answered again
    skipped: list[tuple[str, int]] = field(default_factory=list)  # (id, templated length): no room for an answer
    pending: list[tuple[Prompt, list[int]]] = field(default_factory=list)  # (prompt, its ids) to answer
    template_seconds: float = 0.0  # templating the prompts, or sorting them out when their ids were given


def _sort_out(prompts: list[Prompt], prompt_tokens: list[list[int]], done_hashes: dict[str, str | None],
              max_length: int) -> _Work:
    """Sort every templated prompt out: reused, skipped or pending (longest first), stale ones noted."""
    work = _Work()
    for p, ids_p in zip(prompts, prompt_tokens):
        if p.id in done_hashes:
            # A record from before hashes (None) is checked by its length when the dataset is encoded.
            if done_hashes[p.id] in (None, prompt_hash(ids_p)):
                work.reused += 1
                continue
            work.stale.append(p)
        if len(ids_p) + 1 > max_length:
            work.skipped.append((p.id, len(ids_p)))
        else:
            work.pending.append((p, ids_p))
    # Longest first: similar lengths share a batch (less padding) and memory trouble shows up at once.
    work.pending.sort(key=lambda item: -len(item[1]))
    return work


def _mark_stale(journal: Any, stale: list[Prompt]) -> None:
    """Journal a "stale" line for each prompt whose tokens changed since it was answered."""
    if not stale:
        return
    # Marked first, so that whatever happens to the new answer the old one is never taken for this prompt.
    logger.warning("[data] %d prompt(s) changed since they were answered (e.g. %s): answering them again",
                   len(stale), ", ".join(p.id for p in stale[:5]))
    append_lines(journal, [{"id": p.id, "prompt_set": p.prompt_set, "status": "stale"} for p in stale])


def _warn_skipped(skipped: list[tuple[str, int]], max_length: int) -> None:
    if skipped:
        logger.warning("[data] skipped %d prompt(s) longer than data.max_length - 1 = %d tokens, e.g. %s",
                       len(skipped), max_length - 1, ", ".join(f"{i} ({n} tokens)" for i, n in skipped[:5]))


@dataclass
class _Tally:
    """What the engine's results came to: answers journaled as done, their tokens, the failed prompts."""

    done: int = 0
    tokens: int = 0
    failures: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _journal_answers(journal: Any, pending: list[tuple[Prompt, list[int]]],
                     results: Iterator[tuple[int, list[int] | Exception]],
                     cut: Callable[[list[int], int], tuple[list[int], str]], max_length: int, batch_size: int,
                     progress: GenerationProgress) -> _Tally:
    """Journal every result (index into pending, new tokens or the exception) as done or failed, in groups of
    `batch_size` (JournalBuffer), each answer cut (new tokens, budget) at its end, and end it on the progress
    bar."""
    tally, buffer = _Tally(), JournalBuffer(journal, every=batch_size)
    started = time.perf_counter()
    try:
        for i, out in results:
            p, ids_p = pending[i]
            if isinstance(out, Exception):
                error = f"{type(out).__name__}: {out}"
                tally.failures.append({"id": p.id, "error": error})
                buffer.add({"id": p.id, "prompt_set": p.prompt_set, "status": "failed", "error": error})
                progress.end(i, 0)
                continue
            response, finish = cut(out, max_length - len(ids_p))
            buffer.add({"id": p.id, "prompt_set": p.prompt_set, "status": "done", "prompt_len": len(ids_p),
                        "prompt_hash": prompt_hash(ids_p), "response_ids": response, "finish": finish})
            tally.done += 1
            tally.tokens += len(response)
            progress.end(i, len(response))
        buffer.write()
        tally.seconds = time.perf_counter() - started
    finally:
        # Finished answers are kept even when the run stops by an exception (Ctrl-C included); only a hard kill
        # loses the last unwritten batch's worth, which the next run regenerates.
        if buffer.lines:
            buffer.write()
    return tally


def _stats(total: int, engine: str, work: _Work, tally: _Tally) -> dict:
    seconds = tally.seconds
    stats = {"total": total, "done": work.reused + tally.done, "skipped": len(work.skipped),
             "failed": len(tally.failures), "stale": len(work.stale), "generated": tally.done,
             "errors": tally.failures, "engine": engine, "generated_tokens": tally.tokens,
             "generate_seconds": round(seconds, 3), "template_seconds": round(work.template_seconds, 3),
             # Kept response tokens per second of generation (what the data stage needs; work past a stop excluded).
             "generate_tokens_per_s": round(tally.tokens / seconds, 1) if seconds > 0 else None}
    assert stats["done"] + stats["skipped"] + stats["failed"] == stats["total"], stats
    if tally.failures:
        logger.warning("%d prompt(s) failed, e.g. %s: %s", len(tally.failures), tally.failures[0]["id"],
                       tally.failures[0]["error"])
    return stats
