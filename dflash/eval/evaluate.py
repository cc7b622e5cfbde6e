"""Evaluate a drafter against its target per prompt set: by exact replay (replay.py) or live decoding (live.py).

Summary schema (summary.json, schema_version 2; docs/eval.md):
    {"schema_version": 2, "mode": "replay"|"live", "temperature": T, "draft_sampling": "sampled"|"greedy",
     "block_size": B, "max_new_tokens": N, "prompt_sets": {name: metrics}, "overall": metrics}
    (+ "categories": {set: {category: metrics}} for labelled sets such as MT-Bench, "both_turns": {set: metrics}
    pooling a set and its "<set>_turn2" as the method's authors' benchmark pools MT-Bench's turns (it prints the
    mean over responses, our tau_prompt_mean), "live_engine": "hf"|"static" in live mode (the target engine that
    ran, live.py), "estimate": what was estimated, in replay mode at T > 0 (replay_estimate.py: the metrics are
    expectations, num_steps and the counts fractional), and "chat_template_kwargs" when the pipeline writes it)
where metrics = acceptance_metrics(...) (tau, tau_prompt_mean, acceptance_rate, per_position,
committed_histogram, num_prompts, num_steps, num_tokens, num_accepted, num_drafted) plus, in replay mode,
greedy_mismatches, and in live mode the timings: speculative_seconds, speculative_new_tokens,
speculative_tokens_per_s and, when the target-only baseline ran, target_seconds, target_new_tokens,
target_tokens_per_s, speedup and (T=0) lossless_mismatches; the speedup's factors: speculative_steps,
speculative_prefill_seconds, speculative_ms_per_step (after the prefill), speculative_prefill_tokens (each
prompt's first token, its prefill's), tokens_per_step (the other new tokens per step) and, with the
baseline, target_steps, target_prefill_seconds, target_ms_per_step and step_cost, a speculative step's cost in
target-only steps (speedup ~ tokens_per_step / step_cost, the prefills making up the rest). summary.csv has
one row per prompt set, per "<set>_both_turns", "overall", then one per "set/category"; prompts.csv one per prompt
(prompt_rows: the summary's "per_prompt", which summary.json leaves out).
"timing" (PhaseTimer.summary, metrics.py) says where the wall time went: {"seconds": {phase: s}, "total_seconds",
"prompt_sets": {set: {phase: s}}}; phases: "load_prompts" and "turn2_answers" (when load_prompt_sets got the same
timer), "generate", "target_pass", "draft", "accept" (replay), "live_warmup", "live_speculative",
"live_target_only" (live).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from dflash.config.errors import ConfigError
from dflash.config.schema import TURN2_SUFFIX, PromptSetSettings
from dflash.inference.static_decode import resolve_engine
from dflash.eval.expected_acceptance import ExpectedTrace, expected_metrics
from dflash.eval.metrics import PhaseTimer, acceptance_metrics
from dflash.eval.plots import plot_committed_histogram, plot_per_position
from dflash.eval.live import live_decode, target_only_decode
from dflash.eval.replay import replay
from dflash.eval.replay_estimate import replay_estimate
from dflash.inference.sampling import DRAFT_SAMPLING
from dflash.models.drafter import DFlashDraftModel
from dflash.run_files import write_text

SCHEMA_VERSION = 2
# What write_summary leaves in an evaluation's folder.
SUMMARY_FILES = ("summary.json", "summary.csv", "prompts.csv", "per_position.png", "committed_histogram.png")
# The summary's per-prompt rows (prompt_rows), written to prompts.csv, not to summary.json.
PER_PROMPT = "per_prompt"
PROMPT_COLUMNS = ("prompt_set", "index", "id", "category", "steps", "tokens", "tau", "accepted", "drafted",
                  "acceptance_rate")


def check_compatible(drafter: DFlashDraftModel, adapter) -> None:
    """Raise ValueError when the drafter was not built for this target (hidden size, taps, mask id)."""
    config = drafter.config
    if config.hidden_size != adapter.hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} != target hidden_size {adapter.hidden_size}")
    if config.num_target_layers != adapter.num_layers:
        raise ValueError(
            f"drafter was built for a target with {config.num_target_layers} layers, this target has "
            f"{adapter.num_layers}"
        )
    if not 0 <= config.mask_token_id < adapter.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {config.mask_token_id} is outside the target vocabulary ({adapter.vocab_size})"
        )


def live_engine_of(live_engine: str, adapter) -> str:
    """The engine live decoding runs this target on, "hf" or "static" ("auto" resolved); ConfigError naming
    eval.live_engine when the engine asked for cannot decode this target."""
    try:
        return resolve_engine(live_engine, adapter)
    except ValueError as error:
        raise ConfigError(f"eval.live_engine={live_engine}: {error}") from None


MODES = ("replay", "live")


def load_prompt_sets(
    adapter, specs: Mapping[str, PromptSetSettings | Mapping[str, Any]], *, max_new_tokens: int,
    template_kwargs: dict[str, Any] | None = None,
    batch_size: int,
    timer: PhaseTimer | None = None,
) -> tuple[dict[str, list[list[int]]], dict[str, list[str]], dict[str, list[str]]]:
    """Token ids of every configured prompt set, category labels where the source has them, and the prompts' ids
    (a second turn's are its first turn's).

    specs: {name: PromptSetSettings} (eval.prompt_sets), or {name: {source, path?, limit?, turns?,
    answer_max_new_tokens?}} read as PromptSetSettings, its defaults for the keys left out. `turns: 2`
    (multi-turn sources such as mtbench) adds the set "<name>_turn2": the second user turn asked on top of the
    target's own greedy answer to the first (multiturn.py), whose answer has at most `answer_max_new_tokens`
    tokens (default: max_new_tokens), generated `batch_size` prompts at a time. Both sets keep the categories of
    the questions. `timer` (optional; pass the same one to `evaluate`) is charged with "load_prompts" (reading and
    chat-templating) and "turn2_answers" (the greedy first-turn answers), per set.
    """
    from dflash.data.prompts import SOURCES, load_prompts
    from dflash.eval.categories import prompt_categories
    from dflash.eval.multiturn import second_turn_conversations

    kwargs = template_kwargs or {}
    timer = timer if timer is not None else PhaseTimer()
    prompt_sets: dict[str, list[list[int]]] = {}
    categories: dict[str, list[str]] = {}
    ids: dict[str, list[str]] = {}
    for name, spec in specs.items():
        if isinstance(spec, Mapping):
            if "source" not in spec:  # PromptSetSettings would take its placeholder '???' for a source
                raise ValueError(f"eval prompt set {name!r} names no source (one of {', '.join(SOURCES)})")
            spec = PromptSetSettings(**spec)
        if spec.turns not in (1, 2):  # PromptSetSettings does not check it; EvalSettings does
            raise ValueError(f"eval prompt set {name!r}: turns must be 1 or 2, got {spec.turns}")
        with timer.for_prompt_set(name), timer.phase("load_prompts"):
            prompts = load_prompts(spec.source, path=spec.path, limit=spec.limit)
            labels = prompt_categories(spec.source, prompts, path=spec.path)
            prompt_sets[name] = [adapter.chat_ids(p.messages, **kwargs) for p in prompts]
        names = [name]
        if spec.turns == 2:
            second = name + TURN2_SUFFIX
            if second in specs:
                raise ValueError(f"eval prompt set {name!r} has turns: 2, which adds the set {second!r}, but a set "
                                 f"of that name is configured too; rename one")
            answer_tokens = first_turn_answer_tokens(spec, max_new_tokens)
            with timer.for_prompt_set(second), timer.phase("turn2_answers"):
                conversations = second_turn_conversations(adapter, prompts, max_new_tokens=answer_tokens,
                                                          template_kwargs=kwargs, batch_size=batch_size)
                prompt_sets[second] = [adapter.chat_ids(c, **kwargs) for c in conversations]
            names.append(second)
        if labels is not None:
            categories.update({n: labels for n in names})
        ids.update({n: [p.id for p in prompts] for n in names})
    return prompt_sets, categories, ids


def first_turn_answer_tokens(spec: PromptSetSettings, max_new_tokens: int) -> int:
    """The most tokens of the target's answer to a first turn that a `turns: 2` set asks its second turn on."""
    return max_new_tokens if spec.answer_max_new_tokens is None else spec.answer_max_new_tokens


def evaluate(
    drafter: DFlashDraftModel,
    adapter,
    prompt_sets: dict[str, list[list[int]]],
    *,
    max_new_tokens: int,
    batch_size: int,
    mode: str,
    measure_target: bool,
    live_engine: str,
    draft_sampling: str,
    show_progress: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
    categories: dict[str, list[str]] | None = None,
    timer: PhaseTimer | None = None,
    warm_up: bool = True,
    draft_temperature: float | None = None,
    prompt_ids: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Acceptance of `drafter` on each prompt set (token ids of chat-templated prompts).

    mode "replay": greedy (T=0) by exact replay over the target's continuation (replay.py), batched; at T > 0
    the expected acceptance along the target's continuations sampled at T with `seed` (replay_estimate.py), an
    estimate without sampling noise in the acceptance, named in summary["estimate"].
    mode "live": real speculative decoding with KV caches, one prompt at a time (live.py), at `temperature`
    (rejection sampling when > 0); with `measure_target` every prompt is also decoded target-only in the same
    process, which gives tokens/s of both and the speedup, and at T=0 `lossless_mismatches` (prompts whose
    speculative output differs from the target-only output; 0 expected).
    `categories[name]` (optional) labels each prompt of set `name`; the summary then has
    "categories": {name: {label: acceptance metrics}} (MT-Bench categories, categories.py). `prompt_ids[name]`
    (optional) names them in the per-prompt rows (prompt_rows).
    `timer`: pass the PhaseTimer that `load_prompt_sets` filled so loading shows in summary["timing"] too.
    `live_engine` (live mode): the target engine of both decodes, "auto" | "static" | "hf" (live.py).
    `warm_up` (live mode): first decode the first prompt briefly in both modes, untimed and uncounted
    (`_warm_up_live`), so the first timed decode does not pay one-off costs that later ones do not.
    `draft_sampling` (T>0): "sampled" (drafts drawn from softmax(z / draft_temperature), None: T, then rejection
    sampling, exact for any q) or "greedy" (the drafter's argmax, accepted with the target's probability of it: what
    vLLM and SGLang do); both recorded in the summary. T=0 verifies greedily either way.
    """
    _check_arguments(prompt_sets, mode, temperature, draft_sampling, draft_temperature, categories or {})
    check_compatible(drafter, adapter)
    engine = live_engine_of(live_engine, adapter) if mode == "live" else None  # before any prompt is decoded
    timer = timer if timer is not None else PhaseTimer(adapter.device)
    drafter.eval()
    block_size = drafter.config.block_size
    bar = _progress_bar(prompt_sets, mode) if show_progress else None
    generator = torch.Generator(device=adapter.device).manual_seed(seed) if mode == "live" else None
    drafts = dict(draft_sampling=draft_sampling, draft_temperature=draft_temperature)
    measure = functools.partial(
        _measure_set, drafter, adapter, mode=mode, max_new_tokens=max_new_tokens, batch_size=batch_size,
        temperature=temperature, generator=generator, measure_target=measure_target,
        progress=bar.update if bar is not None else None, timer=timer, engine=engine, seed=seed, **drafts)
    if mode == "live" and warm_up:
        first = next((prompts[0] for prompts in prompt_sets.values() if prompts), None)
        if first is not None:
            with timer.phase("live_warmup"):
                _warm_up_live(drafter, adapter, first, max_new_tokens=max_new_tokens, temperature=temperature,
                              seed=seed, measure_target=measure_target, engine=engine, **drafts)
    traces_of: dict[str, list] = {}
    extras_of: dict[str, dict[str, Any]] = {}
    try:
        for name, prompts in prompt_sets.items():
            if bar is not None:
                bar.set_postfix_str(name)
            with timer.for_prompt_set(name):
                traces_of[name], extras_of[name] = measure(prompts)
    finally:
        if bar is not None:
            bar.close()
    summary = _summary(traces_of, extras_of, block_size, mode=mode, temperature=temperature,
                       max_new_tokens=max_new_tokens, **drafts)
    if engine is not None:
        summary["live_engine"] = engine
    if categories:
        summary["categories"] = _category_metrics(categories, traces_of, block_size)
    summary["timing"] = timer.summary()
    summary[PER_PROMPT] = prompt_rows(traces_of, categories or {}, prompt_ids or {})
    return summary


def _progress_bar(prompt_sets: dict[str, list[list[int]]], mode: str):
    """A bar over every prompt of every set."""
    from tqdm import tqdm

    return tqdm(total=sum(len(p) for p in prompt_sets.values()), desc=f"eval ({mode})", unit="prompt")


def prompt_rows(traces_of: dict[str, list], categories: dict[str, list[str]],
                prompt_ids: dict[str, list[str]]) -> list[dict[str, Any]]:
    """One row per prompt of every set, in the set's order (PROMPT_COLUMNS): its id and category where known, the
    steps, the tokens they committed (tau = tokens / steps), the drafts accepted and those drafted; expectations
    (floats) in a replay estimate at T > 0. What a per-set figure hides: which prompts hold it down."""
    rows = []
    for name, traces in traces_of.items():
        labels = categories.get(name, [""] * len(traces))
        ids = prompt_ids.get(name, [""] * len(traces))
        for index, (trace, label, prompt_id) in enumerate(zip(traces, labels, ids)):
            if isinstance(trace, ExpectedTrace):
                steps, tokens, accepted, drafted = trace.steps, trace.committed, trace.accepted, trace.drafted
            else:
                steps, tokens = trace.num_steps, sum(trace.committed)
                accepted, drafted = sum(trace.accepted), sum(trace.drafted)
            rows.append({"prompt_set": name, "index": index, "id": prompt_id, "category": label, "steps": steps,
                         "tokens": tokens, "tau": tokens / steps if steps else None, "accepted": accepted,
                         "drafted": drafted, "acceptance_rate": accepted / drafted if drafted else None})
    return rows


def _check_arguments(prompt_sets: dict[str, list], mode: str, temperature: float, draft_sampling: str,
                     draft_temperature: float | None, categories: dict[str, list[str]]) -> None:
    if not prompt_sets:
        raise ValueError("prompt_sets is empty")
    if mode not in MODES:
        raise ValueError(f"unknown eval mode {mode!r}; use one of {list(MODES)}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature}")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    if draft_temperature is not None and not (math.isfinite(draft_temperature) and draft_temperature > 0):
        raise ValueError(f"draft_temperature must be a number > 0 or None, got {draft_temperature}")
    for name, labels in categories.items():
        if name not in prompt_sets or len(labels) != len(prompt_sets[name]):
            raise ValueError(f"categories[{name!r}] must label each of the prompts of prompt set {name!r}")


def _measure_set(drafter: DFlashDraftModel, adapter, prompts: list[list[int]], *, mode: str, max_new_tokens: int,
                 batch_size: int, temperature: float, generator: torch.Generator | None, measure_target: bool,
                 progress, timer: PhaseTimer, engine: str | None, draft_sampling: str,
                 draft_temperature: float | None, seed: int) -> tuple[list, dict[str, Any]]:
    """(step traces, extra counts) of one prompt set: by replay (expected traces at T > 0), or by live decoding."""
    if mode == "replay" and temperature > 0:
        traces = replay_estimate(drafter, adapter, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                 draft_sampling=draft_sampling, draft_temperature=draft_temperature, seed=seed,
                                 batch_size=batch_size, progress=progress,
                                 timer=timer)
        return traces, {}
    if mode == "replay":
        with torch.inference_mode():
            results = replay(drafter, adapter, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress, timer=timer)
        return [r.trace for r in results], {"greedy_mismatches": sum(r.greedy_mismatches for r in results)}
    return _live_set(drafter, adapter, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                     generator=generator, measure_target=measure_target, progress=progress, timer=timer,
                     engine=engine, draft_sampling=draft_sampling, draft_temperature=draft_temperature)


def _summary(traces_of: dict[str, list], extras_of: dict[str, dict[str, Any]], block_size: int,
             **header: Any) -> dict[str, Any]:
    """summary.json's measures: per prompt set, overall, and MT-Bench's turns pooled."""
    per_set = {name: {**_metrics(traces, block_size), **_finish(extras_of[name])}
               for name, traces in traces_of.items()}
    summary = {"schema_version": SCHEMA_VERSION, "mode": header["mode"], "temperature": header["temperature"],
               "draft_sampling": header["draft_sampling"], "block_size": block_size,
               "max_new_tokens": header["max_new_tokens"], "prompt_sets": per_set,
               "overall": _pooled_metrics(list(traces_of), traces_of, extras_of, block_size)}
    if header["draft_temperature"] is not None and header["temperature"] > 0 and header["draft_sampling"] == "sampled":
        summary["draft_temperature"] = header["draft_temperature"]
    if header["mode"] == "replay" and header["temperature"] > 0:
        summary["estimate"] = (f"expected acceptance at T={header['temperature']} ({header['draft_sampling']} "
                               f"drafts) along the target's continuations sampled at T, not a sampled decode: "
                               f"num_steps and the counts are expectations (docs/eval.md)")
    # Every turn of a multi-turn benchmark, pooled as the method's authors' benchmark pools them (it prints the
    # mean over responses of each response's tau: tau_prompt_mean here).
    both_turns = {name: _pooled_metrics([name, name + TURN2_SUFFIX], traces_of, extras_of, block_size)
                  for name in traces_of if name + TURN2_SUFFIX in traces_of}
    if both_turns:
        summary["both_turns"] = both_turns
    return summary


def _category_metrics(categories: dict[str, list[str]], traces_of: dict[str, list],
                      block_size: int) -> dict[str, dict[str, Any]]:
    """{prompt set: {label: acceptance metrics}} of the prompt sets whose prompts carry labels."""
    per_category = {}
    for name, labels in categories.items():
        groups: dict[str, list] = {}
        for label, trace in zip(labels, traces_of[name]):
            groups.setdefault(label, []).append(trace)
        per_category[name] = {label: _metrics(group, block_size) for label, group in sorted(groups.items())}
    return per_category


def _pooled_metrics(names: list[str], traces_of: dict[str, list], extras_of: dict[str, dict[str, Any]],
                    block_size: int) -> dict[str, Any]:
    """Acceptance metrics and summed timings of the prompt sets `names` taken as one."""
    traces = [trace for name in names for trace in traces_of[name]]
    pooled = {key: sum(extras_of[name][key] for name in names) for key in extras_of[names[0]]}
    return {**_metrics(traces, block_size), **_finish(pooled)}


def _metrics(traces: list, block_size: int) -> dict[str, Any]:
    """acceptance_metrics of step traces, or expected_metrics of expected ones (replay at T > 0)."""
    if traces and isinstance(traces[0], ExpectedTrace):
        return expected_metrics(traces, block_size)
    return acceptance_metrics(traces, block_size)


def _warm_up_live(drafter, adapter, prompt, *, max_new_tokens, temperature, seed, measure_target, engine,
                  draft_sampling, draft_temperature) -> None:
    """Decode `prompt` a little in both modes, results dropped: the first timed decode would otherwise pay the
    one-off costs (kernel loading, allocator growth, CUDA graph capture) that the target-only decode after it is
    spared. Every block size a timed step can draft and verify (2..block_size, the shorter ones being the last
    blocks near max_new_tokens) is met once, as the first step of a decode of that many new tokens. A generator
    of its own, so the timed decodes draw the same random numbers with or without it."""
    stop_ids = adapter.stop_token_ids()
    generator = torch.Generator(device=adapter.device).manual_seed(seed) if temperature > 0 else None
    # Largest first; a decode's later steps meet smaller sizes too (its trace says which: with no stop tokens
    # every step drafts size - 1 positions), so sizes already met are skipped. Stop tokens are ignored so that an
    # early stop cannot skip a size.
    unmet = set(range(2, min(max_new_tokens, drafter.config.block_size) + 1))
    while unmet:
        result = live_decode(drafter, adapter, prompt, max_new_tokens=max(unmet), stop_token_ids=[],
                             temperature=temperature, generator=generator, target_engine=engine,
                             draft_sampling=draft_sampling, draft_temperature=draft_temperature)
        unmet -= {drafted + 1 for drafted in result.trace.drafted}
    if measure_target:
        tokens = min(max_new_tokens, 2 * drafter.config.block_size)
        target_only_decode(adapter, prompt, max_new_tokens=tokens, stop_token_ids=stop_ids, temperature=temperature,
                           generator=generator, target_engine=engine)


def _live_set(drafter, adapter, prompts, *, max_new_tokens, temperature, generator, measure_target, progress,
              timer, engine, draft_sampling, draft_temperature):
    """Live-decode every prompt (and target-only when measure_target); traces plus summed timings."""
    stop_ids = adapter.stop_token_ids()
    traces = []
    extra = {"speculative_seconds": 0.0, "speculative_new_tokens": 0, "speculative_prefill_tokens": 0,
             "speculative_steps": 0, "speculative_prefill_seconds": 0.0}
    if measure_target:
        extra.update(target_seconds=0.0, target_new_tokens=0, target_steps=0, target_prefill_seconds=0.0)
        if temperature == 0:
            extra["lossless_mismatches"] = 0

    def target_only(prompt: list[int]):
        return target_only_decode(adapter, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                                  temperature=temperature, generator=generator, target_engine=engine)

    for index, prompt in enumerate(prompts):
        # A prompt's length is new to the allocator and to the kernels' per-shape caches: the first of its two
        # decodes meets its prefill cold, the second warm. Alternating which goes first gives neither mode the
        # warm half (with the speculative decode always first, its prefill took 61 ms a prompt against the
        # target's 20 on an H100, session 37).
        plain = target_only(prompt) if measure_target and index % 2 else None
        result = live_decode(drafter, adapter, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids,
                             temperature=temperature, generator=generator, target_engine=engine,
                             draft_sampling=draft_sampling, draft_temperature=draft_temperature)
        traces.append(result.trace)
        extra["speculative_seconds"] += result.seconds
        timer.add("live_speculative", result.seconds)
        extra["speculative_new_tokens"] += len(result.continuation)
        extra["speculative_prefill_tokens"] += min(len(result.continuation), 1)  # the first token: the prefill's
        extra["speculative_steps"] += result.trace.num_steps
        extra["speculative_prefill_seconds"] += result.prefill_seconds
        if measure_target:
            plain = plain if plain is not None else target_only(prompt)
            extra["target_seconds"] += plain.seconds
            timer.add("live_target_only", plain.seconds)
            extra["target_new_tokens"] += len(plain.continuation)
            extra["target_steps"] += plain.trace.num_steps
            extra["target_prefill_seconds"] += plain.prefill_seconds
            if temperature == 0:
                extra["lossless_mismatches"] += int(plain.continuation != result.continuation)
        if progress is not None:
            progress(1)
    return traces, extra


def _finish(extra: dict[str, Any]) -> dict[str, Any]:
    """Add tokens/s, the speedup (target-only time per token / speculative time per token) and its factors to
    timings: tokens per speculative step (the tokens the steps committed: each prompt's first token is its
    prefill's), and the cost of a speculative step in target-only decode steps
    (step_cost: wall ms per step after the prefill over wall ms per target-only step after its prefill, both
    measured in this run), so speedup ~ tokens_per_step / step_cost, the prefills making up the rest."""
    out = dict(extra)
    if "speculative_seconds" in out:
        out["speculative_tokens_per_s"] = _ratio(out["speculative_new_tokens"], out["speculative_seconds"])
        decoding = out["speculative_seconds"] - out["speculative_prefill_seconds"]
        out["speculative_ms_per_step"] = _ratio(1000 * decoding, out["speculative_steps"])
        out["tokens_per_step"] = _ratio(out["speculative_new_tokens"] - out["speculative_prefill_tokens"],
                                        out["speculative_steps"])
    if "target_seconds" in out:
        out["target_tokens_per_s"] = _ratio(out["target_new_tokens"], out["target_seconds"])
        spec, target = out["speculative_tokens_per_s"], out["target_tokens_per_s"]
        out["speedup"] = spec / target if spec and target else None
        decoding = out["target_seconds"] - out["target_prefill_seconds"]
        out["target_ms_per_step"] = _ratio(1000 * decoding, out["target_steps"])
        step, target_step = out["speculative_ms_per_step"], out["target_ms_per_step"]
        out["step_cost"] = _ratio(step, target_step) if step is not None and target_step is not None else None
    return out


def _ratio(amount: float, per: float) -> float | None:
    """amount / per, None when there is nothing to divide by."""
    return amount / per if per > 0 else None


CSV_COLUMNS = ("prompt_set", "tau", "tau_prompt_mean", "acceptance_rate", "num_prompts", "num_steps", "num_tokens",
               "num_accepted", "num_drafted", "greedy_mismatches", "speculative_tokens_per_s", "target_tokens_per_s",
               "speedup", "tokens_per_step", "step_cost", "lossless_mismatches")


def summary_csv(summary: dict[str, Any]) -> str:
    """The scalar metrics as CSV text: one row per prompt set, one per "<set>_both_turns", "overall", then one per
    "set/category"; empty cells where not measured."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    rows = _table_rows(summary)
    for set_name, labelled in summary.get("categories", {}).items():
        rows += [(f"{set_name}/{label}", metrics) for label, metrics in labelled.items()]
    for name, metrics in rows:
        values = [metrics.get(column) for column in CSV_COLUMNS[1:]]
        writer.writerow([name, *("" if v is None else v for v in values)])
    return buffer.getvalue()


def prompts_csv(rows: list[dict[str, Any]]) -> str:
    """prompt_rows as CSV text (PROMPT_COLUMNS); empty cells where a ratio has no denominator."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(PROMPT_COLUMNS)
    for row in rows:
        writer.writerow(["" if row[column] is None else row[column] for column in PROMPT_COLUMNS])
    return buffer.getvalue()


def _table_rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, metrics): each prompt set, each multi-turn set's turns pooled, then "overall"."""
    return [*summary["prompt_sets"].items(),
            *((f"{name}_both_turns", m) for name, m in summary.get("both_turns", {}).items()),
            ("overall", summary["overall"])]


def write_summary(summary: dict[str, Any], out_dir: str) -> str:
    """Write summary.json, summary.csv, per_position.png and committed_histogram.png into out_dir (each file
    atomically), and prompts.csv where the summary has its per-prompt rows (which summary.json leaves out: they
    would make it hundreds of lines longer); returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.json")
    write_text(path, json.dumps({k: v for k, v in summary.items() if k != PER_PROMPT}, indent=2) + "\n")
    write_text(os.path.join(out_dir, "summary.csv"), summary_csv(summary))
    if PER_PROMPT in summary:
        write_text(os.path.join(out_dir, "prompts.csv"), prompts_csv(summary[PER_PROMPT]))
    plot_per_position(summary, os.path.join(out_dir, "per_position.png"))
    plot_committed_histogram(summary, os.path.join(out_dir, "committed_histogram.png"))
    return path


def format_table(summary: dict[str, Any], timing: bool = True) -> str:
    """A small console table: tau and draft acceptance rate per prompt set and overall; with `timing`, the seconds
    the evaluation took under it (timing=False for a table measured before, whose seconds are not this command's)."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = _table_rows(summary)
    width = max(12, *(len(name) for name, _ in rows))
    header = f"{'prompt set':<{width}}  {'tau':>6}  {'acc.rate':>8}  {'prompts':>7}  {'steps':>7}  {'tokens':>7}"
    if "speedup" in summary["overall"]:
        header += f"  {'speedup':>7}  {'step cost':>9}"
    mode, temperature = summary.get("mode", "replay"), summary.get("temperature", 0.0)
    drafts = f", {summary.get('draft_sampling', 'sampled')} drafts" if temperature > 0 else ""
    if "draft_temperature" in summary:
        drafts += f" drawn at T={summary['draft_temperature']}"
    kind = f"{mode} estimate of the acceptance" if "estimate" in summary else f"{mode} acceptance"
    lines = [f"{kind} at T={temperature}{drafts}, block size {summary['block_size']} "
             f"(tau = tokens per target forward)", header, "-" * len(header)]
    for name, m in rows:
        steps = number(m["num_steps"], 1) if isinstance(m["num_steps"], float) else m["num_steps"]  # expected
        lines.append(
            f"{name:<{width}}  {number(m['tau'], 2):>6}  {number(m['acceptance_rate'], 3):>8}  "
            f"{m['num_prompts']:>7}  {steps:>7}  {m['num_tokens']:>7}"
            + (f"  {number(m['speedup'], 2):>7}  {number(m.get('step_cost'), 2):>9}" if "speedup" in m else "")
        )
    cost = summary["overall"].get("step_cost")
    if cost is not None and cost < 1:
        # A speculative step runs a verify forward and a drafter forward: cheaper than one target-only step only
        # where the timings are noise.
        lines.append(f"(a speculative step measured at {cost:.2f} target-only steps, which runs one target forward "
                     f"and more: the timings are noise here, a shared or busy machine; tau is not)")
    for name in summary.get("both_turns", {}):  # the rows of a two-turn set, which a reader cannot guess
        lines.append(f"({name}: its first turns; {name}{TURN2_SUFFIX}: its second turns, after the target's own "
                     f"first answers;\n {name}_both_turns: the steps of both turns pooled; the benchmark's own figure "
                     f"is the mean of each answer's tau, tau_prompt_mean in summary.json)")
    if timing and summary.get("timing", {}).get("seconds"):
        lines.append(format_timing(summary["timing"]))
    return "\n".join(lines)


def format_timing(timing: dict[str, Any]) -> str:
    """One line per prompt set and one in total: wall seconds per phase (summary["timing"])."""

    def phases(seconds: dict[str, float]) -> str:
        return ", ".join(f"{name} {value:.2f}" for name, value in seconds.items())

    lines = [f"time (s): {phases(timing['seconds'])}; total {timing['total_seconds']:.2f}"]
    lines += [f"  {name}: {phases(seconds)}" for name, seconds in timing.get("prompt_sets", {}).items()]
    return "\n".join(lines)
