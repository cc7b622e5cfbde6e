"""Held-out acceptance during training: greedy speculative decoding replayed over stored target passes.

The data stage regenerates responses at T=0, so a held-out response IS the target's greedy continuation of its
prompt: the replay of dflash/eval/replay.py needs no generation, only the target's features and greedy next tokens
along prompt + response. `write_heldout_features` computes them once (one target forward per batch, at the capture
stage) into one safetensors file; `HeldoutSet.evaluate` then replays a drafter over them with the very
`replay_steps` and `DrafterProposer` of the evaluator, using the frozen embedding and lm_head the trainer already
holds, so a training run never loads the target. The result is the evaluator's replay tau on these prompts.

File layout (safetensors; metadata: schema_version, target_layer_ids, num_samples):
    tokens [N] int64       every sample's prompt + response, concatenated
    greedy [N] int64       the target's greedy next token after each position (argmax of its logits)
    features [N, K*H]      the target features of each position (taps in target_layer_ids order)
    offsets [S+1] int64    sample i is rows offsets[i]:offsets[i+1]
    prompt_lens [S] int64  the first response position of each sample (from its loss mask)

With data regenerated at T>0 the responses are sampled, not greedy: `greedy_mismatches` then counts the positions
where the response leaves the greedy path, and tau is no longer the T=0 acceptance of real decoding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dflash.eval.metrics import acceptance_metrics
from dflash.eval.replay import DrafterProposer, replay_steps, target_pass

SCHEMA_VERSION = 1


def _prompt_len(sample_id: str, loss_mask: Sequence[int]) -> int:
    """The first response position; the held-out replay needs prompt first, then one response to the end."""
    mask = [int(m) for m in loss_mask]
    if 1 not in mask:
        raise ValueError(f"held-out sample {sample_id!r} has no response token (loss_mask all 0)")
    start = mask.index(1)
    if not all(mask[start:]):
        raise ValueError(f"held-out sample {sample_id!r}: loss_mask is not prompt (0s) then one response (1s)")
    return start


def save_heldout_set(path: str, sequences: list[list[int]], greedy: list[torch.Tensor],
                     features: list[torch.Tensor], prompt_lens: list[int], layer_ids: list[int]) -> None:
    """Write one held-out file (layout in the module docstring) atomically."""
    if not sequences:
        raise ValueError("a held-out set needs at least one sample")
    lengths = [len(s) for s in sequences]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "tokens": torch.tensor([t for s in sequences for t in s], dtype=torch.long),
        "greedy": torch.cat([g.cpu().long() for g in greedy]),
        "features": torch.cat([f.cpu() for f in features]).contiguous(),
        "offsets": offsets,
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.long),
    }
    metadata = {"schema_version": str(SCHEMA_VERSION), "target_layer_ids": json.dumps(list(layer_ids)),
                "num_samples": str(len(sequences))}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def write_heldout_features(adapter: Any, heldout_dataset: Any, layer_ids: list[int], path: str, *,
                           max_samples: int | None = None, batch_size: int = 8) -> dict[str, int]:
    """Run the target once over the held-out samples and save what the replay needs; returns counts.

    heldout_dataset: rows {"id", "input_ids", "loss_mask"} (load_heldout_dir); the first `max_samples` are used.
    """
    count = len(heldout_dataset) if max_samples is None else min(max_samples, len(heldout_dataset))
    if count < 1:
        raise ValueError(f"no held-out samples to write (dataset of {len(heldout_dataset)}, max_samples "
                         f"{max_samples})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = [heldout_dataset[i] for i in range(count)]
    sequences = [list(map(int, row["input_ids"])) for row in rows]
    prompt_lens = [_prompt_len(row["id"], row["loss_mask"]) for row in rows]
    features: list[torch.Tensor] = []
    greedy: list[torch.Tensor] = []
    for start in range(0, count, batch_size):
        batch_features, batch_greedy = target_pass(adapter, sequences[start : start + batch_size], layer_ids)
        features += [f.cpu() for f in batch_features]
        greedy += [g.cpu() for g in batch_greedy]
    save_heldout_set(path, sequences, greedy, features, prompt_lens, layer_ids)
    return {"samples": count, "tokens": sum(len(s) for s in sequences)}


class _FrozenHead:
    """The two target pieces DrafterProposer uses, from the saved embedding and lm_head instead of the target."""

    def __init__(self, embed_weight: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.device = embed_weight.device
        self._embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self._lm_head = lm_head

    def embed_tokens(self) -> nn.Embedding:
        return self._embed

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head


class HeldoutSet:
    """A held-out file, ready to replay drafters over.

    max_new_tokens: the generation budget the replay assumes (blocks shrink near it, as in real decoding); each
    response is cut to it. None: the longest stored response. batch_size: samples replayed together.
    """

    def __init__(self, path: str, *, max_new_tokens: int | None = None, batch_size: int = 8) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"held-out features file {path} is missing: run the capture stage with a "
                                    "held-out set (data.heldout > 0)")
        if max_new_tokens is not None and max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (one token comes from the prefill, so 1 leaves no "
                             f"speculative step), got {max_new_tokens}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = path
        self.batch_size = batch_size
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("schema_version") != str(SCHEMA_VERSION):
                raise ValueError(f"{path}: held-out schema version {metadata.get('schema_version')!r}, expected "
                                 f"{SCHEMA_VERSION}; rerun the capture stage")
            self.layer_ids: list[int] = json.loads(metadata["target_layer_ids"])
            self.tokens = f.get_tensor("tokens")
            self.greedy = f.get_tensor("greedy")
            self.offsets = f.get_tensor("offsets").tolist()
            self.prompt_lens = f.get_tensor("prompt_lens").tolist()
            self.feature_size = f.get_slice("features").get_shape()[-1]
        responses = [self.offsets[i + 1] - self.offsets[i] - p for i, p in enumerate(self.prompt_lens)]
        if max(responses) < 2:
            raise ValueError(f"{path}: no held-out response is longer than one token, so there is nothing to draft")
        self.max_new_tokens = max_new_tokens if max_new_tokens is not None else max(responses)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def check(self, config: Any) -> None:
        """ValueError unless a drafter with DrafterConfig `config` reads these features."""
        if list(config.target_layer_ids) != self.layer_ids:
            raise ValueError(f"{self.path} holds features of target layers {self.layer_ids}, the drafter reads "
                             f"{list(config.target_layer_ids)}: rerun the capture stage")
        if config.num_taps * config.hidden_size != self.feature_size:
            raise ValueError(f"{self.path} holds features of size {self.feature_size}, the drafter expects "
                             f"{config.num_taps} taps x hidden {config.hidden_size}")

    def evaluate(self, drafter: nn.Module, frozen_head: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        """Replay greedy speculative decoding of `drafter` over every sample; the evaluator's metrics.

        frozen_head: the target's (embedding weight, lm_head weight). Returns tau, acceptance_rate,
        acc_pos{k} (positions that were drafted at least once), samples and greedy_mismatches.
        """
        config = drafter.config
        self.check(config)
        head = _FrozenHead(*frozen_head)
        device = next(drafter.parameters()).device
        traces, mismatches = [], 0
        was_training = drafter.training
        drafter.eval()
        try:
            with safe_open(self.path, framework="pt") as f:
                stored = f.get_slice("features")
                for first in range(0, len(self), self.batch_size):
                    chunk = range(first, min(first + self.batch_size, len(self)))
                    sequences, greedy, features, prompt_lens = [], [], [], []
                    for i in chunk:
                        begin, prompt_len = self.offsets[i], self.prompt_lens[i]
                        end = min(self.offsets[i + 1], begin + prompt_len + self.max_new_tokens)
                        tokens = self.tokens[begin:end]
                        sequences.append(tokens.tolist())
                        greedy.append(self.greedy[begin:end])
                        features.append(stored[begin:end].to(device))
                        prompt_lens.append(prompt_len)
                        # greedy[t] predicts token t+1: where the stored response leaves the target's greedy path.
                        mismatches += int((self.greedy[begin + prompt_len - 1 : end - 1] != tokens[prompt_len:]).sum())
                    propose = DrafterProposer(drafter, head, sequences, features)
                    traces += replay_steps(sequences, greedy, prompt_lens, propose, block_size=config.block_size,
                                           max_new_tokens=self.max_new_tokens)
        finally:
            drafter.train(was_training)
        metrics = acceptance_metrics(traces, config.block_size)
        result = {"tau": metrics["tau"], "acceptance_rate": metrics["acceptance_rate"]}
        for k, value in enumerate(metrics["per_position"], start=1):
            if value is not None:
                result[f"acc_pos{k}"] = value
        result.update(samples=len(self), greedy_mismatches=mismatches)
        return result
