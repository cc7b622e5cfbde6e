"""Live speculative decoding with KV caches, and plain target-only decoding in the same harness (for the speedup).

The loop is the reference `dflash_generate` loop (docs/eval.md), run for real, one prompt at a time:
1. prefill the prompt through the target (KV cache + tap features); its next token is the first new token;
2. step: the drafter drafts [anchor, MASK x (v-1)] from its cached context (features of positions < anchor);
   the target verifies the whole block in ONE cached forward; greedy prefix matching (T=0) or rejection sampling
   (T>0) decides how many drafts are accepted and the next token. At T>0 `draft_sampling` says how the drafter
   proposes: "sampled" draws each block position from its softmax independently (accept with min(1, p/q)),
   "greedy" proposes its argmax (accept with p(draft)), as vLLM and SGLang serve DFlash (sampling.py);
3. the target cache is rolled back to anchor + accepted (GDN states restored and the accepted tokens re-run,
   target_cache.py), the drafter context is extended with the features of the kept positions;
4. until a stop token is committed or max_new_tokens tokens exist.
At T=0 the committed tokens are the target's own greedy tokens (lossless) on dense and GDN hybrid targets.

Engines (`target_engine`, also for target-only decoding): "hf" is CachedTarget, the adapter's forward over an HF
DynamicCache (every target), with CachedDrafter; "static" is StaticTarget (static_target.py), a static KV cache
whose verify and one-token forwards replay CUDA graphs on CUDA, as a serving engine runs them (targets whose layers
static_layout_problem accepts), with StaticDrafter (static_drafter.py), the drafter context in static buffers with
graphed extend and drafting steps (one graph from the block's tokens to its drafts: embedding, drafter, head,
argmax); "auto" picks static on a supported CUDA target, else hf (static_decode.resolve_engine). The one-off graph
capture happens before a decode's clock starts and is kept for later prompts.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from dflash.eval.metrics import PhaseTimer, StepTrace, synchronize
from dflash.inference.drafter_cache import CachedDrafter, TargetHead
from dflash.inference.sampling import (DRAFT_SAMPLING, greedy_drafts_outcome, greedy_outcome, probabilities, sample,
                                       sampled_outcome)
from dflash.inference.static_decode import resolve_engine
from dflash.inference.static_drafter import StaticDrafter, static_drafter
from dflash.inference.static_target import StaticTarget, static_target
from dflash.inference.target_cache import CachedTarget
from dflash.models.drafter import DFlashDraftModel


@dataclass
class LiveResult:
    """One prompt's live decode: the new tokens, per-step records, wall time (seconds, device-synchronised), the
    part of it spent on the prefill (the prompt's forward up to its first token, which the host reads: a sync) and
    the target engine that ran ("hf" or "static")."""

    prompt_len: int
    continuation: list[int]
    trace: StepTrace
    seconds: float
    prefill_seconds: float
    engine: str


def _check(prompt: list[int], max_new_tokens: int, temperature: float, draft_sampling: str = "sampled") -> None:
    if not prompt:
        raise ValueError("the prompt is an empty token list")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")


def _target(adapter, layer_ids: list[int], engine: str, length: int, graph_sizes: tuple[int, ...],
            restore_linear: bool = True) -> tuple[CachedTarget | StaticTarget, str]:
    """The cached target of one decode of at most `length` positions, and the engine it resolved to; the static
    engine replays forwards of `graph_sizes` tokens as CUDA graphs."""
    engine = resolve_engine(engine, adapter)
    if engine == "static":
        return static_target(adapter, layer_ids, length=length, graph_sizes=graph_sizes), engine
    return CachedTarget(adapter, layer_ids, restore_linear=restore_linear), engine


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(sample(probabilities(logits, temperature), generator))


def draft_block(context: CachedDrafter | StaticDrafter, anchor: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [size - 1, V] and their argmax [size - 1] for the block [anchor, MASK x (size-1)] placed
    after the cached context (valid until the next block is drafted: the static engine's are graph buffers)."""
    return context.draft(anchor, size)


@torch.inference_mode()
def live_decode(
    drafter: DFlashDraftModel,
    adapter,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_token_ids: list[int],
    target_engine: str,
    draft_sampling: str,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    restore_linear: bool = True,
    timer: PhaseTimer | None = None,
    draft_temperature: float | None = None,
) -> LiveResult:
    """Speculative decoding of one prompt. `restore_linear=False` only exists to show that without the GDN state
    rollback a hybrid target is not lossless (tests; the static engine has nothing to restore);
    `generator` must live on the target's device. `target_engine`: "auto" | "static" | "hf" (module docstring).
    `draft_sampling` (T>0 only): "sampled" | "greedy", how the drafter proposes (module docstring).
    `draft_temperature` (sampled drafts): the drafts are drawn from softmax(z / draft_temperature) and verified
    against that distribution, so the decode stays exact; None: `temperature`.

    `timer` (optional, for profiling) is charged per step with "live_prefill", "live_draft", "live_verify",
    "live_accept" and "live_rollback"; on CUDA each of those syncs the device, which slows the decode a little, so
    leave it out when measuring the speedup.
    """
    _check(prompt, max_new_tokens, temperature, draft_sampling)
    if draft_temperature is not None and not draft_temperature > 0:
        raise ValueError(f"draft_temperature must be > 0 or None, got {draft_temperature}")
    greedy_drafts = temperature == 0 or draft_sampling == "greedy"
    config = drafter.config
    stops = set(stop_token_ids)

    def section(name: str) -> AbstractContextManager:
        return timer.phase(name) if timer is not None else nullcontext()

    length = len(prompt) + max_new_tokens
    # Every block size a step can verify: full blocks and the shorter last blocks near max_new_tokens.
    target, engine = _target(adapter, config.target_layer_ids, target_engine, length,
                             tuple(range(2, config.block_size + 1)), restore_linear)
    head = TargetHead.of(adapter)
    context = static_drafter(drafter, head, length=length) if engine == "static" else CachedDrafter(drafter, head)
    synchronize(adapter.device)
    began = time.perf_counter()
    with section("live_prefill"):
        logits, features = target.forward(list(prompt), last_logits_only=True)
        context.extend(features)
        tokens = list(prompt) + [_pick(logits[-1], temperature, generator)]
    prefilled = time.perf_counter()
    start, max_length = len(prompt), len(prompt) + max_new_tokens
    trace = StepTrace()
    while start + 1 < max_length and tokens[-1] not in stops:
        size = min(config.block_size, max_length - start)
        with section("live_draft"):
            draft_logits, argmax = draft_block(context, tokens[start], size)
            drafts, draft_probs = _propose(draft_logits, argmax, greedy_drafts, draft_temperature or temperature,
                                           generator)
        with section("live_verify"):
            # The block stays on the device: no host round trip (a sync) between drafting and verifying, so the
            # host queues the verify while the device still drafts.
            block = torch.cat([drafts.new_full((1,), tokens[start]), drafts]).to(adapter.device)
            verify_logits, verify_features = target.verify(block)
        with section("live_accept"):
            outcome = _accept(verify_logits, drafts, draft_probs, temperature, generator)
            # The step's one host sync: the decision and the drafts come back together.
            accepted, following, *drafted = torch.cat([outcome, drafts.to(outcome.device)]).tolist()
        new, stopped = _committed(drafted[:accepted] + [following], max_length - start - 1, stops)
        committed = len(new)
        # Same bookkeeping as the replay: drafts past the stop token could never have been committed.
        trace.add(committed, min(accepted, committed), size - 1 if stopped is None else min(size - 1, committed))
        tokens = tokens[: start + 1] + new
        if stopped is not None or start + committed + 1 >= max_length:
            break  # finished: no rollback or context update needed
        with section("live_rollback"):
            recomputed = target.rollback(start + accepted + 1)
            context.extend(recomputed if recomputed is not None else verify_features[: accepted + 1])
        start += committed
    synchronize(adapter.device)
    return LiveResult(len(prompt), tokens[len(prompt):], trace, time.perf_counter() - began, prefilled - began, engine)


def _propose(draft_logits: torch.Tensor, argmax: torch.Tensor, greedy: bool, temperature: float,
             generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(drafts, their distributions or None): the drafter's argmax (T=0, or greedy drafts at T>0, verified as
    deterministic proposals), else one sample per block position. The draw stays out of the drafter's graph: the
    generator and the temperature change from call to call."""
    if greedy:
        return argmax, None
    draft_probs = probabilities(draft_logits, temperature)
    return sample(draft_probs, generator), draft_probs


def _accept(verify_logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, temperature: float,
            generator: torch.Generator | None) -> torch.Tensor:
    """[accepted drafts, the token that follows them] on the device: greedy prefix matching at T=0, else the
    sampling rule of how the drafts were proposed (sampling.py)."""
    if temperature == 0:
        return greedy_outcome(verify_logits, drafts)
    target_probs = probabilities(verify_logits, temperature)
    if draft_probs is None:
        return greedy_drafts_outcome(target_probs, drafts, generator)
    return sampled_outcome(target_probs, draft_probs, drafts, generator)


def _committed(new: list[int], room: int, stops: set[int]) -> tuple[list[int], int | None]:
    """The tokens a step commits (at most `room`, up to and including a stop token) and where the stop token is
    among them (None when there is none)."""
    new = new[:room]
    stopped = next((i for i, t in enumerate(new) if t in stops), None)
    return (new if stopped is None else new[: stopped + 1]), stopped


@torch.inference_mode()
def target_only_decode(
    adapter,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_token_ids: list[int],
    target_engine: str,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> LiveResult:
    """Plain autoregressive decoding with the same cached target forward (one token per forward): the baseline
    of the speedup. Its trace has one 1-token step per forward after the prefill. `target_engine` as live_decode.
    """
    _check(prompt, max_new_tokens, temperature)
    stops = set(stop_token_ids)
    # No taps: the baseline pays for no feature hooks or copies.
    target, engine = _target(adapter, [], target_engine, len(prompt) + max_new_tokens, (1,))
    synchronize(adapter.device)
    began = time.perf_counter()
    logits, _ = target.forward(list(prompt), last_logits_only=True)
    tokens = list(prompt) + [_pick(logits[-1], temperature, generator)]
    prefilled = time.perf_counter()
    trace = StepTrace()
    while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] not in stops:
        logits, _ = target.forward(tokens[-1:])
        tokens.append(_pick(logits[-1], temperature, generator))
        trace.add(1, 0, 0)
    synchronize(adapter.device)
    return LiveResult(len(prompt), tokens[len(prompt):], trace, time.perf_counter() - began, prefilled - began, engine)
