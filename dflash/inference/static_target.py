"""The target side of live speculative decoding over a static KV cache, the way a serving engine runs it.

CachedTarget (target_cache.py) runs the HF model over a DynamicCache (TargetAdapter.forward): each forward
re-dispatches hundreds of small kernels from Python, so on a GPU a small target is launch-bound and the measured
speedup says more about Python than about the drafter. StaticTarget runs the target's own HF decoder layers with the
attention of static decoding (dflash/models/targets/engine_attention.py) over one preallocated KV row. On CUDA the
fixed-shape forwards (1 token for target-only decoding; for a verify, every block size 2..block_size, the shorter
ones being the last blocks near max_new_tokens) replay CUDA graphs, one per (tokens, attention span), all captured
when the StaticTarget is built: (block_size - 1) x capacity / LENGTH_QUANTUM verify graphs (120 for block 16 and
1024 positions), the graphs of one size writing one set of outputs. A prefill (any length) and sizes without a graph
run eagerly.

Column c of the cache holds position c. A forward of n tokens at `length` writes columns length..length+n-1 and
each query attends over the columns up to its own position (in a sliding-window layer, the last `window` of them:
models/targets/static_attention.py), so a rollback only sets `length`: the columns of rejected drafts are masked
out until the next forward overwrites them. The targets of static decoding (supports_static_decode: dense
Llama-layout and Gemma 2/3 targets, sliding windows included); GDN hybrids keep CachedTarget.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from dflash.inference.row_schedule import round_up
from dflash.models.targets.static_attention import attention, visibility_masks
from dflash.inference.static_decode import LENGTH_QUANTUM
from dflash.inference.cuda_graphs import capture_graphs, replay
from dflash.inference.static_objects import kept_object
from dflash.inference.target_cache import check_rollback, token_ids
from dflash.models.targets.engine_attention import EngineCache, engine_attention

# Cache lengths are rounded up to this, so prompts of similar lengths share one StaticTarget and its graphs.
CAPACITY_QUANTUM = 1024

Outputs = tuple[torch.Tensor, torch.Tensor | None]


class StaticTarget:
    """One sequence (batch 1) through the target over a static KV cache of `capacity` positions.

    Same interface as CachedTarget: `forward(ids)` appends ids (a list, or a 1-D tensor that may stay on the
    device) at positions length.. and returns (logits [n, V], features [n, K*H] or None without `layer_ids`);
    `verify(ids)` is forward remembering where it started; `rollback(keep)`, right after it, keeps the first
    `keep` positions and returns None (nothing is recomputed). Features are those of capture(): layer id L = output
    of decoder layer L. `graph_sizes`: forward sizes replayed as CUDA graphs (cuda_graphs None = on for CUDA).
    """

    @torch.inference_mode()
    def __init__(self, adapter, layer_ids: list[int], capacity: int, graph_sizes: Sequence[int] = (),
                 cuda_graphs: bool | None = None) -> None:
        reason = adapter.static_layout_problem()
        if reason is not None:
            raise ValueError(f"the static live target does not support this target: {reason}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        self.layer_ids = adapter.check_layer_ids(layer_ids) if layer_ids else []
        # The target runs through adapter.forward with an EngineCache over this KV row. Held weakly: this object is
        # kept per model (static_target), and a strong hold on the adapter would keep the model, its key, alive.
        self._adapter, self.layout = weakref.ref(adapter), adapter.engine_layout
        lay = self.layout
        self.capacity = round_up(capacity, LENGTH_QUANTUM)
        shape = (1, lay.kv_heads, self.capacity, lay.head_dim)
        self.keys = [torch.zeros(shape, device=lay.device, dtype=lay.dtype) for _ in lay.layers]
        self.values = [torch.zeros(shape, device=lay.device, dtype=lay.dtype) for _ in lay.layers]
        self.rope = lay.rope_table(self.capacity)
        self.columns = torch.arange(self.capacity, device=lay.device)
        # `length` on the device: what a graph reads as the first position of its forward.
        self.start = torch.zeros((), dtype=torch.long, device=lay.device)
        self.length = 0
        self._verified: tuple[int, int] | None = None
        use_graphs = lay.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.graph_sizes = tuple(sorted({int(n) for n in graph_sizes if 0 < n <= self.capacity})) if use_graphs else ()
        self._inputs = {n: torch.zeros(n, dtype=torch.long, device=lay.device) for n in self.graph_sizes}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self._outputs: dict[int, Outputs] = {}  # per graph size: the outputs every span's graph writes
        if self.graph_sizes:
            spans = range(LENGTH_QUANTUM, self.capacity + 1, LENGTH_QUANTUM)
            # The warm-up writes garbage into columns that a real forward writes before reading.
            self._graphs = capture_graphs(
                lay.device, [(n, span) for n in self.graph_sizes for span in spans if n <= span],
                prepare=lambda shape: self.start.fill_(shape[1] - shape[0]),
                run=lambda shape: self._graph_run(*shape))

    @property
    def adapter(self):
        adapter = self._adapter()
        if adapter is None:
            raise ValueError("the target of this StaticTarget no longer exists")
        return adapter

    def reset(self) -> None:
        """An empty sequence (the cache columns are left as they are: nothing reads them before they are written)."""
        self.length = 0
        self._verified = None

    def _graph_run(self, n: int, span: int) -> Outputs:
        """What the graph of n tokens over `span` columns runs: _run, its outputs copied into the buffers of size n
        that the graphs of every span share, so graph outputs take memory per size rather than per size and span
        (logits [n, V] for 15 sizes x capacity / LENGTH_QUANTUM spans would be ~1 GB at V = 152k and 4k columns)."""
        logits, features = self._run(self._inputs[n], span, last_only=False)
        if n not in self._outputs:  # made by the first (warm-up) run, outside any graph
            self._outputs[n] = (torch.empty_like(logits), None if features is None else torch.empty_like(features))
        kept_logits, kept_features = self._outputs[n]
        kept_logits.copy_(logits)
        if kept_features is not None:
            kept_features.copy_(features)
        return kept_logits, kept_features

    def _run(self, ids: torch.Tensor, span: int, last_only: bool) -> Outputs:
        """Forward ids [n] at positions start..start+n-1, attending over the first `span` columns."""
        lay = self.layout
        n = ids.shape[0]
        positions = self.start + torch.arange(n, device=lay.device)
        rope = {kind: (cos[positions][None], sin[positions][None]) for kind, (cos, sin) in self.rope.items()}
        groups = lay.heads // lay.kv_heads
        # The query heads of one kv group act as groups x n query rows of that kv head (no copy of the cache), so
        # the masks [n, span] are repeated per group; additive, made once per forward, one per distinct window.
        masks = visibility_masks(self.columns[:span], positions.repeat(groups), lay.mask_windows, lay.dtype)

        def attend(index, q, k, v, scaling, window, softcap):
            keys, values = self.keys[index], self.values[index]
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)
            q = q.reshape(1, lay.kv_heads, groups * n, lay.head_dim)
            context = attention(q, keys[:, :, :span], values[:, :, :span], masks[window], scaling, softcap)
            return context.reshape(1, lay.heads, n, lay.head_dim).transpose(1, 2)

        cache = EngineCache(rope, attend, (0, slice(-1, None)) if last_only else 0)
        with engine_attention(lay.layers):
            features, logits = self.adapter.forward(ids[None], None, self.layer_ids, "logits", cache=cache)
        return logits, features[0] if features is not None else None

    @torch.inference_mode()
    def forward(self, ids: list[int] | torch.Tensor, last_logits_only: bool = False) -> Outputs:
        """Append `ids`; logits [n, V] (or [1, V] for the last position when last_logits_only) and features."""
        device = self.layout.device
        ids = token_ids(ids, device)
        n = ids.shape[0]
        if self.length + n > self.capacity:
            raise ValueError(f"{self.length} + {n} positions exceed the static cache of {self.capacity}")
        span = round_up(self.length + n, LENGTH_QUANTUM)
        self.start.fill_(self.length)
        entry = self._graphs.get((n, span))
        if entry is None:
            logits, features = self._run(ids, span, last_logits_only)
        else:
            graph, (logits, features) = entry
            self._inputs[n].copy_(ids)
            replay(graph, device)
            # The graph's outputs are overwritten by its next replay: hand out copies.
            logits = (logits[-1:] if last_logits_only else logits).clone()
            features = features.clone() if features is not None else None
        self.length += n
        return logits, features

    @torch.inference_mode()
    def verify(self, ids: list[int] | torch.Tensor) -> Outputs:
        """forward(ids), remembering where the block starts for rollback."""
        self._verified = (self.length, len(ids))
        return self.forward(ids)

    def rollback(self, keep: int) -> None:
        """Keep the first `keep` positions of the last verify (static columns: only the length changes)."""
        if self._verified is None:
            raise ValueError("rollback must follow a verify directly; there was no verify")
        check_rollback(*self._verified, self.length, keep)
        self.length = keep


def static_target(adapter, layer_ids: list[int], *, length: int, graph_sizes: Sequence[int] = ()) -> StaticTarget:
    """An empty StaticTarget for `adapter` with room for `length` positions, kept per (model, taps, graph sizes)
    across calls so its graphs are captured once (rebuilt with a larger capacity when `length` outgrows it)."""
    key = ("target", tuple(layer_ids), tuple(sorted(set(graph_sizes))))
    target = kept_object(adapter.model, key, length, lambda: StaticTarget(
        adapter, layer_ids, round_up(length, CAPACITY_QUANTUM), graph_sizes))
    target.reset()
    return target
