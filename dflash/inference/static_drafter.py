"""The drafter side of static live decoding: the cached drafter context in preallocated buffers, and on CUDA its
fixed-shape steps (appending 1..block_size verified positions, drafting a block of 2..block_size positions)
replayed as CUDA graphs.

CachedDrafter (drafter_cache.py) concatenates each step's new keys/values onto the whole context and runs the
block's kernels eagerly, one Python dispatch each. Here column c of every layer's buffer holds position c:
`extend` writes columns length..length+n-1, and a block attends over the first `span` columns with those at or
after `length` masked out, through the same context_keys_values / block_hidden math (tests: equal to
CachedDrafter).
"""

from __future__ import annotations

import weakref

import torch

from dflash.inference.row_schedule import round_up
from dflash.inference.static_decode import LENGTH_QUANTUM
from dflash.inference.drafter_cache import block_hidden, check_context, check_features, context_keys_values
from dflash.inference.cuda_graphs import capture_graphs, replay
from dflash.inference.static_objects import kept_object
from dflash.inference.static_target import CAPACITY_QUANTUM
from dflash.models.drafter import DFlashDraftModel


class StaticDrafter:
    """CachedDrafter's interface (config, length, extend, hidden) over a static context of `capacity` positions.

    On CUDA (cuda_graphs None = on there) `extend` of 1..block_size positions and `hidden` of blocks of
    2..block_size positions (full blocks and the shorter last blocks near max_new_tokens) run as CUDA graphs,
    captured when the StaticDrafter is built: block_size + (block_size - 1) x capacity / LENGTH_QUANTUM graphs
    (136 for block 16 and 1024 positions). A prompt's extend runs eagerly. A shorter block is not padded to a full
    one: block positions attend to each other, so padding would change the drafts.
    """

    @torch.inference_mode()
    def __init__(self, drafter: DFlashDraftModel, capacity: int, cuda_graphs: bool | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        # A weak reference: kept_object keeps this object per drafter, which must stay free to go.
        self._drafter = weakref.ref(drafter)
        self.config = config = drafter.config
        self.device = device = drafter.fc.weight.device
        dtype = drafter.fc.weight.dtype
        self.capacity = round_up(capacity, LENGTH_QUANTUM)
        self.keys, self.values = [], []
        for layer in drafter.layers:
            attn = layer.self_attn
            shape = (1, attn.num_kv_heads, self.capacity, attn.head_dim)
            self.keys.append(torch.zeros(shape, device=device, dtype=dtype))
            self.values.append(torch.zeros(shape, device=device, dtype=dtype))
        self.columns = torch.arange(self.capacity, device=device)
        # `length` on the device: what a graph reads as the first position it writes or drafts.
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.length = 0
        block, width = config.block_size, config.num_taps * config.hidden_size
        self._features = {n: torch.zeros(n, width, device=device, dtype=dtype) for n in range(1, block + 1)}
        # The sizes a live step drafts (a block is the anchor and at least one mask position).
        self._noise = {n: torch.zeros(n, config.hidden_size, device=device, dtype=dtype) for n in range(2, block + 1)}
        self._graphs: dict = {}
        use_graphs = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs:
            spans = range(LENGTH_QUANTUM, self.capacity + 1, LENGTH_QUANTUM)
            # Warm-ups write garbage into columns that extend() writes before a block reads them.
            blocks = [("block", n, span) for n in self._noise for span in spans]
            self._graphs = capture_graphs(
                device, [("extend", n) for n in self._features] + blocks,
                prepare=lambda shape: self.start.fill_(0 if shape[0] == "extend" else shape[2]),
                run=lambda shape: (self._write(self._features[shape[1]]) if shape[0] == "extend"
                                   else self._block(self._noise[shape[1]], shape[2])))

    @property
    def drafter(self) -> DFlashDraftModel:
        drafter = self._drafter()
        if drafter is None:
            raise ValueError("the drafter of this StaticDrafter no longer exists")
        return drafter

    def reset(self) -> None:
        """An empty context (the buffers are left as they are: columns >= length are never read)."""
        self.length = 0

    def _write(self, features: torch.Tensor) -> None:
        """Context keys/values of features [n, K*H] into columns start..start+n-1."""
        positions = self.start + torch.arange(features.shape[0], device=self.device)
        new = context_keys_values(self.drafter, features[None], positions[None])
        for keys, values, (k, v) in zip(self.keys, self.values, new):
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)

    def _block(self, noise_embedding: torch.Tensor, span: int) -> torch.Tensor:
        """Drafter output [size, H] of the block at positions start.. over the context columns < start."""
        size = noise_embedding.shape[0]
        positions = (self.start + torch.arange(size, device=self.device))[None]
        columns = self.columns[:span]
        context = [(keys[:, :, :span], values[:, :, :span]) for keys, values in zip(self.keys, self.values)]
        return block_hidden(self.drafter, noise_embedding[None], positions, context, columns[None],
                            (columns < self.start)[None])[0]

    @torch.inference_mode()
    def extend(self, features: torch.Tensor) -> None:
        """CachedDrafter.extend: the features [n, K*H] of positions length..length+n-1 into the context."""
        check_features(self.config, features)
        n = features.shape[0]
        if self.length + n > self.capacity:
            raise ValueError(f"{self.length} + {n} positions exceed the static drafter context of {self.capacity}")
        self.start.fill_(self.length)
        entry = self._graphs.get(("extend", n))
        if entry is None:
            self._write(features)
        else:
            self._features[n].copy_(features)
            replay(entry[0], self.device)
        self.length += n

    @torch.inference_mode()
    def hidden(self, noise_embedding: torch.Tensor) -> torch.Tensor:
        """CachedDrafter.hidden: drafter output [size, H] of the block embedded as `noise_embedding` [size, H]
        right after the context (anchor at position `length`)."""
        check_context(self.length)
        span = round_up(self.length, LENGTH_QUANTUM)
        self.start.fill_(self.length)
        size = noise_embedding.shape[0]
        entry = self._graphs.get(("block", size, span))
        if entry is None:
            return self._block(noise_embedding, span)
        self._noise[size].copy_(noise_embedding)
        replay(entry[0], self.device)
        return entry[1].clone()  # the graph's output is overwritten by its next replay


def static_drafter(drafter: DFlashDraftModel, *, length: int) -> StaticDrafter:
    """An empty StaticDrafter for `drafter` with room for `length` positions, kept per drafter across calls so its
    graphs are captured once (rebuilt with a larger capacity when `length` outgrows it)."""
    context = kept_object(drafter, "drafter", length,
                          lambda: StaticDrafter(drafter, round_up(length, CAPACITY_QUANTUM)))
    context.reset()
    return context
