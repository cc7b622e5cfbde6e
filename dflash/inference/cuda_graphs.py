"""CUDA graphs of fixed-shape steps over static buffers: the static generation engine (inference/static_decode.py) and
static live decoding (inference/static_target.py, inference/static_drafter.py) capture theirs here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

Shape = TypeVar("Shape", bound=Hashable)

# Held while graphs are recorded. A capture fails when another thread calls into CUDA meanwhile, so work that does so
# in the background of a run (the feature memory's page-locking, dflash/extract/feature_memory.py) takes it first.
RECORDING = threading.Lock()


def capture_graphs(device: torch.device, shapes: Sequence[Shape], prepare: Callable[[Shape], None],
                   run: Callable[[Shape], Any], warmups: int = 1,
                   pool: Any = None) -> dict[Shape, tuple[torch.cuda.CUDAGraph, Any]]:
    """One CUDA graph per shape of `run(shape)` (which reads and writes only static buffers), with its outputs.

    `prepare(shape)` sets the buffers a warm-up run of that shape needs (outside the graph). `warmups` runs of each
    shape go on a side stream first (lazy initialisation, and compilation, must not land in a graph). The graphs
    share one memory pool (`pool`, from torch.cuda.graph_pool_handle(), or a new one): they never run concurrently
    and their outputs stay referenced here. A caller that captures shapes one at a time passes the same pool each
    time. The recording holds RECORDING.
    """
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for shape in shapes:
                for _ in range(warmups):
                    prepare(shape)
                    run(shape)
        torch.cuda.current_stream(device).wait_stream(side)
        graphs, pool = {}, pool if pool is not None else torch.cuda.graph_pool_handle()
        with RECORDING:
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
