"""The target side of live speculative decoding: a KV-cached forward that also returns tap features, and rollback.

Rollback after a verify that rejected some drafts (method.md §5):
- attention layers: drop the cached keys/values of the rejected positions (a slice of the sequence axis);
- GDN (linear-attention) layers: their conv and recurrent states already absorbed every token of the block and
  cannot be sliced. `Cache.crop` does not undo that (transformers 5.24 raises for such layers, older releases
  left the states as they were), so the loop would continue from a state that saw the rejected drafts. We
  snapshot those states before each verify, restore them, drop the whole block from the attention layers and
  re-run the target on the accepted tokens only. That costs one extra forward of (accepted + 1) tokens on steps
  that rejected something, and only on hybrid targets; a kernel that returns per-token states would avoid it,
  the HF torch/fla paths do not expose them.

Cache layout relied upon (the same in transformers 5.17 and 5.24): `DynamicCache(config=...)` holds
`cache.layers`; attention layers keep `keys`/`values` tensors [batch, heads, T, head_dim]; linear-attention layers
keep dicts `conv_states` / `recurrent_states` of tensors, updated in place. Anything else raises ValueError.
"""

from __future__ import annotations

from typing import Any

import torch


def new_cache(model: torch.nn.Module) -> Any:
    """An empty HF DynamicCache laid out for `model` (attention and linear-attention layers as the config says),
    with every sliding-window attention layer keeping all its positions (a plain DynamicLayer)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    # A sliding layer drops positions past its window, so a rollback could not slice it by absolute length; kept
    # whole, the layer's attention mask (built from the positions, not the cache) still applies the window.
    cache.layers = [DynamicLayer() if hasattr(layer, "sliding_window") else layer for layer in cache.layers]
    return cache


def is_linear_layer(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


def has_linear_layers(cache: Any) -> bool:
    return any(is_linear_layer(layer) for layer in cache.layers)


LinearSnapshot = list[tuple[dict, int | str, torch.Tensor]]  # (where the tensor is held, its key there, a copy)


def snapshot_linear_states(cache: Any) -> LinearSnapshot:
    """Copies of every conv / recurrent state tensor of the linear-attention layers (empty for dense targets), and of
    the token count a layer keeps beside them (`cumulative_length_linear`, Transformers 5.2x), which the cache's
    get_seq_length reads: a forward without position ids would take its positions from it."""
    saved: LinearSnapshot = []
    for layer in cache.layers:
        if not is_linear_layer(layer):
            continue
        count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            saved.append((vars(layer), "cumulative_length_linear", count.clone()))
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            if states is None:
                continue
            if not isinstance(states, dict):
                raise ValueError(f"unsupported linear-attention cache layout in {type(layer).__name__}: "
                                 f"states are {type(states).__name__}, expected a dict of tensors")
            for index, tensor in states.items():
                if tensor is not None:
                    saved.append((states, index, tensor.clone()))
    return saved


def restore_linear_states(snapshot: LinearSnapshot) -> None:
    """Put back the states of `snapshot_linear_states`, in place (the cache tensors keep their addresses)."""
    for states, index, tensor in snapshot:
        current = states[index]
        if current is not None and current.shape == tensor.shape:
            current.copy_(tensor)
        else:
            states[index] = tensor.clone()


def crop_attention(cache: Any, length: int) -> None:
    """Keep the first `length` positions in every attention layer; linear-attention layers are left alone."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if is_linear_layer(layer) and keys is None:
            continue
        if hasattr(layer, "sliding_window"):
            # A sliding layer may already have dropped old positions; slicing it by absolute length would be wrong.
            raise ValueError(f"live decoding does not support sliding-window target cache layers "
                             f"({type(layer).__name__})")
        if keys is None or keys.numel() == 0:
            continue
        if keys.shape[-2] < length:
            raise ValueError(f"cannot crop an attention cache of {keys.shape[-2]} positions to {length}")
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def token_ids(ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`ids` (a list, or a 1-D tensor that may stay on the device) as a 1-D tensor on `device`; ValueError when
    there are none (a cached forward appends at least one position)."""
    n = len(ids)
    if n == 0:
        raise ValueError("a cached target forward needs at least one token")
    return ids.reshape(n).to(device) if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), device=device)


def check_rollback(start: int, size: int, length: int, keep: int) -> None:
    """ValueError unless keeping `keep` positions of a cache now `length` long directly follows a verify of
    `size` positions from `start` and keeps at least its first position."""
    if length != start + size:
        raise ValueError(f"rollback must follow a verify directly; the cache grew to {length} positions "
                         f"after a verify of {start}..{start + size - 1}")
    if not start < keep <= length:
        raise ValueError(f"rollback keeps {keep} positions; the last verify covered {start}..{length - 1}")


class CachedTarget:
    """One sequence (batch 1) decoded through the target with a KV cache; every forward returns logits + features.

    `length` is the number of positions in the cache. `forward(ids)` appends ids (a list, or a 1-D tensor that may
    stay on the device: no host round trip) at positions length.. and returns (logits [n, V], features [n, K*H]);
    `verify(ids)` is forward after a snapshot; `rollback(keep)`, right after it, makes the cache hold exactly the
    first `keep` positions. Each forward is the adapter's own (TargetAdapter.forward with this class's cache, its
    positions and an all-ones mask); with no `layer_ids` (target-only decoding) no taps are hooked and features are
    None.
    """

    def __init__(self, adapter: Any, layer_ids: list[int], *, restore_linear: bool = True) -> None:
        self.adapter = adapter
        self.layer_ids = adapter.check_layer_ids(layer_ids) if layer_ids else []
        self.restore_linear = restore_linear
        self.cache = new_cache(adapter.model)
        self.length = 0
        self._snapshot: LinearSnapshot | None = None
        self._snapshot_length = 0
        self._verify_ids: list[int] | torch.Tensor = []

    @torch.inference_mode()
    def forward(
        self, ids: list[int] | torch.Tensor, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append `ids`; logits [n, V] (or [1, V] for the last position when last_logits_only) and features."""
        device = self.adapter.device
        input_ids = token_ids(ids, device)[None]
        n = input_ids.shape[1]
        positions = torch.arange(self.length, self.length + n, device=device)[None]
        # An explicit all-ones mask: without one, SDPA over a cache got a 4x slower path (transformers 5.24, CPU).
        mask = torch.ones(1, self.length + n, dtype=torch.long, device=device)
        features, logits = self.adapter.forward(input_ids, mask, self.layer_ids, output="logits", cache=self.cache,
                                                position_ids=positions, last_logits_only=last_logits_only)
        self.length += n
        return logits[0], None if features is None else features[0]

    @torch.inference_mode()
    def verify(self, ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward(ids) after remembering the state to roll back to (GDN states are snapshotted here)."""
        self._snapshot = snapshot_linear_states(self.cache) if self.restore_linear else []
        self._snapshot_length = self.length
        self._verify_ids = ids
        return self.forward(ids)

    @torch.inference_mode()
    def rollback(self, keep: int) -> torch.Tensor | None:
        """Keep the first `keep` positions of the last verify. Returns recomputed features of the kept block
        positions [keep - start, K*H] when the target has linear-attention layers and had to re-run, else None.
        """
        start = self._snapshot_length
        check_rollback(start, len(self._verify_ids), self.length, keep)
        if keep == self.length:
            return None
        if self.restore_linear and self._snapshot and has_linear_layers(self.cache):
            kept = self._verify_ids[: keep - start]
            restore_linear_states(self._snapshot)
            crop_attention(self.cache, start)
            self.length = start
            _, features = self.forward(kept)
            return features
        crop_attention(self.cache, keep)
        self.length = keep
        return None
