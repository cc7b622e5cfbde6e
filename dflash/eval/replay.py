"""Exact greedy (T=0) acceptance of a drafter by replaying speculative decoding over the target's own output.

Why a replay equals real speculative decoding at T=0: speculative decoding with greedy verification is lossless, so
the committed text is the target's greedy continuation whatever the drafter proposes. The replay therefore
(a) generates that continuation once with plain greedy decoding, (b) runs ONE target forward over prompt +
continuation, which gives every position's target features and the target's greedy next token, and (c) walks the
decoding loop of the reference `dflash_generate`: at anchor position `start` the drafter sees the features of
positions < start (exactly what a real decoder has verified by then), drafts the block, the accepted length is the
longest prefix of drafts equal to the target's greedy tokens, and accepted + 1 tokens are committed. A causal target
computes the same features and logits for a prefix whether it sees it in one forward or in verify blocks, so each
step sees the same inputs as in real decoding and makes the same decisions.

Where they can differ: only through floating-point noise. Batched/padded generation, one long forward and blockwise
KV-cached verification round differently (much more so in bf16), so a near-tie in the target's logits can flip and
the real decoder would continue with another token; `greedy_mismatches` counts the positions where the full forward's
argmax disagrees with the generated continuation (0 means self-consistent). The drafter is batched across prompts
with left-padded context, and blocks shortened near max_new_tokens are right-padded to the longest block of the
step, the padded keys masked out in every layer, which is also only float noise. GDN hybrid targets need no state
rollback here: nothing is decoded incrementally after generation.

Cost: the drafter's context keys/values are computed once per chunk (drafter_cache.py), and each step is ONE
drafter forward over the block tokens of all active rows plus a few host-side tensor ops for their acceptance.
On CUDA every step of a chunk has one shape and replays one CUDA graph (fixed_shape, chunk_drafts.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.eval.chunk_drafts import ChunkDrafts
from dflash.eval.metrics import PhaseTimer, StepTrace
from dflash.inference.drafter_cache import KeysValues, block_hidden, context_keys_values
from dflash.inference.generation import cut_at_stop_strings
from dflash.models.drafter import DFlashDraftModel
from dflash.models.targets.logit_transform import logits_from_hidden

# propose(rows, starts, sizes) -> draft ids [len(rows), max(sizes) - 1] for blocks anchored at sequence positions
# `starts`, row i a block of sizes[i] tokens (its drafts past sizes[i] - 1 are ignored).
Proposer = Callable[[list[int], list[int], list[int]], torch.Tensor]


@dataclass
class ReplayResult:
    """One prompt's replay: its continuation and per-step records."""

    prompt_len: int
    continuation: list[int]
    trace: StepTrace
    greedy_mismatches: int


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def pad_id(adapter, stop_ids: list[int]) -> int:
    """The id that pads batches: the tokenizer's pad token, else the first stop id, else 0."""
    pad = getattr(adapter.tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return stop_ids[0] if stop_ids else 0


# Greedy continuations already generated, per target model: the frozen target answers a prompt the same way every
# time, and an evaluation asks again (MT-Bench turn 1 is answered for the turn-2 prompts and again by its own
# replay; the held-out set is replayed every eval_every steps). Weak keys: a model that goes takes its answers.
_ANSWERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def greedy_continuations(
    adapter, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int], batch_size: int,
    engine: str = "auto",
) -> list[list[int]]:
    """The target's greedy continuation of each prompt, ending with the first stop token, before the first stop
    string (adapter.stop_strings) or at max_new_tokens.

    engine: "hf" (model.generate), "static" (dflash.inference.static_decode) or "auto" (static on a CUDA target it
    supports, else hf). A prompt answered before under the same settings is not generated again.
    """
    answered = _ANSWERED.setdefault(adapter.model, {})
    weight = next(adapter.model.parameters())  # a model cast to another dtype or moved answers anew
    settings = (max_new_tokens, tuple(stop_token_ids), engine, weight.dtype, str(weight.device))
    keys = [(tuple(p), settings) for p in prompts]
    missing = list(dict.fromkeys(k for k in keys if k not in answered))
    if missing:
        made = _generate_greedy(adapter, [list(k[0]) for k in missing], max_new_tokens=max_new_tokens,
                                stop_token_ids=stop_token_ids, batch_size=batch_size, engine=engine)
        answered.update((key, cut_at_stop_strings(tokens, adapter.stop_strings(), adapter.tokenizer)[0])
                        for key, tokens in zip(missing, made))
    return [list(answered[k]) for k in keys]


@torch.inference_mode()
def _generate_greedy(
    adapter, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int], batch_size: int,
    engine: str,
) -> list[list[int]]:
    from transformers import GenerationConfig

    from dflash.inference.generation import model_defaults_hidden
    from dflash.inference.static_decode import resolve_engine, static_generate

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    pad = pad_id(adapter, stop_token_ids)
    if resolve_engine(engine, adapter) == "static":
        return static_generate(adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
                               pad_id=pad, batch_size=batch_size)
    # An empty eos list means "no stop token"; None would fall back to the model's own eos.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=list(stop_token_ids),
        pad_token_id=pad,
    )
    stops = set(stop_token_ids)
    results: list[list[int]] = []
    model = adapter.model
    # Greedy means plain argmax: no logits processor from the model's own generation_config.
    with model_defaults_hidden(model):
        for chunk in _chunks(prompts, batch_size):
            width = max(len(p) for p in chunk)
            # Left padding keeps every prompt's last token in the last column, where generation continues.
            ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk], device=adapter.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=adapter.device)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            results += [_cut(row, max_new_tokens, stops) for row in out[:, width:].tolist()]
    return results


def _cut(row: list[int], max_new_tokens: int, stops: set[int]) -> list[int]:
    """The generated row up to and including the first stop token (the rest is padding), at most max_new_tokens."""
    continuation = []
    for token in row[:max_new_tokens]:
        continuation.append(token)
        if token in stops:
            break
    return continuation


@torch.inference_mode()
def target_pass(
    adapter, sequences: list[list[int]], layer_ids: list[int]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One batched target forward (right padding): per sequence, features [T, K*H] and greedy next tokens [T]."""
    width = max(len(s) for s in sequences)
    pad = pad_id(adapter, adapter.stop_token_ids())
    ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in sequences], device=adapter.device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=adapter.device)
    logits, features = adapter.forward_with_features(ids, mask, layer_ids)
    greedy = logits.argmax(dim=-1)
    del logits
    lengths = [len(s) for s in sequences]
    return [features[i, :n] for i, n in enumerate(lengths)], [greedy[i, :n] for i, n in enumerate(lengths)]


class DrafterProposer:
    """Drafts blocks for many prompts at once from stored target features, as the reference decoder would.

    Every drafter layer's context keys/values of every stored position are computed once, right-padded into one
    tensor per layer on the drafter's device (drafter_cache.py): a step only gathers its rows' left-padded contexts
    with a few indexing kernels (or slices them, see `contexts`) and runs the block tokens through the layers,
    instead of re-projecting the whole context through fc and every k/v projection: replay runs hundreds of steps.
    fixed_shape drafts every step of the chunk at one shape instead, on CUDA captured once as a CUDA graph
    (chunk_drafts.py; the target's embedding and head on the drafter's device); `hidden` stays gathered. None
    (the default): fixed_shape where it is one graph, on CUDA with the embedding and head on the drafter's device.
    """

    def __init__(
        self, drafter: DFlashDraftModel, adapter, sequences: list[list[int]], features: list[torch.Tensor],
        fixed_shape: bool | None = None,
    ) -> None:
        self.drafter = drafter
        self.adapter = adapter
        self.sequences = sequences
        self.device = next(drafter.parameters()).device
        padded = torch.nn.utils.rnn.pad_sequence([f.to(self.device) for f in features], batch_first=True)
        positions = torch.arange(padded.shape[1], device=self.device)[None].expand(padded.shape[0], -1)
        self.context = context_keys_values(drafter, padded, positions)
        if fixed_shape is None:
            pieces = (adapter.embed_tokens().weight, adapter.lm_head_weight())
            device = drafter.fc.weight.device  # the device ChunkDrafts checks against
            fixed_shape = device.type == "cuda" and all(p.device == device for p in pieces)
        self.fixed_shape = fixed_shape
        self._chunk_drafts: ChunkDrafts | None = None

    @property
    def chunk_drafts(self) -> ChunkDrafts:
        """The fixed-shape drafting step of this chunk (chunk_drafts.py), built (on CUDA, captured) on first use."""
        if self._chunk_drafts is None:
            self._chunk_drafts = ChunkDrafts(self.drafter, self.adapter.embed_tokens().weight,
                                             self.adapter.lm_head_weight(), self.context, self.sequences,
                                             cuda_graph=self.device.type == "cuda")
        return self._chunk_drafts

    @torch.inference_mode()
    def hidden(self, rows: list[int], starts: list[int], size: int | list[int]) -> torch.Tensor:
        """Drafter output [len(rows), max size, H] for blocks [anchor, MASK x (size-1)] anchored at `starts`.

        Row r sees the features of positions < starts[r] of sequence rows[r]. `size`: one block size, or one per
        row. Contexts of different lengths are left-padded, blocks shorter than the longest right-padded; padded
        keys are masked out in every layer (outputs at padded block positions are meaningless).
        """
        config = self.drafter.config
        sizes = [size] * len(rows) if isinstance(size, int) else list(size)
        size, n = max(sizes), len(rows)
        num_context = max(starts)
        # Everything the step needs from the host in ONE copy: a copy from pageable memory waits for the device.
        block = [[self.sequences[r][s]] + [config.mask_token_id] * (size - 1) for r, s in zip(rows, starts)]
        host = torch.tensor([*rows, *starts, *sizes, *(t for b in block for t in b)]).to(self.device)
        index, start, lengths = host[:n], host[n : 2 * n], host[2 * n : 3 * n]
        # The raw embedding rows, as training takes them (train/forward.py): Gemma's module would scale them.
        noise = F.embedding(host[3 * n :].view(n, size).to(self.adapter.device), self.adapter.embed_tokens().weight)
        # Key column j of row i holds position j - (num_context - start_i); negative positions are left padding.
        positions = torch.arange(num_context + size, device=self.device)[None] - (num_context - start)[:, None]
        source = positions[:, :num_context].clamp(min=0)
        left_padded = min(starts) != num_context  # decided on the host: no device sync
        context = self.contexts(rows, index, source, left_padded)
        context_valid = block_valid = None
        if left_padded:
            context_valid = source == positions[:, :num_context]
        if min(sizes) != size:
            block_valid = torch.arange(size, device=self.device)[None] < lengths[:, None]
        return block_hidden(self.drafter, noise, positions[:, num_context:], context, source, context_valid,
                            block_valid)

    def contexts(self, rows: list[int], index: torch.Tensor, source: torch.Tensor, left_padded: bool) -> KeysValues:
        """Every layer's cached keys/values [len(rows), kv_heads, C, head_dim] of context columns `source` [n, C]
        of rows `rows` (`index`: the same rows on the device); `left_padded` False when every row's source is 0..C-1.
        """
        first, n, num_context = rows[0], len(rows), source.shape[1]
        if not left_padded and rows == list(range(first, first + n)):
            # Consecutive rows over the same columns (a lone row, near the end of a chunk): a view, no gather copy.
            return [(k[first : first + n, :, :num_context], v[first : first + n, :, :num_context])
                    for k, v in self.context]
        # Advanced indices around a slice put the indexed axes first: [rows, C, kv_heads, head_dim].
        return [(k[index[:, None], :, source].transpose(1, 2), v[index[:, None], :, source].transpose(1, 2))
                for k, v in self.context]

    @torch.inference_mode()
    def __call__(self, rows: list[int], starts: list[int], size: int | list[int]) -> torch.Tensor:
        """Greedy drafts [len(rows), max size - 1] on the host (the Proposer of replay_steps); with fixed_shape,
        from the chunk's fixed-shape step."""
        if self.fixed_shape:
            return self.chunk_drafts(rows, starts, [size] * len(rows) if isinstance(size, int) else list(size))
        hidden = self.hidden(rows, starts, size)[:, 1:]
        return logits_from_hidden(hidden, self.adapter.lm_head_weight()).argmax(dim=-1).cpu()


def replay_steps(
    sequences: list[list[int]],
    greedy: list[torch.Tensor],
    prompt_lens: list[int],
    propose: Proposer,
    *,
    block_size: int,
    max_new_tokens: int,
) -> list[StepTrace]:
    """Walk the reference decoding loop over known continuations; one StepTrace per sequence.

    sequences[i] = prompt + greedy continuation (its first token came from the prefill, not from a step);
    greedy[i][t] = the target's greedy token after position t. Blocks shrink near prompt_len + max_new_tokens exactly
    as in the reference loop, which matters because full-attention drafts depend on the block length.
    The acceptance of all rows drafted together is decided by a few tensor ops on the host, not per row.
    """
    traces = [StepTrace() for _ in sequences]
    starts = list(prompt_lens)
    ends = [len(s) - 1 for s in sequences]
    # -1 pads: never equal to a draft; such positions are outside `checkable` anyway.
    padded = torch.nn.utils.rnn.pad_sequence([g.cpu().long() for g in greedy], batch_first=True, padding_value=-1)
    while True:
        rows = [i for i in range(len(sequences)) if starts[i] < ends[i]]
        if not rows:
            return traces
        # All active rows in one proposal, blocks of different sizes included: one drafter forward per step.
        row_starts = [starts[i] for i in rows]
        sizes = [min(block_size, prompt_lens[i] + max_new_tokens - starts[i]) for i in rows]
        drafts = propose(rows, row_starts, sizes).cpu()
        # Only drafts inside the continuation can be committed; later ones are cut off by the stop token or
        # max_new_tokens in real decoding too, so they never change what is committed.
        remaining = [ends[i] - starts[i] for i in rows]
        checkable = [min(size - 1, r) for size, r in zip(sizes, remaining)]
        offsets = torch.arange(max(sizes) - 1)
        columns = (torch.tensor(row_starts)[:, None] + offsets[None]).clamp(max=padded.shape[1] - 1)
        target = padded[torch.tensor(rows)[:, None], columns]
        matches = (drafts[:, : offsets.numel()] == target) & (offsets[None] < torch.tensor(checkable)[:, None])
        accepted = matches.int().cumprod(dim=1).sum(dim=1).tolist()
        for i, a, r, c, size in zip(rows, accepted, remaining, checkable, sizes):
            committed = min(a + 1, r)
            # As a live decoder counts them: a step drafts the whole block unless it commits the continuation's
            # last token (a stop token or the max_new_tokens-th), where only drafts up to that token could count.
            traces[i].add(committed, a, c if committed == r else size - 1)
            starts[i] += committed


def replay(
    drafter: DFlashDraftModel,
    adapter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
    timer: PhaseTimer | None = None,
    fixed_shape: bool | None = None,
) -> list[ReplayResult]:
    """Replay greedy speculative decoding of `drafter` on `prompts` (token ids); one result per prompt.

    Continuations are generated for all prompts first (in batches of `batch_size`); then prompts go through in
    chunks of `batch_size` so only one chunk's features are held at a time. `progress` is called with the number
    of prompts finished after each chunk. `timer` (optional) is charged with the phases "generate" (greedy
    continuations), "target_pass", "draft" (drafter forwards + head) and "accept" (the rest of the step loop).
    fixed_shape: DrafterProposer's (True: every step of a chunk at one shape, on CUDA one graph; None: where it is
    one graph).
    """
    if not prompts:
        return []
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(f"prompts {empty[:5]} are empty token lists")
    timer = timer if timer is not None else PhaseTimer()
    stop_ids = adapter.stop_token_ids() if stop_token_ids is None else list(stop_token_ids)
    config = drafter.config
    results: list[ReplayResult] = []
    # All continuations in one call: the static engine then captures its CUDA graph once, not once per chunk.
    with timer.phase("generate"):
        every_continuation = greedy_continuations(
            adapter, prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids, batch_size=batch_size
        )
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        continuations = every_continuation[first : first + batch_size]
        sequences = [list(p) + c for p, c in zip(chunk, continuations)]
        with timer.phase("target_pass"):
            features, greedy = target_pass(adapter, sequences, config.target_layer_ids)
            greedy = [g.cpu() for g in greedy]
        propose = DrafterProposer(drafter, adapter, sequences, features, fixed_shape)
        draft_seconds = 0.0

        def timed_propose(rows: list[int], starts: list[int], size: int) -> torch.Tensor:
            # No extra sync: a proposal ends with a copy of the drafts to the host.
            nonlocal draft_seconds
            began = time.perf_counter()
            drafts = propose(rows, starts, size)
            draft_seconds += time.perf_counter() - began
            return drafts

        # The loop ends on the host (drafts and greedy tokens are host tensors), so wall time needs no sync.
        began = time.perf_counter()
        traces = replay_steps(
            sequences, greedy, [len(p) for p in chunk], timed_propose,
            block_size=config.block_size, max_new_tokens=max_new_tokens,
        )
        for prompt, continuation, sequence_greedy, trace in zip(chunk, continuations, greedy, traces):
            # greedy[t] predicts token t+1: compare the predictions for the continuation with what was generated.
            predicted = sequence_greedy[len(prompt) - 1 : -1]
            mismatches = int((predicted != torch.tensor(continuation)).sum())
            results.append(ReplayResult(len(prompt), continuation, trace, mismatches))
        timer.add("draft", draft_seconds)
        timer.add("accept", time.perf_counter() - began - draft_seconds)
        # The next chunk's proposer is built before this name is rebound: free this one's context (and graph) first.
        del propose
        if progress is not None:
            progress(len(chunk))
    return results
