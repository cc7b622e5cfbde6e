"""Prompts written by the target itself (Magpie-style): more, and more topical, training prompts.

The target is given its own chat template up to the start of a user turn (after a system message that steers the
topic, e.g. "You are a Python programming assistant.") and samples the user turn; the non-degenerate ones become
prompts that the data stage answers greedily as usual. Generation runs on the data stage's engines
(inference/generation.py, inference/static_decode.py); nothing here decodes tokens itself.

Draw k of system prompt i has the id "syn-<i>-<k>" and its own seed; a kept draw's prompt id adds a digest of
its text ("syn-<i>-<k>-<sha1[:8]>"). The static engine samples each draw from its
own stream; plain HF `generate` samples a fixed group of `batch_size` draws from one seed. Either way a draw's text
depends only on the settings, so every run draws the same texts.

Journal (append-only JSON lines, resumable as regenerate's): a header {"header": {...settings}} first, then one
line per draw: {"id", "status": "done", "system", "k", "seed", "text", "tokens", "finish", "verdict"}, where
verdict is "ok" or why the draw alone is dropped ("length": cut at max_new_tokens, "empty", "short", "special":
still holds a chat-template special token). Duplicates depend on the other draws, so they are resolved when the
prompts are chosen: in (system, k) order, a text equal to an earlier kept one (case and whitespace aside) is a
"duplicate"; ok draws past a system prompt's quota are "surplus".
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from dflash.config.errors import ConfigError
from dflash.inference.generation import batch_seed, cut_response, generation_config, hf_generate
from dflash.data.journal import JournalBuffer, open_journal, read_journal, switch_journal, with_target
from dflash.data.progress import GenerationProgress
from dflash.data.prompts import Prompt
from dflash.inference.static_decode import StaticGenerator, resolve_engine
from dflash.models.targets.chat_template import PLAIN_TEMPLATES

logger = logging.getLogger(__name__)

PROMPT_SET = "synthetic"
# Stands in for the user's text when the chat template is rendered; the prefix is everything before it.
MARKER = "\u27e6dflash-synthetic-user-turn\u27e7"
DROP_REASONS = ("length", "empty", "short", "special", "duplicate", "surplus")


def steering_prefixes(tokenizer: Any, system_prompts: list[str]) -> list[str]:
    """user_turn_prefix of each system prompt, before any draw; a template that cannot render one (its own error, as
    Gemma's "System role not supported", or one of user_turn_prefix's) is a ConfigError naming that prompt."""
    prefixes = []
    for i, system_prompt in enumerate(system_prompts):
        try:
            prefixes.append(user_turn_prefix(tokenizer, system_prompt))
        except Exception as err:  # noqa: BLE001 - a template's own error (jinja) too, named with its prompt
            fix = " (or '' for the template's default system message)" if system_prompt else ""
            raise ConfigError(f"data.synthetic.system_prompts[{i}]={system_prompt!r}: the chat template cannot "
                              f"start a user turn after it ({type(err).__name__}: {err}); change the "
                              f"system prompt{fix} or the template (target.chat_template)") from err
    return prefixes


def user_turn_prefix(tokenizer: Any, system_prompt: str) -> str:
    """The chat template's text up to where a user turn's content starts, after `system_prompt` (none when "")."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": MARKER}], tokenize=False)
    if text.count(MARKER) != 1:
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} renders the user's "
                         f"text {text.count(MARKER)} times, not once: cannot find where a user turn starts")
    prefix = text[: text.index(MARKER)]
    if system_prompt and system_prompt not in prefix:
        raise ValueError(f"the chat template dropped the system prompt {system_prompt!r}: it cannot steer the topic")
    return prefix


def refuse_plain_format(tokenizer: Any, count: int, journal_path: Path, settings: dict, quota: list[int],
                        caps: list[int]) -> None:
    """ConfigError naming data.synthetic.count when the target's prompts take the plain format (it has no chat
    template) and a draw is still to be made: its user turns end in text ("\n\nAssistant:"), never in a stop
    token, so every draw would run to max_new_tokens and be dropped. A journal of these `settings` that already
    holds every draw the selection considers is only read, so a folder drawn to the end is not refused."""
    if getattr(tokenizer, "chat_template", None) not in PLAIN_TEMPLATES:
        return
    header, records = read_journal(journal_path) if journal_path.exists() else (None, {})

    def refuse(missing: list[tuple[int, int]]) -> None:
        raise ConfigError(f"data.synthetic.count={count}: the target has no chat template, so its prompts take the "
                          "plain 'User: ... / Assistant:' format, where a user turn the target writes never ends in "
                          "a stop token; set data.synthetic.count=0, or target.chat_template=<a template file>")

    settle(records if header == settings else {}, quota, caps, refuse)


def prompt_id(record: dict) -> str:
    """A kept draw's prompt id: its draw id plus a digest of its text. The answer journal is keyed by prompt id, so
    a draw id whose text changed (a new synthetic journal under other system prompts) never reuses an answer."""
    return f"{record['id']}-{hashlib.sha1(record['text'].encode('utf-8')).hexdigest()[:8]}"


def quotas(count: int, parts: int) -> list[int]:
    """`count` split over `parts` as evenly as possible, the first ones taking the remainder."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def judge(tokens: list[int], tokenizer: Any, stop_ids: set[int], min_chars: int) -> tuple[str, str, str]:
    """(text, finish, verdict) of a draw's new tokens: verdict "ok" or the reason the draw alone is dropped."""
    finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
    body = tokens[:-1] if finish == "stop" else tokens
    text = tokenizer.decode(body, skip_special_tokens=False).strip()
    if finish == "length":
        verdict = "length"
    elif not text:
        verdict = "empty"
    elif len(text) < min_chars:
        verdict = "short"
    elif any(special in text for special in _special_tokens(tokenizer)):
        verdict = "special"
    else:
        verdict = "ok"
    return text, finish, verdict


def _special_tokens(tokenizer: Any) -> set[str]:
    """Every special or added token's text (chat-template markers such as <|im_start|> are added tokens)."""
    return {t for t in set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()) if t}


def select_draws(records: dict[str, dict], wants: list[int], quota: list[int]) -> tuple[list[list[dict]], Counter]:
    """The kept draws of each system prompt among draws k < wants[i], and the count of every verdict."""
    seen: set[str] = set()
    kept: list[list[dict]] = [[] for _ in quota]
    verdicts: Counter = Counter()
    for i, want in enumerate(wants):
        for k in range(want):
            record = records[f"syn-{i}-{k}"]
            verdict = record["verdict"]
            if verdict == "ok":
                key = _normalise(record["text"])
                if key in seen:
                    verdict = "duplicate"
                elif len(kept[i]) >= quota[i]:
                    verdict = "surplus"
                else:
                    seen.add(key)
                    kept[i].append(record)
                    verdict = "kept"
            verdicts[verdict] += 1
    return kept, verdicts


def settle(records: dict[str, dict], quota: list[int], caps: list[int],
           draw: Callable[[list[tuple[int, int]]], None]) -> tuple[list[list[dict]], Counter, list[int]]:
    """The selection in rounds: each system prompt considers its quota of draws, then more while draws are dropped
    (_next_wants), up to its cap; draw(missing) puts the (system index, k) draws a round considers and `records`
    lacks into `records`. Returns (kept draws per system prompt, count of every verdict, draws considered)."""
    wants = list(quota)
    while True:
        missing = [(i, k) for i, want in enumerate(wants) for k in range(want) if f"syn-{i}-{k}" not in records]
        if missing:
            draw(missing)
        kept, verdicts = select_draws(records, wants, quota)
        grown = _next_wants(kept, wants, quota, caps)
        if grown == wants:
            return kept, verdicts, wants
        wants = grown


def _next_wants(kept: list[list[dict]], wants: list[int], quota: list[int], caps: list[int]) -> list[int]:
    """Draws to consider next: a short system prompt draws its shortfall scaled by its observed keep rate, up to its
    cap. Equal to `wants` when nothing more can or need be drawn."""
    grown = []
    for got, want, need, cap in zip(map(len, kept), wants, quota, caps):
        short = need - got
        extra = 0 if short <= 0 else max(short, math.ceil(short * want / max(got, 1)))
        grown.append(min(cap, want + extra))
    return grown


class _Drawer:
    """Samples user turns with the data stage's engines and journals each draw as it finishes."""

    def __init__(self, adapter: Any, engine: str, decode_attention: str, prefix_ids: list[list[int]], journal: Any,
                 records: dict, settings: dict, batch_size: int, progress: GenerationProgress) -> None:
        self.adapter, self.engine, self.prefix_ids = adapter, engine, prefix_ids
        self.decode_attention = decode_attention
        self.records, self.progress = records, progress
        self.settings, self.batch_size = settings, batch_size
        self.stop_ids = settings["stop_token_ids"]
        tokenizer = adapter.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.static: StaticGenerator | None = None
        # Journal every batch's worth of draws, or every few seconds: a killed run loses little.
        self.buffer = JournalBuffer(journal, every=batch_size)
        self.new_tokens, self.seconds = 0, 0.0

    def draw(self, missing: list[tuple[int, int]]) -> None:
        """Draw every (system index, k) in `missing` and journal them."""
        started = time.perf_counter()
        if self.engine == "static" and self.static is None:
            self.static = StaticGenerator(self.adapter, attention=self.decode_attention)
        drawn = missing if self.engine == "static" else self._hf_draws(missing)
        self.progress.expect({f"syn-{i}-{k}": self.settings["max_new_tokens"] for i, k in drawn})
        try:
            results = self._static(missing) if self.engine == "static" else self._hf(missing)
            for (i, k), seed, tokens in results:
                self._record(i, k, seed, tokens)
        finally:
            self.buffer.write()
            self.seconds += time.perf_counter() - started

    def _static(self, missing: list[tuple[int, int]]):
        seeds = [batch_seed(self.settings["seed"], [f"syn-{i}-{k}"]) for i, k in missing]
        stream = self.static.stream(
            [self.prefix_ids[i] for i, _ in missing], max_new_tokens=self.settings["max_new_tokens"],
            stop_token_ids=self.stop_ids, pad_id=self.pad_id, batch_size=self.batch_size,
            temperature=self.settings["temperature"], top_p=self.settings["top_p"], prompt_seeds=seeds)
        for index, tokens in stream:
            yield missing[index], seeds[index], tokens

    def _hf(self, missing: list[tuple[int, int]]):
        """model.generate over whole groups of `batch_size` draws of one system prompt (all rows the same prompt,
        so no padding), one seed per group. A group is drawn whole, so all its draws are journaled (later rounds
        find them there), even those past what is needed now; a group cut by a crash is drawn again whole."""
        size = self.batch_size
        config = generation_config(self.settings["max_new_tokens"], self.stop_ids, self.pad_id,
                                    self.settings["temperature"], self.settings["top_p"])
        for i, group in self._hf_groups(missing):
            ids = [f"syn-{i}-{k}" for k in range(group * size, (group + 1) * size)]
            seed = batch_seed(self.settings["seed"], ids)
            outputs = hf_generate(self.adapter, [self.prefix_ids[i]] * size, config, self.pad_id, seed,
                                  self.progress.streamer(ids, self.stop_ids))
            for k, tokens in enumerate(outputs, start=group * size):
                if f"syn-{i}-{k}" not in self.records:
                    yield (i, k), seed, tokens

    def _hf_groups(self, missing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(system index, group) of the hf groups that hold the `missing` draws."""
        return sorted({(i, k // self.batch_size) for i, k in missing})

    def _hf_draws(self, missing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The draws that _hf journals for `missing`: every draw of their groups not journaled yet."""
        size = self.batch_size
        return [(i, k) for i, group in self._hf_groups(missing) for k in range(group * size, (group + 1) * size)
                if f"syn-{i}-{k}" not in self.records]

    def _record(self, i: int, k: int, seed: int, tokens: list[int]) -> None:
        tokens, _ = cut_response(tokens, set(self.stop_ids), self.settings["max_new_tokens"])
        text, finish, verdict = judge(tokens, self.adapter.tokenizer, set(self.stop_ids), self.settings["min_chars"])
        record = {"id": f"syn-{i}-{k}", "status": "done", "system": i, "k": k, "seed": seed, "text": text,
                  "tokens": len(tokens), "finish": finish, "verdict": verdict}
        self.records[record["id"]] = record
        self.buffer.add(record)
        self.new_tokens += len(tokens)
        self.progress.end(record["id"], len(tokens))


def synthesize_prompts(adapter: Any, count: int, system_prompts: list[str], journal_path: str | Path, *,
                       temperature: float, top_p: float, max_new_tokens: int, min_chars: int, batch_size: int,
                       engine: str, decode_attention: str, max_oversample: float, keep_system: bool, seed: int = 0,
                       show_progress: bool = True, target: dict | None = None) -> tuple[list[Prompt], dict]:
    """`count` user prompts written by the target, spread evenly over `system_prompts`; returns (prompts, stats).

    A system prompt "" means no system message (the template's default, if any). Each system prompt draws its
    quota, then more while draws are dropped, at most ceil(quota * max_oversample) in all; if that is not enough
    it keeps fewer (stats["kept"] < count, with a warning). Prompts are Prompt("syn-<i>-<k>-<text digest>" (prompt_id),
    [system, user], "synthetic") in (system, k) order; keep_system=False leaves the steering system message out of them.
    engine: as regenerate's ("auto" = static on a supported CUDA target, else hf); batch_size rows decode at once;
    decode_attention: the static engine's decode attention, as regenerate's.
    A rerun with the same settings reuses the journal and draws the same texts; a journal of other settings is
    moved aside, and comes back when they do (journal.switch_journal). target: the target's identity (a JSON-able
    dict such as its config), recorded in the journal header, so that another target's draws are not reused; None
    (unknown) matches only a journal that records none.
    """
    if count < 0 or not system_prompts:
        raise ValueError(f"need count >= 0 and at least one system prompt; got {count}, {system_prompts!r}")
    if temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature > 0 (greedy writes one text per system prompt) and 0 < top_p <= 1; "
                         f"got {temperature}, {top_p}")
    if max_new_tokens < 1 or batch_size < 1 or max_oversample < 1:
        raise ValueError(f"need max_new_tokens >= 1, batch_size >= 1, max_oversample >= 1; got {max_new_tokens}, "
                         f"{batch_size}, {max_oversample}")
    tokenizer = adapter.tokenizer
    engine = resolve_engine(engine, adapter)
    stop_ids = [int(t) for t in adapter.stop_token_ids()]
    if not stop_ids:
        raise ValueError("adapter.stop_token_ids() is empty: a user turn would never end")
    prefixes = steering_prefixes(tokenizer, system_prompts)
    prefix_ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prefixes]
    # What decides the texts. Under hf the group of draws sharing a seed is batch_size long, so it counts too.
    settings = {"kind": "synthetic prompts", "prefixes": prefixes, "temperature": temperature, "top_p": top_p,
                "max_new_tokens": max_new_tokens, "min_chars": min_chars, "seed": seed, "engine": engine,
                "hf_group": batch_size if engine == "hf" else None, "stop_token_ids": stop_ids,
                "vocab": len(tokenizer)}
    settings = with_target(settings, target)
    journal_path = Path(journal_path)
    quota = quotas(count, len(system_prompts))
    caps = [max(q, math.ceil(q * max_oversample)) for q in quota]
    # data.engine and data.batch_size are speed settings: draws journaled under another engine or group stay valid
    # (new draws follow the new ones), so their journal is kept for them.
    unused = ("engine", "hf_group")
    switch_journal(journal_path, settings, unused)  # these settings' draws, if journaled, are what the refusal reads
    refuse_plain_format(tokenizer, count, journal_path, settings, quota, caps)  # before the journal is written
    journal, _ = open_journal(journal_path, settings, unused)
    with journal:
        _, records = read_journal(journal_path)
        journaled = set(records)
        progress = GenerationProgress("synthesize prompts", "draws", show_progress)
        drawer = _Drawer(adapter, engine, decode_attention, prefix_ids, journal, records, settings, batch_size,
                         progress)
        try:
            kept, verdicts, wants = settle(records, quota, caps, drawer.draw)
        finally:
            progress.close()

    prompts = []
    for i, chosen in enumerate(kept):
        system = [{"role": "system", "content": system_prompts[i]}] if system_prompts[i] and keep_system else []
        prompts += [Prompt(prompt_id(r), system + [{"role": "user", "content": r["text"]}], PROMPT_SET)
                    for r in chosen]
    considered = [f"syn-{i}-{k}" for i, want in enumerate(wants) for k in range(want)]
    stats = {"requested": count, "kept": len(prompts), "per_system": [len(c) for c in kept], "draws": len(considered),
             "reused": sum(pid in journaled for pid in considered),
             "dropped": {r: verdicts[r] for r in DROP_REASONS if verdicts[r]},
             "engine": engine, "generated_tokens": drawer.new_tokens, "generate_seconds": round(drawer.seconds, 3),
             "generate_tokens_per_s": round(drawer.new_tokens / drawer.seconds, 1) if drawer.seconds > 0 else None}
    if len(prompts) < count:
        logger.warning("synthesized %d of %d prompts after %d draws (at most %.1f per prompt); dropped: %s",
                       len(prompts), count, stats["draws"], max_oversample, format_dropped(stats["dropped"]))
    return prompts, stats


DROP_WORDS = {"length": "too long", "empty": "empty", "short": "too short", "special": "with special tokens",
              "duplicate": "duplicates", "surplus": "surplus"}


def format_dropped(dropped: dict[str, int]) -> str:
    """'710 too long, 2 too short' of a draws' drop counts by reason."""
    return ", ".join(f"{count:,} {DROP_WORDS.get(reason, reason)}" for reason, count in dropped.items() if count)


def format_synthetic(stats: dict) -> str:
    """synthesize_prompts' stats in one line: prompts kept, draws, why the others were dropped, the generation rate."""
    dropped = format_dropped(stats.get("dropped", {}))
    line = f"{stats['kept']:,} of {stats['requested']:,} kept from {stats['draws']:,} draws"
    if stats.get("reused"):
        line += f" ({stats['reused']:,} from the journal)"
    if dropped:
        line += f"; dropped: {dropped}"
    if stats.get("generated_tokens") and stats.get("generate_tokens_per_s"):
        line += f"; {stats['generated_tokens']:,} tokens at {stats['generate_tokens_per_s']:,.1f} tok/s"
    return line
