"""Fast batched decoding of dense targets (Llama layout, Gemma 2/3; sliding windows included): a static KV cache,
refilled rows and, on CUDA, CUDA graphs.

Plain HF `generate` re-dispatches hundreds of small kernels from Python for every token, so a small target such as
SmolLM2-135M is launch-bound (~550 tok/s at batch 64 on an H200). Here the target's own HF decoder layers run with
our attention over a preallocated cache (dflash/models/targets/engine_attention.py), and the whole decode step
(embedding -> layers -> final norm -> lm_head -> next-token choice -> cache and state updates) is captured in a
CUDA graph (one per attention span) and replayed for every token. A row whose prompt stopped takes the next
pending prompt (row_schedule.py decides which and when): its prompt is prefilled eagerly into that row from
column 0 while the other rows keep their place, so the decode steps approach total tokens / rows.

At T=0 in float32 the tokens match HF greedy `generate` of each prompt alone: the position of column c is c, row
r attends over columns 0..column[r] (what its current prompt wrote; keys a previous occupant left beyond are
masked out), a sliding-window layer over the last `window` of them (models/targets/static_attention.py), the next
token is the argmax of the float32 logits (after the family's logit transform, e.g. Gemma's final soft cap).
Sampling (T > 0) is temperature + top-p by inverse CDF from each prompt's own seeded uniform stream
(keyed_sampling.py): the right distribution, not HF's random stream, and the hf engine's draws for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from functools import cache

import torch

from dflash.inference.cuda_graphs import capture_graphs
from dflash.inference.keyed_sampling import prompt_draws, prompt_key, sample_tokens
from dflash.inference.row_schedule import ScheduleStats, round_up, run_schedule
from dflash.models.targets.row_attention import RowPrefixAttention, resolve_attention
from dflash.models.targets.static_attention import attention, visibility_masks
from dflash.models.targets.engine_attention import EngineCache, engine_attention

ENGINES = ("hf", "static", "auto")
# The KV cache length and the attention span of a decode step are multiples of this: one CUDA graph per span, and
# SDPA sees aligned shapes.
LENGTH_QUANTUM = 128
# Prompt tokens per prefill slice: bounds the prefill's [rows, 1, P, P] mask and activations.
PREFILL_TOKENS = 32768
# On CUDA, "has every row stopped?" costs a device sync: ask every few steps only.
CHECK_EVERY_CUDA = 8
# Warm-up runs of a compiled step before its graphs are captured: with flex attention the second call compiled
# the step again (transformers' kernel hooks keep a context variable that the first compiled call leaves set, and
# dynamo guards on it); a compile must not start inside a capture.
COMPILED_WARMUPS = 2
# With refill, free rows are refilled once 1/REFILL_GROUPS of the rows are free: each refill is one eager prefill
# call (~1k kernel launches), so waiting for a group costs fewer steps than refilling every row alone.
REFILL_GROUPS = 16


def supports_static_decode(adapter) -> bool:
    """True when the adapter's static layout runs its layers (llama, mistral, qwen2, qwen3, gemma2 and gemma3_text
    targets, sliding windows included; SmolLM2 too); False for GDN hybrids."""
    return adapter.static_layout_problem() is None


def resolve_engine(engine: str, adapter) -> str:
    """"hf" or "static" for a requested engine: "auto" is static on a supported CUDA target, else hf."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        on_cuda = torch.device(adapter.device).type == "cuda"
        return "static" if on_cuda and supports_static_decode(adapter) else "hf"
    if engine == "static" and not supports_static_decode(adapter):
        raise ValueError(f"engine 'static' cannot decode this target: {adapter.static_layout_problem()}; use 'hf'")
    return engine


class _Decoder:
    """Static buffers, prefill and decode step for one (batch rows, cache length, choice rule); the RowDecoder
    that row_schedule.run_schedule drives through one call (begin() hands it the call's prompts).

    Every row keeps its own write column: a prompt admitted into a row is prefilled from column 0 (right padded
    inside its prefill group), so the position of column c is c in every row and row r attends over columns
    0..column[r]; keys a previous occupant left beyond that are masked out. A row that stops (stop token or its
    budget) freezes: it keeps writing at its last column and its tokens go to a scratch slot until it is refilled.
    """

    def __init__(self, adapter, rows: int, length: int, stop_ids: list[int], temperature: float,
                 top_p: float, use_graph: bool, compile_step: bool = False, attention: str = "sdpa") -> None:
        # The target runs through adapter.forward with an EngineCache over this decoder's KV cache.
        self.adapter, self.layout = adapter, adapter.engine_layout
        self.rows, self.length = rows, length
        self.temperature, self.top_p = temperature, top_p
        device, lay = self.layout.device, self.layout
        cache_shape = (rows, lay.kv_heads, length, lay.head_dim)
        self.keys = [torch.zeros(cache_shape, device=device, dtype=lay.dtype) for _ in lay.layers]
        self.values = [torch.zeros(cache_shape, device=device, dtype=lay.dtype) for _ in lay.layers]
        self.columns = torch.arange(length, device=device)
        # Row r, kv head h, column c is row (r * kv_heads + h) * length + c of a cache viewed as [-1, head_dim].
        self.flat_base = (torch.arange(rows * lay.kv_heads, device=device) * length).view(rows, lay.kv_heads)
        self.rope = lay.rope_table(length)
        self.stops = torch.tensor(stop_ids, device=device, dtype=torch.long)
        self.tokens = torch.zeros(rows, device=device, dtype=torch.long)
        self.column = torch.zeros(rows, device=device, dtype=torch.long)
        self.count = torch.zeros(rows, device=device, dtype=torch.long)
        self.budget = torch.zeros(rows, device=device, dtype=torch.long)
        self.stopped = torch.ones(rows, device=device, dtype=torch.bool)
        # Tokens of row r go to out[r, count[r]]; column `length` is the scratch slot of stopped rows.
        self.out = torch.zeros(rows, length + 1, device=device, dtype=torch.long)
        # Per-row uniform draws, one per token index (sampling only; filled from each prompt's own stream).
        self.uniform = torch.zeros(rows, length + 1, device=device, dtype=torch.float64)
        self.compile_step = compile_step
        # The current call's prompts (token lists), new-token budgets and sampling stream keys, by prompt index.
        self.call_prompts: list[list[int]] = []
        self.call_budgets: list[int] = []
        self.call_keys: list[str] = []
        # With flex attention each row reads only its own keys, so one span (the whole cache) serves every step.
        self.row_attention = None
        if attention == "flex":
            self.row_attention = RowPrefixAttention(rows, lay.kv_heads, lay.heads // lay.kv_heads, length, device,
                                                    lay.mask_windows, lay.attention_softcap)
        self.span_quantum = length if self.row_attention is not None else LENGTH_QUANTUM
        self.spans = list(range(self.span_quantum, length + 1, self.span_quantum))
        self.graphs = self._capture() if use_graph else {}

    def reset(self) -> None:
        """Every row free (stopped, at column 0): the state a run starts from."""
        self.stopped.fill_(True)
        for state in (self.tokens, self.column, self.count, self.budget):
            state.zero_()

    def _capture(self) -> dict[int, torch.cuda.CUDAGraph]:
        # One graph per attention span (all state lives in the static buffers, so they pass nothing to each other).
        # The warm-up scribbles on the state; reset() clears it.
        captured = capture_graphs(self.layout.device, self.spans, prepare=lambda span: None, run=self.advance,
                                  warmups=COMPILED_WARMUPS if self.compile_step else 1)
        self.reset()
        return {span: graph for span, (graph, _) in captured.items()}

    def choose(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        return sample_tokens(logits, self.temperature, self.top_p, uniform)

    def record(self, tokens: torch.Tensor) -> None:
        """Store the chosen tokens of the running rows and move them to their next column."""
        running = ~self.stopped
        slot = torch.where(running, self.count, self.length)
        self.out.scatter_(1, slot[:, None], tokens[:, None])
        self.count += running
        self.column += running
        self.stopped |= (tokens[:, None] == self.stops).any(dim=-1) | (self.count >= self.budget)
        self.tokens.copy_(tokens)

    def advance(self, span: int) -> None:
        """One decode step, compiled or not (the attention switch stays outside what torch.compile traces)."""
        with engine_attention(self.layout.layers):
            if self.compile_step:
                _compiled_step()(self, span)
            else:
                self.step(span)

    def step(self, span: int) -> None:
        """One decode step for every row: feed `tokens` at each row's `column`, attend over the first `span`
        columns (with flex attention each row over its own columns 0..column), choose and record the next tokens.
        Runs inside engine_attention (advance() enters it)."""
        lay = self.layout
        rope = {kind: (cos[self.column][:, None], sin[self.column][:, None]) for kind, (cos, sin) in self.rope.items()}
        if self.row_attention is not None:
            self.row_attention.update(self.column)
        else:
            # Additive masks made once per step, one per distinct window (SDPA would convert a boolean one in every
            # layer).
            masks = visibility_masks(self.columns[:span], self.column, lay.mask_windows, lay.dtype)
            masks = {window: mask[:, None, None, :] for window, mask in masks.items()}
        write = (self.flat_base + self.column[:, None]).view(-1)
        groups = lay.heads // lay.kv_heads

        def attend(index, q, k, v, scaling, window, softcap):
            keys, values = self.keys[index], self.values[index]
            keys.view(-1, lay.head_dim).index_copy_(0, write, k.reshape(-1, lay.head_dim))
            values.view(-1, lay.head_dim).index_copy_(0, write, v.reshape(-1, lay.head_dim))
            # The query heads of one kv group act as the query rows of that kv head: no copy of the cache.
            q = q.reshape(self.rows, lay.kv_heads, groups, lay.head_dim)
            if self.row_attention is not None:
                context = self.row_attention(q, keys, values, scaling, window, softcap)
            else:
                context = attention(q, keys[:, :, :span], values[:, :, :span], masks[window], scaling, softcap)
            return context.reshape(self.rows, 1, lay.heads, lay.head_dim)

        _, logits = self.adapter.forward(self.tokens[:, None], None, [], "logits",
                                         cache=EngineCache(rope, attend, (slice(None), -1)))
        logits = logits.float()
        uniform = self.uniform.gather(1, self.count[:, None]).squeeze(1) if self.temperature > 0 else None
        self.record(self.choose(logits, uniform))

    def prefill(self, rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ids [k, W] into the cache rows `rows` from column 0; float32 logits [k, V] of
        each prompt's last token. The padding sits after the real tokens, so a causal mask (within each layer's
        window) is all they need: SDPA's own causal one for a plain target, explicit masks for windows or soft caps."""
        lay = self.layout
        width = ids.shape[1]
        rope = {kind: (cos[None, :width], sin[None, :width]) for kind, (cos, sin) in self.rope.items()}
        masks = {None: None} if lay.plain else visibility_masks(self.columns[:width], self.columns[:width],
                                                                lay.mask_windows, lay.dtype)
        groups = lay.heads // lay.kv_heads

        def attend(index, q, k, v, scaling, window, softcap):
            self.keys[index][rows, :, :width] = k
            self.values[index][rows, :, :width] = v
            context = attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                masks[window], scaling, softcap)
            return context.transpose(1, 2)

        last = (torch.arange(len(lengths), device=ids.device), lengths - 1)
        with engine_attention(lay.layers):
            _, logits = self.adapter.forward(ids, None, [], "logits", cache=EngineCache(rope, attend, last))
        return logits.float()

    def begin(self, prompts: list[list[int]], budgets: list[int], keys: list[str]) -> None:
        """Start a call: every row free; admit() takes prompts of this call by index (token lists, new-token
        budgets, sampling stream keys)."""
        self.call_prompts, self.call_budgets, self.call_keys = prompts, budgets, keys
        self.reset()

    def admit(self, rows: list[int], prompts: list[int]) -> None:
        """Prefill the call's prompts (indices, longest first) into the given free rows, choose their first tokens
        and start them."""
        device = self.layout.device
        width = max(len(self.call_prompts[i]) for i in prompts)
        per_call = max(1, PREFILL_TOKENS // width)
        for start in range(0, len(rows), per_call):
            group = prompts[start: start + per_call]
            chunk = [self.call_prompts[i] for i in group]
            budgets = [self.call_budgets[i] for i in group]
            wide = max(len(p) for p in chunk)
            ids = torch.tensor([p + [0] * (wide - len(p)) for p in chunk], device=device)
            index = torch.tensor(rows[start: start + per_call], device=device)
            lengths = torch.tensor([len(p) for p in chunk], device=device)
            budget = torch.tensor(budgets, device=device)
            draws = None
            if self.temperature > 0:
                # Each prompt's own uniform draws, one per new-token index, whichever row it lands in.
                uniform = torch.zeros(len(group), max(budgets), dtype=torch.float64)
                for row, (i, n) in enumerate(zip(group, budgets)):
                    uniform[row, :n] = prompt_draws(self.call_keys[i], n)
                self.uniform[index, : uniform.shape[1]] = uniform.to(device)
                draws = self.uniform[index, 0]
            first = self.choose(self.prefill(index, ids, lengths), draws)
            self.out[index, 0] = first
            self.tokens[index] = first
            self.column[index] = lengths
            self.count[index] = 1
            self.budget[index] = budget
            self.stopped[index] = (first[:, None] == self.stops).any(dim=-1) | (budget <= 1)

    def decode(self, steps: int, span: int) -> None:
        for _ in range(steps):
            if self.graphs:
                self.graphs[span].replay()
            else:
                self.advance(span)

    def finished(self) -> list[bool]:
        return self.stopped.tolist()

    def harvest(self, rows: list[int]) -> list[list[int]]:
        index = torch.tensor(rows, device=self.layout.device)
        counts = self.count[index].tolist()
        tokens = self.out[index, : max(counts)].tolist()
        return [row[:n] for row, n in zip(tokens, counts)]


@cache
def _compiled_step():
    """_Decoder.step through torch.compile (one compiled function for all decoders; new shapes recompile)."""
    return torch.compile(_Decoder.step, fullgraph=True)


class StaticGenerator:
    """static_generate for one target, keeping the buffers and CUDA graphs of the last shape across calls.

    Refill only helps within a call, so pass many prompts per call (stream() yields results as they finish). Keep
    one generator per run when calling several times: a call reuses the decoder when its rows, stop tokens and
    choice rule match and its cache is long enough, so its graphs are not captured again. refill=False runs plain
    batches (a batch ends when its last row stops), for comparison. `attention` is the decode step's attention
    (models/targets/row_attention.py): "sdpa" (every row over the step's span, masked), "flex" (each row over its
    own keys) or "auto" (flex on a CUDA target, else sdpa). `last_stats` holds the ScheduleStats of the last call
    (decode steps, row utilisation).
    """

    def __init__(self, adapter, cuda_graphs: bool | None = None, compile_step: bool = False,
                 refill: bool = True, attention: str = "sdpa") -> None:
        reason = adapter.static_layout_problem()
        if reason is not None:
            raise ValueError(f"static decoding does not support this target: {reason}")
        self.adapter, self.layout = adapter, adapter.engine_layout
        self.vocab_size = int(adapter.vocab_size)
        on_cuda = self.layout.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA target; this one is on {self.layout.device}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        # Pad every batch to batch_size rows so one set of graphs serves them all (eager runs need not).
        self.fixed_rows = self.cuda_graphs
        self.compile_step = compile_step
        self.refill = refill
        self.attention = resolve_attention(attention, self.layout)
        self.last_stats: ScheduleStats | None = None
        self._decoder: _Decoder | None = None
        self._key: tuple | None = None

    def _decoder_for(self, rows: int, length: int, stop_ids: list[int], temperature: float,
                     top_p: float) -> _Decoder:
        key = (rows, tuple(stop_ids), temperature, top_p)
        if key != self._key or self._decoder.length < length:
            self._decoder = self._key = None  # free the old buffers and graphs first
            self._decoder = _Decoder(self.adapter, rows, length, stop_ids, temperature, top_p, self.cuda_graphs,
                                     self.compile_step, self.attention)
            self._key = key
        return self._decoder

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int], stop_token_ids: list[int],
                 pad_id: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 prompt_seeds: Sequence[int] | None = None) -> list[list[int]]:
        """See static_generate."""
        results: list[list[int]] = [[] for _ in prompts]
        for i, tokens in self.stream(prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                     pad_id=pad_id, batch_size=batch_size, temperature=temperature, top_p=top_p,
                                     seed=seed, prompt_seeds=prompt_seeds):
            results[i] = tokens
        return results

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int], stop_token_ids: list[int],
               pad_id: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
               prompt_seeds: Sequence[int] | None = None) -> Iterator[tuple[int, list[int]]]:
        """generate, yielding (index into prompts, new tokens) as prompts finish (not in input order), so a caller
        can pass every prompt in one call (refill then runs across all of them) and still save results as they
        come. Arguments are checked when iteration starts. One stream at a time per StaticGenerator."""
        budgets = self._check(prompts, max_new_tokens, stop_token_ids, pad_id, batch_size, temperature, top_p)
        if prompt_seeds is not None and len(prompt_seeds) != len(prompts):
            raise ValueError(f"prompt_seeds has {len(prompt_seeds)} seeds for {len(prompts)} prompts")
        if not prompts:
            return
        keys = [f"{seed}:{i}" for i in range(len(prompts))] if prompt_seeds is None else [
            prompt_key(s) for s in prompt_seeds]
        stops = [int(t) for t in stop_token_ids]
        rows = batch_size if self.fixed_rows else min(batch_size, len(prompts))
        length = round_up(max(len(p) + b for p, b in zip(prompts, budgets)), LENGTH_QUANTUM)
        # Graph capture and replay run on the current device: make it the target's.
        with torch.cuda.device(self.layout.device) if self.layout.device.type == "cuda" else nullcontext():
            decoder = self._decoder_for(rows, length, stops, temperature, top_p)
            decoder.begin([list(p) for p in prompts], budgets, keys)
            self.last_stats = ScheduleStats()
            yield from run_schedule(
                decoder, [len(p) for p in prompts], budgets, refill=self.refill,
                check_every=CHECK_EVERY_CUDA if self.layout.device.type == "cuda" else 1,
                admit_min=max(1, rows // REFILL_GROUPS), span_quantum=decoder.span_quantum, max_span=decoder.length,
                stats=self.last_stats,
            )

    def _check(self, prompts, max_new_tokens, stop_token_ids, pad_id, batch_size, temperature,
               top_p) -> list[int]:
        """Validate the arguments; the new-token budget of each prompt."""
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is an empty token list")
        if isinstance(max_new_tokens, Sequence):
            budgets = [int(b) for b in max_new_tokens]
            if len(budgets) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(budgets)} budgets for {len(prompts)} prompts")
        else:
            budgets = [int(max_new_tokens)] * max(1, len(prompts))
        if min(budgets, default=1) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {min(budgets)}")
        budgets = budgets[: len(prompts)]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not 0 <= pad_id < self.vocab_size:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in stop_token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        return budgets


def static_generate(adapter, prompts: list[list[int]], *, max_new_tokens: int | Sequence[int],
                    stop_token_ids: list[int], pad_id: int, batch_size: int, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, prompt_seeds: Sequence[int] | None = None,
                    cuda_graphs: bool | None = None, compile_step: bool = False,
                    refill: bool = True, attention: str = "sdpa") -> list[list[int]]:
    """The new tokens of each prompt (input order), up to and including its first stop token, at most its budget.

    max_new_tokens: one budget for all prompts or one per prompt. batch_size rows decode together; with refill
    (the default) a row whose prompt stopped takes the next pending prompt, so pass all prompts in one call.
    Greedy (argmax of the float32 logits) when temperature == 0, else temperature + top-p sampling where prompt i
    draws from its own uniform stream, keyed by (seed, i), or by prompt_seeds[i] when given (e.g. a hash of the
    prompt's id, so the stream also survives a resumed run that passes other prompts): the same tokens whichever
    row, batch size or refill setting (up to the float rounding of the batch a prompt runs in). cuda_graphs None =
    on for CUDA targets; CPU always runs without graphs. compile_step: run the decode step through torch.compile
    (fuses the norms, RoPE and residual adds into few kernels; compiling takes a while, and each new shape may
    recompile). attention: the decode step's, see StaticGenerator. pad_id is checked and kept for compatibility
    (prompts are right padded inside prefill, where padding is never attended). ValueError for a target
    supports_static_decode refuses and for bad arguments.
    """
    generator = StaticGenerator(adapter, cuda_graphs, compile_step, refill, attention)
    return generator.generate(prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, pad_id=pad_id,
                              batch_size=batch_size, temperature=temperature, top_p=top_p, seed=seed,
                              prompt_seeds=prompt_seeds)
