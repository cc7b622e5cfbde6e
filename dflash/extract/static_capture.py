"""The colocated capture's target forward over fixed shapes, replayed as CUDA graphs (capture.cuda_graphs).

A colocated training step runs the frozen target once per micro-batch (colocated.py). For a small target the host
bounds that forward: SmolLM2-135M's compiled layers still dispatch ~800 operators a micro-batch (session 10's step
profile), for a forward the GPU finishes in less time than the host takes to issue it. Here the forward is one
CUDA graph replay: the micro-batch's padded width is rounded up to a multiple of `width_step`, one graph per width
step up to the longest sample, all in one memory pool. `capture(rows)` captures every width of a row count before
training (a capture waits for the device and empties the allocator's cache, which inside training would cost the
next step its allocations); another row count is captured when it first comes. The pool keeps the intermediates of
the widest forward reserved for the run (the eager forward hands them back after each micro-batch).

The forward is TargetLayout.run (layout.py), the static engines' run of the target's own modules, with an attention
that keeps no cache: causal (and within each layer's sliding window, with Gemma 2's soft cap), which is all right
padding needs (a real position never sees a padded one). The features of real positions equal
TargetAdapter.capture's up to the attention kernels' rounding (tests/test_static_capture.py); padded positions
hold unspecified states, as there. The layers run eagerly inside the graph (capture.compile is then unused).
Without CUDA graphs (`cuda_graphs=False`, the only way on a CPU) the same forward runs eagerly, which the CPU tests
check.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.inference.cuda_graphs import capture_graphs, replay
from dflash.models.targets.engine_attention import engine_attention
from dflash.models.targets.static_attention import attention, visibility_masks

WIDTH_STEP = 64  # padded widths are rounded up to a multiple of this: one graph per step of width


class StaticCapture:
    """`(ids [rows, width]) -> (features [rows, width, K*H], final [rows, width, H] or None)` of the taps in
    `layer_ids` order (final: the final normed hidden state, with `final_hidden`), fresh tensors the caller owns.

    adapter: a target TargetLayout runs (layout_problem says which do not); max_width: the longest sample, which
    sizes the static buffers; pad_id: the token the rounded-up columns hold; cuda_graphs: replay CUDA graphs (needs
    the target on a CUDA device) or run eagerly.
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
        widths = range(self.width_step, self.max_width + 1, self.width_step)
        missing = [(rows, width) for width in widths if (rows, width) not in self.graphs]
        for key in missing:
            self.graphs[key] = self._capture(*key)
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
        buffers = self._buffers(rows)
        buffers["ids"][:, :width].copy_(ids)
        buffers["ids"][:, width:padded].fill_(self.pad_id)
        if (rows, padded) not in self.graphs:
            self.graphs[(rows, padded)] = self._capture(rows, padded)
        replay(self.graphs[(rows, padded)], self.device)
        # Copies: a later replay rewrites the buffers while this micro-batch's features may still wait for its step.
        features = buffers["features"][:, :width].clone()
        return features, buffers["final"][:, :width].clone() if self.final_hidden else None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The taps' features and (final_hidden) the final normed state of right-padded ids [rows, width]."""
        layout, width = self.layout, ids.shape[1]
        rope = {kind: (cos[None, :width], sin[None, :width]) for kind, (cos, sin) in self.rope.items()}
        # Right padding needs no padding mask: the causal one (within a window) keeps real positions off the padding.
        columns = self.columns[:width]
        masks = {None: None} if layout.plain else visibility_masks(columns, columns, layout.mask_windows,
                                                                   layout.dtype)

        def attend(_index, q, k, v, scaling, window, softcap):
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            return attention(q, k, v, masks[window], scaling, softcap).transpose(1, 2)

        with torch.no_grad(), engine_attention(layout.layers):
            hidden, taps = layout.run(ids, rope, attend, self.layer_ids, depth=self.depth)
        features = torch.cat([taps[i] for i in self.layer_ids], dim=-1)
        return features, layout.norm(hidden) if self.final_hidden else None

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
