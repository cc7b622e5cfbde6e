"""The replay's drafting step at one shape for every step of a chunk, replayed on CUDA as one graph.

DrafterProposer (replay.py) gathers each step's rows, contexts and block sizes into tensors of that step's shape, so
every step dispatches its kernels one by one from Python: ~1,600 operator calls a step for a 5-layer drafter, tens of
milliseconds of host time on a GPU whose work for the step is well under one. Here every step of a chunk has one
shape: every row of the chunk drafts a full block [anchor, MASK x (block_size - 1)] over all of its cached context
columns, the columns at or after its anchor masked out, and the block positions past its block size masked out as
keys. Column c of the cache holds position c (the features are right-padded), so no row's context is gathered or
shifted. A row that is not drafting this step drafts anyway, and its drafts are dropped.

Masked keys add nothing to attention, so each drafting row gets what the gathered step gives it: the same math, up to
floating-point rounding (tests/test_chunk_drafts.py checks whole replay walks). On CUDA the step (embedding,
drafter, head, argmax) is captured once per chunk as a CUDA graph: a step then costs one copy of its anchors, block
sizes and tokens to the device, one graph launch and one copy of the drafts back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.inference.cuda_graphs import capture_graphs, replay
from dflash.inference.drafter_cache import KeysValues, block_hidden
from dflash.models.drafter import DFlashDraftModel
from dflash.models.targets.logit_transform import logits_from_hidden


class ChunkDrafts:
    """Greedy drafts of blocks anchored in `sequences` (a replay chunk), every step at the chunk's one shape.

    context: every drafter layer's keys/values [len(sequences), kv_heads, C, head_dim] of the sequences' stored
    positions, column c = position c (DrafterProposer.context). embedding, lm_head: the target's input embedding
    weight [V, H] and head weight [V, H], on the drafter's device. cuda_graph: capture the step as a CUDA graph (the
    drafter on CUDA); False runs the same fixed-shape step eagerly.
    """

    @torch.inference_mode()
    def __init__(self, drafter: DFlashDraftModel, embedding: torch.Tensor, lm_head: torch.Tensor,
                 context: KeysValues, sequences: list[list[int]], cuda_graph: bool) -> None:
        self.drafter = drafter
        self.embedding = embedding
        self.lm_head = lm_head
        self.context = context
        self.sequences = sequences
        self.block_size = block = drafter.config.block_size
        self.device = device = drafter.fc.weight.device
        for name, weight in (("embedding", embedding), ("lm_head", lm_head)):
            if weight.device != device:
                raise ValueError(f"the fixed-shape drafting step needs the target's {name} on the drafter's device "
                                 f"{device}, got {weight.device}")
        rows, columns = len(sequences), context[0][0].shape[2]
        # Per row: its block's anchor position, its block size and its anchor token (one device buffer: one copy).
        self.inputs = torch.zeros(3, rows, dtype=torch.long, device=device)
        self._resting = torch.stack([torch.ones(rows, dtype=torch.long), torch.full((rows,), block),
                                     torch.full((rows,), drafter.config.mask_token_id)])
        self.context_positions = torch.arange(columns, device=device)[None].expand(rows, -1)
        self.offsets = torch.arange(block, device=device)[None]
        self.graph = None
        if cuda_graph:
            graphs = capture_graphs(device, ["step"], prepare=lambda _: self.inputs.copy_(self._resting),
                                    run=lambda _: self._step())
            self.graph, self.drafts = graphs["step"]

    def _step(self) -> torch.Tensor:
        """Drafts [rows, block_size - 1] of the blocks `inputs` describes, at the chunk's shape."""
        start, size, anchor = self.inputs
        tokens = torch.where(self.offsets == 0, anchor[:, None], self.drafter.config.mask_token_id)
        # The raw embedding rows, as training takes them (train/forward.py): Gemma's module would scale them.
        noise = F.embedding(tokens, self.embedding)
        context_valid = self.context_positions < start[:, None]
        block_valid = self.offsets < size[:, None]
        hidden = block_hidden(self.drafter, noise, start[:, None] + self.offsets, self.context,
                              self.context_positions, context_valid, block_valid)
        return logits_from_hidden(hidden[:, 1:], self.lm_head).argmax(dim=-1)

    @torch.inference_mode()
    def __call__(self, rows: list[int], starts: list[int], sizes: list[int]) -> torch.Tensor:
        """Greedy drafts [len(rows), max(sizes) - 1] on the host of the blocks of `sizes` anchored at `starts` in
        the sequences `rows` (the Proposer of replay_steps); a row's drafts past its size - 1 mean nothing."""
        if max(sizes) > self.block_size:
            raise ValueError(f"blocks of {max(sizes)} positions: the fixed-shape step drafts blocks of at most the "
                             f"drafter's block_size {self.block_size}")
        inputs = self._resting.clone()
        inputs[:, rows] = torch.tensor([starts, sizes, [self.sequences[r][s] for r, s in zip(rows, starts)]])
        self.inputs.copy_(inputs)
        if self.graph is None:
            drafts = self._step()
        else:
            replay(self.graph, self.device)
            drafts = self.drafts
        return drafts.cpu()[rows, : max(sizes) - 1]
