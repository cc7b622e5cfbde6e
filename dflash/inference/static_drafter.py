"""The drafter side of static live decoding: the cached drafter context in preallocated buffers, and on CUDA its
fixed-shape steps (appending 1..block_size verified positions, drafting a block of 2..block_size positions)
replayed as CUDA graphs.

CachedDrafter (drafter_cache.py) concatenates each step's new keys/values onto the whole context and runs the
block's kernels eagerly, one Python dispatch each. Here column c of every layer's buffer holds position c:
`extend` writes columns length..length+n-1, and a block attends over the first `span` columns with those at or
after `length` masked out, through the same context_keys_values / block_drafts math (tests: equal to
CachedDrafter). A block's graph holds the whole drafting step: the target's embedding of [anchor, MASK...], the
drafter, the target's head and the argmax, so drafting a block launches two fills (its position and anchor) and
one graph.
"""

from __future__ import annotations

import weakref

import torch

from dflash.inference.row_schedule import round_up
from dflash.inference.static_decode import LENGTH_QUANTUM
from dflash.inference.drafter_cache import (TargetHead, block_drafts, block_hidden, check_context, check_features,
                                            context_keys_values)
from dflash.inference.cuda_graphs import capture_graphs, replay
from dflash.inference.static_objects import kept_object
from dflash.inference.static_target import CAPACITY_QUANTUM
from dflash.models.drafter import DFlashDraftModel


class StaticDrafter:
    """CachedDrafter's interface (config, length, extend, draft) over a static context of `capacity` positions,
    drafting through the target's `head`.

    On CUDA (cuda_graphs None = on there) `extend` of 1..block_size positions and `draft` of blocks of
    2..block_size positions (full blocks and the shorter last blocks near max_new_tokens) run as CUDA graphs,
    captured when the StaticDrafter is built: block_size + (block_size - 1) x capacity / LENGTH_QUANTUM graphs
    (136 for block 16 and 1024 positions). A prompt's extend runs eagerly. A shorter block is not padded to a full
    one: block positions attend to each other, so padding would change the drafts.
    """

    @torch.inference_mode()
    def __init__(self, drafter: DFlashDraftModel, head: TargetHead, capacity: int,
                 cuda_graphs: bool | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        # A weak reference: kept_object keeps this object per drafter, which must stay free to go.
        self._drafter = weakref.ref(drafter)
        self.head = head
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
        # The block [anchor, MASK x (block - 1)]; a block of n positions reads the first n.
        self._tokens = torch.full((block,), config.mask_token_id, dtype=torch.long, device=device)
        self._drafted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per size: what its graphs write
        self._graphs: dict = {}
        use_graphs = device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs:
            if head.device != device or head.weight.device != device:
                raise ValueError(f"the graphed drafting step needs the target's embedding and head on the drafter's "
                                 f"device {device}, got {head.device} and {head.weight.device}")
            spans = range(LENGTH_QUANTUM, self.capacity + 1, LENGTH_QUANTUM)
            # Warm-ups write garbage into columns that extend() writes before a block reads them.
            # The sizes a live step drafts: the anchor and at least one mask position.
            blocks = [("block", n, span) for n in range(2, block + 1) for span in spans]
            self._graphs = capture_graphs(
                device, [("extend", n) for n in self._features] + blocks,
                prepare=lambda shape: self.start.fill_(0 if shape[0] == "extend" else shape[2]),
                run=lambda shape: (self._write(self._features[shape[1]]) if shape[0] == "extend"
                                   else self._graph_draft(shape[1], shape[2])))

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

    def _draft(self, size: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter logits [size-1, V] and their argmax of the block held in the first `size` tokens, at positions
        start.. over the context columns < start."""
        return block_drafts(self.head, self._tokens[:size], lambda embedded: self._block(embedded, span))

    def _graph_draft(self, size: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the graph of a block of `size` over `span` columns runs: _draft, its outputs copied into the
        buffers of that size which the graphs of every span share (logits [size-1, V] per size and span would
        take capacity / LENGTH_QUANTUM times the memory)."""
        logits, drafts = self._draft(size, span)
        if size not in self._drafted:  # made by the first (warm-up) run, outside any graph
            self._drafted[size] = (torch.empty_like(logits), torch.empty_like(drafts))
        kept_logits, kept_drafts = self._drafted[size]
        kept_logits.copy_(logits)
        kept_drafts.copy_(drafts)
        return kept_logits, kept_drafts

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
    def draft(self, anchor: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CachedDrafter.draft: drafter logits [size-1, V] and their argmax [size-1] for the block
        [anchor, MASK x (size-1)] right after the context (anchor at position `length`), 2 <= size <= block_size.

        A graphed size returns its graph's output buffers, which the next draft of that size overwrites (a copy
        would cost two more kernel launches a step); clone them to keep them."""
        check_context(self.length)
        if not 2 <= size <= self.config.block_size:
            raise ValueError(f"a drafted block has 2..{self.config.block_size} positions, got {size}")
        span = round_up(self.length, LENGTH_QUANTUM)
        self.start.fill_(self.length)
        self._tokens[:1].fill_(anchor)
        entry = self._graphs.get(("block", size, span))
        if entry is None:
            return self._draft(size, span)
        replay(entry[0], self.device)
        return entry[1]


def static_drafter(drafter: DFlashDraftModel, head: TargetHead, *, length: int) -> StaticDrafter:
    """An empty StaticDrafter for `drafter` drafting through `head`, with room for `length` positions, kept per
    drafter and head across calls so its graphs are captured once (rebuilt with a larger capacity when `length`
    outgrows it)."""
    # The kept object holds the head's embedding and weight, so their ids name them for as long as it lives.
    key = ("drafter", id(head.embedding), id(head.weight), head.transform)
    context = kept_object(drafter, key, length,
                          lambda: StaticDrafter(drafter, head, round_up(length, CAPACITY_QUANTUM)))
    context.reset()
    return context
