"""CUDA graphs of the static live engine (static_target.py, static_drafter.py), and their reuse across prompts.

Both sides of static live decoding run fixed-shape steps over preallocated buffers; each shape is captured once as
a CUDA graph and replayed per step, and the object holding the buffers and graphs is kept per model so a new
prompt does not capture again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

Shape = TypeVar("Shape", bound=Hashable)
Built = TypeVar("Built")


def capture_graphs(device: torch.device, shapes: Sequence[Shape], prepare: Callable[[Shape], None],
                   run: Callable[[Shape], Any]) -> dict[Shape, tuple[torch.cuda.CUDAGraph, Any]]:
    """One CUDA graph per shape of `run(shape)` (which reads and writes only static buffers), with its outputs.

    `prepare(shape)` sets the buffers a warm-up run of that shape needs (outside the graph). Warm-up runs on a
    side stream first (lazy initialisation must not land in a graph). The graphs share one memory pool: they never
    run concurrently and their outputs stay referenced here.
    """
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for shape in shapes:
                prepare(shape)
                run(shape)
        torch.cuda.current_stream(device).wait_stream(side)
        graphs, pool = {}, torch.cuda.graph_pool_handle()
        for shape in shapes:
            prepare(shape)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = run(shape)
            graphs[shape] = (graph, outputs)
    return graphs


def replay(graph: torch.cuda.CUDAGraph, device: torch.device) -> None:
    with torch.cuda.device(device):
        graph.replay()


# Per model, the static objects of live decoding by key. Weak keys: they go when the model goes (the objects hold
# the model's submodules, never the model itself).
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kept_for(model: torch.nn.Module, key: Hashable, length: int, build: Callable[[], Built]) -> Built:
    """The object kept for (model, key) when its `capacity` holds `length` positions, else a new `build()` (the
    old one is dropped first, freeing its buffers and graphs)."""
    objects = _KEPT.setdefault(model, {})
    kept = objects.get(key)
    if kept is None or kept.capacity < length:
        objects.pop(key, None)
        kept = objects[key] = build()
    return kept
