"""The colocated capture's target forward over fixed shapes, replayed as CUDA graphs (capture.cuda_graphs).

A colocated training step runs the frozen target once per micro-batch (colocated.py). For a small target the host
bounds that forward: SmolLM2-135M's compiled layers still dispatch ~800 operators a micro-batch (session 10's step
profile), for a forward the GPU finishes in less time than the host takes to issue it. Here the forward is one
CUDA graph replay: the micro-batch's padded width is rounded up to a multiple of `width_step`, one graph per width
step up to the longest sample, all in one memory pool. The first micro-batch of a row count captures every width
of that count at once (every micro-batch of a run has train.micro_batch_size rows: placeholders fill the last
ones), inside the first training step, which compiles anyway: a capture waits for the device and empties the
allocator's cache, which later in training would cost the next step its allocations. The pool keeps the widest
forward's intermediates reserved for the run (the eager forward hands them back after each micro-batch).

The forward is the static engines' run of the target's own modules (TargetLayout.run, layout.py: the embedding,
each decoder layer's own forward under engine_attention, up to the deepest tap or the final norm) with an attention
that keeps no cache: causal (within each layer's sliding window, with Gemma 2's soft cap), which is all right
padding needs (a real position never sees a padded one). Layers compiled by capture.compile (dynamic shapes)
compile one graph for every layer and width here too, and the graphs replay the compiled kernels. The features of
real positions equal TargetAdapter.capture's up to the kernels' rounding (tests/test_static_capture.py); padded
positions hold unspecified states, as there. Without CUDA graphs (`cuda_graphs=False`, the only way on a CPU) the
same forward runs eagerly, which the CPU tests check.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dflash.inference.cuda_graphs import capture_graphs, replay
from dflash.models.targets.engine_attention import engine_attention
from dflash.models.targets.static_attention import attention, visibility_masks

logger = logging.getLogger(__name__)

WIDTH_STEP = 64  # padded widths are rounded up to a multiple of this: one graph per step of width


class StaticCapture:
    """`(ids [rows, width]) -> (features [rows, width, K*H], final [rows, width, H] or None)` of the taps in
    `layer_ids` order (final: the final normed hidden state, with `final_hidden`), fresh tensors the caller owns.

    adapter: a target the static engines run (its static_layout_problem() says why not); max_width: the longest
    sample, which sizes the static buffers; pad_id: the token the rounded-up columns hold; cuda_graphs: replay CUDA
    graphs (needs the target on a CUDA device) or run eagerly.
    """

    def __init__(self, adapter: Any, layer_ids: list[int], final_hidden: bool, max_width: int, pad_id: int,
                 cuda_graphs: bool = True, width_step: int = WIDTH_STEP) -> None:
        problem = adapter.static_layout_problem()
        if problem is not None:
            raise ValueError(f"capture.cuda_graphs runs the target's layers over fixed shapes, which this target "
                             f"does not allow: {problem}; set capture.cuda_graphs=false")
        self.layout = layout = adapter.engine_layout
        self.device = layout.device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"capture.cuda_graphs needs the target on a CUDA device, not {self.device}")
        self.layer_ids, self.hidden_size = list(layer_ids), adapter.hidden_size
        self.final_hidden, self.pad_id = final_hidden, pad_id
        self.width_step, self.cuda_graphs = width_step, cuda_graphs
        self.max_width = self.rounded(max_width)
        # The deepest tap is where a forward without the final state stops (as TargetAdapter.capture stops there).
        self.depth = len(layout.layers) if final_hidden else max(self.layer_ids) + 1
        self.rope = layout.rope_table(self.max_width)
        self.columns = torch.arange(self.max_width, device=self.device)
        self.groups = layout.heads // layout.kv_heads
        # Per row count: the ids buffer and the output buffers every graph of that count writes its first columns of.
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None

    def rounded(self, width: int) -> int:
        return -(-width // self.width_step) * self.width_step

    def capture(self, rows: int) -> int:
        """Capture the graph of every width for micro-batches of `rows` (no-op without CUDA graphs); how many were
        captured now."""
        if not self.cuda_graphs:
            return 0
        started = time.perf_counter()
        widths = range(self.width_step, self.max_width + 1, self.width_step)
        missing = [(rows, width) for width in widths if (rows, width) not in self.graphs]
        for key in missing:
            self.graphs[key] = self._capture(*key)
        if missing:
            logger.info(f"[train] the colocated target's forward as CUDA graphs: {len(missing)} widths up to "
                        f"{self.max_width} of {rows} rows captured in {time.perf_counter() - started:.1f} s")
        return len(missing)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, width = ids.shape
        if width > self.max_width:
            raise ValueError(f"a micro-batch {width} tokens wide is longer than the {self.max_width} the static "
                             f"capture was sized for")
        padded = self.rounded(width)
        if not self.cuda_graphs:
            wide = torch.full((rows, padded), self.pad_id, dtype=torch.long, device=self.device)
            wide[:, :width] = ids
            features, final = self.forward(wide)
            return features[:, :width], None if final is None else final[:, :width]
        if (rows, padded) not in self.graphs:
            self.capture(rows)
        buffers = self._buffers(rows)
        buffers["ids"][:, :width].copy_(ids)
        buffers["ids"][:, width:padded].fill_(self.pad_id)
        replay(self.graphs[(rows, padded)], self.device)
        # Copies: a later replay rewrites the buffers while this micro-batch's features may still wait for its step.
        features = buffers["features"][:, :width].clone()
        return features, buffers["final"][:, :width].clone() if self.final_hidden else None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The taps' features and (final_hidden) the final normed state of right-padded ids [rows, width]."""
        layout, width = self.layout, ids.shape[1]
        rope = {kind: (cos[None, :width], sin[None, :width]) for kind, (cos, sin) in self.rope.items()}
        with torch.no_grad(), engine_attention(layout.layers):
            hidden, taps = layout.run(ids, rope, self.attend, self.layer_ids, depth=self.depth)
        features = torch.cat([taps[i] for i in self.layer_ids], dim=-1)
        return features, layout.norm(hidden) if self.final_hidden else None

    def attend(self, _index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
        """Every layer's attention (engine_attention.LayerAttend, which keeps no cache, so the layer's index is
        unused): q [b, H, t, D], k and v [b, kv, t, D] -> [b, t, H, D], causal within `window`, logits capped by
        `softcap`. Right padding needs no padding mask: the causal one keeps real positions off the padding."""
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        mask = None  # SDPA's own causal mask
        if window is not None or softcap is not None:  # a window, or capped logits, which need an explicit mask
            columns = self.columns[:q.shape[2]]
            mask = visibility_masks(columns, columns, (window,), q.dtype)[window]
        return attention(q, k, v, mask, scaling, softcap).transpose(1, 2)

    def _buffers(self, rows: int) -> dict[str, torch.Tensor]:
        if rows not in self.buffers:
            layout, shape, hidden = self.layout, (rows, self.max_width), self.hidden_size
            buffers = {"ids": torch.full(shape, self.pad_id, dtype=torch.long, device=self.device),
                       "features": torch.empty(*shape, len(self.layer_ids) * hidden, dtype=layout.dtype,
                                               device=self.device)}
            if self.final_hidden:
                buffers["final"] = torch.empty(*shape, hidden, dtype=layout.dtype, device=self.device)
            self.buffers[rows] = buffers
        return self.buffers[rows]

    def _capture(self, rows: int, width: int) -> torch.cuda.CUDAGraph:
        buffers = self._buffers(rows)

        def run(_shape) -> None:
            features, final = self.forward(buffers["ids"][:, :width])
            buffers["features"][:, :width].copy_(features)
            if final is not None:
                buffers["final"][:, :width].copy_(final)

        # The warm-up and the capture run on the ids already in the buffer: nothing to prepare.
        graphs = capture_graphs(self.device, [(rows, width)], prepare=lambda _shape: None, run=run, pool=self.pool)
        return graphs[(rows, width)][0]
