"""Fast batched decoding of dense Llama-layout targets: a static KV cache and, on CUDA, one CUDA graph per step.

Plain HF `generate` re-dispatches hundreds of small kernels from Python for every token, so a small target such as
SmolLM2-135M is launch-bound (~550 tok/s at batch 64 on an H200). Here the target's own HF submodules (norms,
q/k/v/o projections, q_norm/k_norm, MLP) run under our attention over a preallocated cache, and the whole decode
step (embedding -> layers -> final norm -> lm_head -> next-token choice -> cache and state updates) is captured
once in a CUDA graph and replayed for every token.

Same conventions as HF greedy `generate`, so at T=0 in float32 the tokens match it: left padding, the position of
column c in row r is c - pad_r, keys of row r are valid from column pad_r up to the current column, the next
token is the argmax of the float32 logits. Sampling (T > 0) is temperature + top-p from a seeded generator: the
right distribution, not HF's random stream.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

ENGINES = ("hf", "static", "auto")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants whose frequencies depend on the sequence length: a position table computed once would be wrong.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# The KV cache length is rounded up to this, so similar batches share one captured graph and SDPA sees aligned
# shapes.
LENGTH_QUANTUM = 64
# Prompt tokens per prefill slice: bounds the prefill's [rows, 1, P, P] mask and activations.
PREFILL_TOKENS = 32768
# On CUDA, "has every row stopped?" costs a device sync: ask every few steps only.
CHECK_EVERY_CUDA = 8


def unsupported_reason(adapter) -> str | None:
    """Why static decoding cannot run this target, or None when it can."""
    if adapter.model_type not in FAMILIES:
        return f"model_type {adapter.model_type!r} is not a dense family static decoding supports {FAMILIES}"
    text_model = adapter.text_model()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(text_model, name):
            return f"{type(text_model).__name__} has no {name}"
    rope_type = getattr(text_model.rotary_emb, "rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    config = adapter.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer_types {sorted(set(layer_types))} are not all full_attention"
    for i, layer in enumerate(adapter.decoder_layers()):
        attn = getattr(layer, "self_attn", None)
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                return f"decoder layer {i} has no {name}"
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"decoder layer {i} has no self_attn with q/k/v/o projections"
        if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
            return f"decoder layer {i} has only one of q_norm/k_norm"
        # Qwen layers keep their own window (None when off); Mistral's attention reads it from the config.
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        if window is not None:
            return f"decoder layer {i} uses a sliding window ({window})"
    return None


def supports_static_decode(adapter) -> bool:
    """True for dense full-attention llama/mistral/qwen2/qwen3 targets (SmolLM2 included); False for GDN hybrids."""
    return unsupported_reason(adapter) is None


def resolve_engine(engine: str, adapter) -> str:
    """"hf" or "static" for a requested engine: "auto" is static on a supported CUDA target, else hf."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        on_cuda = torch.device(adapter.device).type == "cuda"
        return "static" if on_cuda and supports_static_decode(adapter) else "hf"
    if engine == "static" and not supports_static_decode(adapter):
        raise ValueError(f"engine 'static' cannot decode this target: {unsupported_reason(adapter)}; use 'hf'")
    return engine


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature) cut to its top-p nucleus, by inverse CDF.

    `uniform` [b] holds one U[0, 1) draw per row; no randomness is drawn here, so the function can live in a
    CUDA graph. The nucleus is the smallest set of most likely tokens whose mass reaches top_p (as HF's top-p).
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs * ((probs.cumsum(dim=-1) - probs) < top_p)
    cdf = probs.cumsum(dim=-1)
    threshold = uniform[:, None] * cdf[:, -1:]
    choice = (cdf < threshold).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    return (order.gather(-1, choice) if top_p < 1.0 else choice).squeeze(-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as the llama/qwen families apply it, x * cos + [-x2, x1] * sin, written as a roll times a
    sin whose first half is negated: the same numbers, one kernel fewer per call."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


@dataclass(frozen=True)
class _Layout:
    """The target's modules and attention shape, read once."""

    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Module
    rotary: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, adapter) -> _Layout:
        text_model = adapter.text_model()
        attn = adapter.decoder_layers()[0].self_attn
        config = adapter.config
        head_dim = int(getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return cls(
            embed=text_model.embed_tokens, layers=adapter.decoder_layers(), norm=text_model.norm,
            head=adapter.model.get_output_embeddings(), rotary=text_model.rotary_emb,
            heads=int(config.num_attention_heads), kv_heads=int(config.num_key_value_heads), head_dim=head_dim,
            scaling=float(getattr(attn, "scaling", head_dim**-0.5)), device=torch.device(adapter.device),
            dtype=adapter.dtype,
        )

    def project(self, attn: nn.Module, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """q [b, H, t, D], k and v [b, kv, t, D] of hidden states h [b, t, hidden], RoPE applied (cos and signed_sin
        [b, t, D], see _rotate)."""
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, -1, self.head_dim)
        k = attn.k_proj(h).view(b, t, -1, self.head_dim)
        v = attn.v_proj(h).view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, signed_sin = cos[:, None], signed_sin[:, None]
        q, k = _rotate(q.transpose(1, 2), cos, signed_sin), _rotate(k.transpose(1, 2), cos, signed_sin)
        return q, k, v.transpose(1, 2)


class _Decoder:
    """Static buffers, prefill and decode step for one (batch rows, cache length, choice rule)."""

    def __init__(self, layout: _Layout, rows: int, length: int, stop_ids: list[int], temperature: float,
                 top_p: float, use_graph: bool, compile_step: bool = False) -> None:
        self.layout, self.rows, self.length = layout, rows, length
        self.temperature, self.top_p = temperature, top_p
        device, lay = layout.device, layout
        cache_shape = (rows, lay.kv_heads, length, lay.head_dim)
        self.keys = [torch.zeros(cache_shape, device=device, dtype=lay.dtype) for _ in lay.layers]
        self.values = [torch.zeros(cache_shape, device=device, dtype=lay.dtype) for _ in lay.layers]
        self.columns = torch.arange(length, device=device)
        # Positions are looked up in a table: elementwise the same numbers the rotary module gives per batch.
        probe = torch.zeros(1, device=device, dtype=lay.dtype)
        cos, sin = lay.rotary(probe, self.columns[None])
        half = lay.head_dim // 2
        self.cos, self.signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        self.stops = torch.tensor(stop_ids, device=device, dtype=torch.long)
        self.tokens = torch.zeros(rows, device=device, dtype=torch.long)
        self.positions = torch.zeros(rows, device=device, dtype=torch.long)
        self.pads = torch.zeros(rows, device=device, dtype=torch.long)
        self.column = torch.zeros(1, device=device, dtype=torch.long)
        self.step_index = torch.zeros(1, device=device, dtype=torch.long)
        self.finished = torch.zeros(rows, device=device, dtype=torch.bool)
        self.out = torch.zeros(rows, length, device=device, dtype=torch.long)
        self.uniform = torch.zeros(rows, device=device, dtype=torch.float32)
        self.compile_step = compile_step
        self.graph = self._capture() if use_graph else None

    def _capture(self) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream before capturing (lazy initialisation must not land in the graph). The warm-up
        # scribbles on the state buffers; run() resets all of them.
        side = torch.cuda.Stream(device=self.layout.device)
        side.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self.advance()
        torch.cuda.current_stream(self.layout.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.advance()
        return graph

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        return sample_tokens(logits, self.temperature, self.top_p, self.uniform)

    def record(self, tokens: torch.Tensor) -> None:
        """Store the chosen tokens and advance to the next column."""
        self.out.index_copy_(1, self.step_index, tokens[:, None])
        self.finished |= (tokens[:, None] == self.stops).any(dim=-1)
        self.tokens.copy_(tokens)
        self.positions += 1
        self.column += 1
        self.step_index += 1

    def advance(self) -> None:
        """One decode step, compiled or not."""
        if self.compile_step:
            _compiled_step()(self)
        else:
            self.step()

    def step(self) -> None:
        """One decode step for every row: feed `tokens` at `column`, choose and record the next tokens."""
        lay = self.layout
        x = lay.embed(self.tokens[:, None])
        cos, signed_sin = self.cos[self.positions][:, None], self.signed_sin[self.positions][:, None]
        valid = (self.columns >= self.pads[:, None]) & (self.columns <= self.column)
        # An additive mask made once per step (SDPA would convert a boolean one in every layer).
        bias = torch.zeros(valid.shape, device=valid.device, dtype=lay.dtype).masked_fill_(~valid, float("-inf"))
        bias = bias[:, None, None, :]
        groups = lay.heads // lay.kv_heads
        for layer, keys, values in zip(lay.layers, self.keys, self.values):
            attn = layer.self_attn
            q, k, v = lay.project(attn, layer.input_layernorm(x), cos, signed_sin)
            keys.index_copy_(2, self.column, k)
            values.index_copy_(2, self.column, v)
            # The query heads of one kv group act as the query rows of that kv head: no copy of the cache.
            q = q.reshape(self.rows, lay.kv_heads, groups, lay.head_dim)
            context = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=lay.scaling)
            x = x + attn.o_proj(context.reshape(self.rows, 1, lay.heads * lay.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = lay.head(lay.norm(x[:, -1])).float()
        self.record(self.choose(logits))

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompts [rows, P] into the cache; float32 logits [rows, V] of the last column."""
        lay = self.layout
        width = ids.shape[1]
        cols = self.columns[:width]
        causal = cols[:, None] >= cols[None, :]
        # A padding query sees itself too: a fully masked row would give NaN, and NaN values in the cache would
        # poison later steps even behind a mask (0 * NaN).
        diagonal = torch.eye(width, device=ids.device, dtype=torch.bool)
        groups = lay.heads // lay.kv_heads
        logits = []
        step = max(1, PREFILL_TOKENS // width)
        for start in range(0, self.rows, step):
            rows = slice(start, min(start + step, self.rows))
            pads = self.pads[rows]
            mask = ((causal & (cols[None, None, :] >= pads[:, None, None])) | diagonal)[:, None]
            positions = (cols[None, :] - pads[:, None]).clamp(min=0)
            cos, signed_sin = self.cos[positions], self.signed_sin[positions]
            x = lay.embed(ids[rows])
            for layer, keys, values in zip(lay.layers, self.keys, self.values):
                attn = layer.self_attn
                q, k, v = lay.project(attn, layer.input_layernorm(x), cos, signed_sin)
                keys[rows, :, :width] = k
                values[rows, :, :width] = v
                context = F.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask,
                    scale=lay.scaling,
                )
                x = x + attn.o_proj(context.transpose(1, 2).reshape(x.shape[0], width, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits.append(lay.head(lay.norm(x[:, -1])).float())
        return torch.cat(logits)

    def run(self, prompts: list[list[int]], real: int, max_new_tokens: int, pad_id: int,
            generator: torch.Generator | None) -> list[list[int]]:
        """New tokens of each of the first `real` prompts (the others are dummy rows), cut at max_new_tokens."""
        device = self.layout.device
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        self.pads.copy_(torch.tensor([width - len(p) for p in prompts], device=device))
        self.finished.copy_(torch.arange(self.rows, device=device) >= real)
        self.out.zero_()
        logits = self.prefill(ids)
        self.positions.copy_(width - 1 - self.pads)
        self.column.fill_(width - 1)
        self.step_index.zero_()
        check_every = CHECK_EVERY_CUDA if device.type == "cuda" else 1
        for step in range(max_new_tokens):
            if step and step % check_every == 0 and bool(self.finished.all()):
                break
            if generator is not None:
                self.uniform.uniform_(generator=generator)
            if step == 0:
                self.record(self.choose(logits))
            elif self.graph is not None:
                self.graph.replay()
            else:
                self.advance()
        return [row[:max_new_tokens] for row in self.out[:real].tolist()]


@cache
def _compiled_step():
    """_Decoder.step through torch.compile (one compiled function for all decoders; new shapes recompile)."""
    return torch.compile(_Decoder.step, fullgraph=True)


def _batch_generator(seed: int, batch: int, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{batch}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


def _cut(row: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in stops:
            return row[: i + 1]
    return row


class StaticGenerator:
    """static_generate for one target, keeping the buffers and CUDA graph of the last shape across calls.

    Use one per run when calling many times (e.g. once per journal batch) so that batches of the same shape do not
    capture their graph again.
    """

    def __init__(self, adapter, cuda_graphs: bool | None = None, compile_step: bool = False) -> None:
        reason = unsupported_reason(adapter)
        if reason is not None:
            raise ValueError(f"static decoding does not support this target: {reason}")
        self.layout = _Layout.of(adapter)
        self.vocab_size = int(adapter.vocab_size)
        on_cuda = self.layout.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA target; this one is on {self.layout.device}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        # Pad every batch to batch_size rows so one graph serves them all (eager runs need not).
        self.fixed_rows = self.cuda_graphs
        self.compile_step = compile_step
        self._decoder: _Decoder | None = None
        self._key: tuple | None = None

    def _decoder_for(self, rows: int, length: int, stop_ids: list[int], temperature: float,
                     top_p: float) -> _Decoder:
        key = (rows, length, tuple(stop_ids), temperature, top_p)
        if key != self._key:
            self._decoder = self._key = None  # free the old buffers and graph first
            self._decoder = _Decoder(self.layout, rows, length, stop_ids, temperature, top_p, self.cuda_graphs,
                                     self.compile_step)
            self._key = key
        return self._decoder

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int], pad_id: int,
                 batch_size: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
        """See static_generate."""
        self._check(prompts, max_new_tokens, stop_token_ids, pad_id, batch_size, temperature, top_p)
        if not prompts:
            return []
        # Graph capture and replay run on the current device: make it the target's.
        with torch.cuda.device(self.layout.device) if self.layout.device.type == "cuda" else nullcontext():
            return self._generate(prompts, max_new_tokens, [int(t) for t in stop_token_ids], pad_id, batch_size,
                                  temperature, top_p, seed)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int,
                  batch_size: int, temperature: float, top_p: float, seed: int) -> list[list[int]]:
        # Longest first, so a batch holds similar lengths (little padding).
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list[list[int]] = [[] for _ in prompts]
        stop_set = set(stops)
        for batch, start in enumerate(range(0, len(order), batch_size)):
            index = order[start: start + batch_size]
            rows = [list(prompts[i]) for i in index]
            num_rows = batch_size if self.fixed_rows else len(rows)
            rows += [[pad_id]] * (num_rows - len(rows))
            length = -(-(max(len(r) for r in rows) + max_new_tokens) // LENGTH_QUANTUM) * LENGTH_QUANTUM
            decoder = self._decoder_for(num_rows, length, stops, temperature, top_p)
            generator = _batch_generator(seed, batch, self.layout.device) if temperature > 0 else None
            outputs = decoder.run(rows, len(index), max_new_tokens, pad_id, generator)
            for i, row in zip(index, outputs):
                results[i] = _cut(row, stop_set)
        return results

    def _check(self, prompts, max_new_tokens, stop_token_ids, pad_id, batch_size, temperature, top_p) -> None:
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is an empty token list")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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


def static_generate(adapter, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: list[int],
                    pad_id: int, batch_size: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                    cuda_graphs: bool | None = None, compile_step: bool = False) -> list[list[int]]:
    """The new tokens of each prompt (input order), up to and including its first stop token, at most max_new_tokens.

    Greedy (argmax of the float32 logits) when temperature == 0, else temperature + top-p sampling seeded from
    `seed` and the batch's index. cuda_graphs None = on for CUDA targets; CPU always runs without graphs.
    compile_step: run the decode step through torch.compile (fuses the norms, RoPE and residual adds into few
    kernels; compiling takes a while, and each new batch shape may recompile). ValueError for a target
    supports_static_decode refuses and for bad arguments.
    """
    generator = StaticGenerator(adapter, cuda_graphs, compile_step)
    return generator.generate(prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, pad_id=pad_id,
                              batch_size=batch_size, temperature=temperature, top_p=top_p, seed=seed)
