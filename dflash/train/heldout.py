"""Held-out acceptance during training: greedy speculative decoding replayed over stored target passes.

The data stage regenerates responses at T=0, so a held-out response IS the target's greedy continuation of its
prompt: the replay of dflash/eval/replay.py needs no generation, only the target's features and greedy next tokens
along prompt + response. `write_heldout_features` computes them once (one target forward per batch, at the capture
stage) into one safetensors file; `HeldoutSet.evaluate` then replays a drafter over them with the very
`replay_steps` and `DrafterProposer` of the evaluator, using the frozen embedding and lm_head the trainer already
holds, so a training run never loads the target. The result is the evaluator's replay tau on these prompts; with a
temperature T > 0 also the expected acceptance at T along the same passes (dflash/eval/expected_acceptance.py),
read from the target's final hidden states, without sampling noise.

File layout (safetensors; metadata: schema_version, target_layer_ids, num_samples, the target's logit transform
when it has one (dflash/models/targets/logit_transform.py), path_temperature when the continuations were sampled):
    tokens [N] int64       every sample's prompt + response, concatenated
    greedy [N] int64       the target's greedy next token after each position (argmax of its logits)
    features [N, K*H]      the target features of each position (taps in target_layer_ids order)
    final [N, H]           the target's final normed hidden state at each position (the lm_head's input); files
                           written before it existed lack it, and only the estimate at T > 0 needs it
    offsets [S+1] int64    sample i is rows offsets[i]:offsets[i+1]
    prompt_lens [S] int64  the first response position of each sample (from its loss mask)

With data regenerated at T>0 the responses are sampled, not greedy: `greedy_mismatches` then counts the positions
where the response leaves the greedy path, and tau is no longer the T=0 acceptance of real decoding; the estimate
at T then weighs the stored tokens by how they were drawn (`path_temperature`, docs/eval.md).
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

from dflash.eval.expected_acceptance import expected_metrics, expected_traces, head_logits
from dflash.eval.metrics import acceptance_metrics
from dflash.eval.replay import DrafterProposer, replay_steps
from dflash.eval.replay_estimate import sampled_continuations, target_pass_with_final
from dflash.models.targets.logit_transform import LogitTransform
from dflash.run_files import atomic_path
from dflash.train.objective import target_argmax

SCHEMA_VERSION = 1


def prompt_length(sample_id: str, loss_mask: Sequence[int]) -> int:
    """The first response position; the held-out replay needs prompt first, then one response to the end."""
    mask = [int(m) for m in loss_mask]
    if 1 not in mask:
        raise ValueError(f"held-out sample {sample_id!r} has no response token (loss_mask all 0)")
    start = mask.index(1)
    if not all(mask[start:]):
        raise ValueError(f"held-out sample {sample_id!r}: loss_mask is not prompt (0s) then one response (1s)")
    return start


def save_heldout_set(path: str, sequences: list[list[int]], greedy: list[torch.Tensor],
                     features: list[torch.Tensor], prompt_lens: list[int], layer_ids: list[int],
                     finals: list[torch.Tensor] | None = None, logit_transform: LogitTransform | None = None,
                     path_temperature: float = 0.0, max_new_tokens: int | None = None) -> None:
    """Write one held-out file (layout in the module docstring) atomically; `finals` None leaves out "final";
    path_temperature > 0: the continuations were sampled at it, with at most max_new_tokens new tokens (both
    recorded in the metadata)."""
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
    if finals is not None:
        tensors["final"] = torch.cat([f.cpu() for f in finals]).contiguous()
    metadata = {"schema_version": str(SCHEMA_VERSION), "target_layer_ids": json.dumps(list(layer_ids)),
                "num_samples": str(len(sequences)), **(logit_transform or LogitTransform()).metadata()}
    if path_temperature > 0:
        metadata["path_temperature"] = repr(float(path_temperature))
    if max_new_tokens is not None:
        metadata["max_new_tokens"] = str(int(max_new_tokens))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def write_heldout_features(adapter: Any, heldout_dataset: Any, layer_ids: list[int], path: str, *,
                           max_samples: int | None = None, batch_size: int) -> dict[str, int]:
    """Run the target once over the held-out samples and save what the replay needs; returns counts.

    heldout_dataset: rows {"id", "input_ids", "loss_mask"} (load_heldout_dir); the first `max_samples` are used.
    """
    rows = _rows(heldout_dataset, max_samples, batch_size)
    sequences = [list(map(int, row["input_ids"])) for row in rows]
    prompt_lens = [prompt_length(row["id"], row["loss_mask"]) for row in rows]
    _write_passes(adapter, sequences, prompt_lens, layer_ids, path, batch_size)
    return {"samples": len(rows), "tokens": sum(len(s) for s in sequences)}


def write_sampled_heldout(adapter: Any, heldout_dataset: Any, layer_ids: list[int], path: str, *, temperature: float,
                          seed: int, max_new_tokens: int, batch_size: int) -> dict[str, int]:
    """The held-out prompts continued by the target itself sampled at `temperature` (seeded), and their target
    pass, saved like write_heldout_features' file with `path_temperature` in its metadata: the passes on which the
    estimate at that temperature is unbiased (docs/eval.md), whatever temperature the data was answered at."""
    rows = _rows(heldout_dataset, None, batch_size)
    prompts = [list(map(int, row["input_ids"]))[: prompt_length(row["id"], row["loss_mask"])] for row in rows]
    continuations = sampled_continuations(adapter, prompts, max_new_tokens=max_new_tokens,
                                          stop_token_ids=adapter.stop_token_ids(), temperature=temperature, seed=seed,
                                          batch_size=batch_size)
    sequences = [p + c for p, c in zip(prompts, continuations)]
    _write_passes(adapter, sequences, [len(p) for p in prompts], layer_ids, path, batch_size, temperature,
                  max_new_tokens)
    return {"samples": len(rows), "tokens": sum(len(s) for s in sequences)}


def sampled_budget(path: str) -> int | None:
    """The max_new_tokens the sampled held-out file `path` was continued with (None: not recorded, a file from
    before it was)."""
    with safe_open(path, framework="pt") as f:
        value = (f.metadata() or {}).get("max_new_tokens")
    return None if value is None else int(value)


def sampled_path(path: str, temperature: float) -> str:
    """Where the held-out passes sampled at `temperature` go, beside the held-out file `path`."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}_T{temperature:g}{suffix}"


def _rows(heldout_dataset: Any, max_samples: int | None, batch_size: int) -> list:
    count = len(heldout_dataset) if max_samples is None else min(max_samples, len(heldout_dataset))
    if count < 1:
        raise ValueError(f"no held-out samples to write (dataset of {len(heldout_dataset)}, max_samples "
                         f"{max_samples})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [heldout_dataset[i] for i in range(count)]


def _write_passes(adapter: Any, sequences: list[list[int]], prompt_lens: list[int], layer_ids: list[int], path: str,
                  batch_size: int, path_temperature: float = 0.0, max_new_tokens: int | None = None) -> None:
    """One target pass over each sequence, batch by batch, saved as a held-out file."""
    features: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        batch_features, batch_finals = target_pass_with_final(adapter, sequences[start : start + batch_size],
                                                              layer_ids)
        features += [f.cpu() for f in batch_features]
        finals += [f.cpu() for f in batch_finals]
    head = adapter.lm_head_weight()
    greedy = [greedy_tokens(f, head) for f in finals]
    save_heldout_set(path, sequences, greedy, features, prompt_lens, layer_ids, finals,
                     adapter.logit_transform, path_temperature, max_new_tokens)


@torch.inference_mode()
def greedy_tokens(finals: torch.Tensor, head: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """The target's greedy next token [T] after each position, on the host (objective.target_argmax)."""
    return target_argmax(finals, head, rows).cpu()


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


def estimate_key(temperature: float) -> str:
    """The held-out figure of the expected tau at `temperature` (> 0), e.g. tau_T1 or tau_T0.7."""
    return f"tau_T{temperature:g}"


class HeldoutSet:
    """A held-out file, ready to replay drafters over.

    max_new_tokens: the generation budget the replay assumes (blocks shrink near it, as in real decoding); each
    response is cut to it. None: the longest stored response. batch_size: samples replayed together.
    path_temperature: the temperature the stored responses were drawn at (data.temperature; 0 = greedy), which the
    estimate at T > 0 weighs the stored tokens by (dflash/eval/expected_acceptance.py); a file's own
    path_temperature metadata (write_sampled_heldout) takes precedence. estimate_from: another held-out set (the
    same prompts continued at the estimate's temperature) whose passes the estimate is computed on instead.
    """

    def __init__(self, path: str, *, batch_size: int, max_new_tokens: int | None = None,
                 path_temperature: float = 0.0, estimate_from: HeldoutSet | None = None) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"held-out features file {path} is missing: run the capture stage with a "
                                    "held-out set (data.heldout > 0)")
        if max_new_tokens is not None and max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 (one token comes from the prefill, so 1 leaves no "
                             f"speculative step), got {max_new_tokens}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size, self.estimate_from = path, batch_size, estimate_from
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("schema_version") != str(SCHEMA_VERSION):
                raise ValueError(f"{path}: held-out schema version {metadata.get('schema_version')!r}, expected "
                                 f"{SCHEMA_VERSION}; rerun the capture stage")
            self.layer_ids: list[int] = json.loads(metadata["target_layer_ids"])
            self.logit_transform = LogitTransform.from_metadata(metadata)
            self.path_temperature = float(metadata.get("path_temperature", path_temperature))
            self.tokens = f.get_tensor("tokens")
            self.greedy = f.get_tensor("greedy")
            self.offsets = f.get_tensor("offsets").tolist()
            self.prompt_lens = f.get_tensor("prompt_lens").tolist()
            self.feature_size = f.get_slice("features").get_shape()[-1]
            self.has_final = "final" in f.keys()
        responses = [self.offsets[i + 1] - self.offsets[i] - p for i, p in enumerate(self.prompt_lens)]
        if max(responses) < 2:
            raise ValueError(f"{path}: no held-out response is longer than one token, so there is nothing to draft")
        self.max_new_tokens = max_new_tokens if max_new_tokens is not None else max(responses)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def check(self, config: Any, temperature: float = 0.0) -> None:
        """ValueError unless a drafter with DrafterConfig `config` reads these features (and, for the estimate at
        `temperature` > 0, the file holds the target's final hidden states)."""
        if list(config.target_layer_ids) != self.layer_ids:
            raise ValueError(f"{self.path} holds features of target layers {self.layer_ids}, the drafter reads "
                             f"{list(config.target_layer_ids)}: rerun the capture stage")
        if config.num_taps * config.hidden_size != self.feature_size:
            raise ValueError(f"{self.path} holds features of size {self.feature_size}, the drafter expects "
                             f"{config.num_taps} taps x hidden {config.hidden_size}")
        if temperature > 0 and self.estimate_from is not None:
            self.estimate_from.check(config, temperature)
        elif temperature > 0 and not self.has_final:
            raise ValueError(f"{self.path} was written without the target's final hidden states, which the "
                             f"expected tau at T={temperature:g} reads: rerun the capture stage")

    def evaluate(self, drafter: nn.Module, frozen_head: tuple[torch.Tensor, torch.Tensor],
                 temperature: float = 0.0) -> dict[str, float]:
        """Replay greedy speculative decoding of `drafter` over every sample; the evaluator's metrics.

        frozen_head: the target's (embedding weight, lm_head weight). Returns tau, acceptance_rate,
        acc_pos{k} (positions that were drafted at least once), samples and greedy_mismatches; with `temperature`
        > 0 also tau_T<x> and acceptance_rate_T<x>, the expected acceptance at that temperature with greedy drafts
        (the serving engines' rule) along the same passes, from the stored final hidden states.
        """
        if temperature > 0 and self.estimate_from is not None:
            result = self.evaluate(drafter, frozen_head)
            estimate = self.estimate_from.evaluate(drafter, frozen_head, temperature)
            for key in (estimate_key(temperature), f"acceptance_rate_T{temperature:g}"):
                result[key] = estimate[key]
            return result
        config = drafter.config
        self.check(config, temperature)
        head = _FrozenHead(*frozen_head)
        device = next(drafter.parameters()).device
        traces, expected, mismatches = [], [], 0
        was_training = drafter.training
        drafter.eval()
        try:
            with safe_open(self.path, framework="pt") as f:
                stored = f.get_slice("features")
                finals = f.get_slice("final") if temperature > 0 else None
                for first in range(0, len(self), self.batch_size):
                    sequences, greedy, features, prompt_lens, chunk_finals, chunk_mismatches = self._chunk(
                        range(first, min(first + self.batch_size, len(self))), stored, finals, device)
                    mismatches += chunk_mismatches
                    propose = DrafterProposer(drafter, head, sequences, features)
                    traces += replay_steps(sequences, greedy, prompt_lens, propose, block_size=config.block_size,
                                           max_new_tokens=self.max_new_tokens)
                    if temperature > 0:
                        lm_head = head.lm_head_weight()
                        transform = None if self.logit_transform.identity else self.logit_transform
                        expected += expected_traces(
                            head_logits(propose.hidden, lm_head, transform), lm_head, chunk_finals, sequences,
                            prompt_lens, block_size=config.block_size, max_new_tokens=self.max_new_tokens,
                            temperature=temperature, path_temperature=self.path_temperature, draft_sampling="greedy",
                            transform=transform)
                    del propose  # this chunk's context (and graph) before the next chunk's is built
        finally:
            drafter.train(was_training)
        result = _figures(acceptance_metrics(traces, config.block_size))
        result.update(samples=len(self), greedy_mismatches=mismatches)
        if temperature > 0:
            estimate = expected_metrics(expected, config.block_size)
            result[estimate_key(temperature)] = estimate["tau"]
            result[f"acceptance_rate_T{temperature:g}"] = estimate["acceptance_rate"]
        return result

    def _chunk(self, samples: range, stored: Any, finals: Any, device: torch.device) -> tuple:
        """(sequences, greedy, features, prompt_lens, final states or None, greedy mismatches) of `samples`, each
        response cut to max_new_tokens."""
        sequences, greedy, features, prompt_lens, chunk_finals, mismatches = [], [], [], [], [], 0
        for i in samples:
            begin, prompt_len = self.offsets[i], self.prompt_lens[i]
            end = min(self.offsets[i + 1], begin + prompt_len + self.max_new_tokens)
            tokens = self.tokens[begin:end]
            sequences.append(tokens.tolist())
            greedy.append(self.greedy[begin:end])
            features.append(stored[begin:end].to(device))
            if finals is not None:
                chunk_finals.append(finals[begin:end].to(device))
            prompt_lens.append(prompt_len)
            # greedy[t] predicts token t+1: where the stored response leaves the target's greedy path.
            mismatches += int((self.greedy[begin + prompt_len - 1 : end - 1] != tokens[prompt_len:]).sum())
        return sequences, greedy, features, prompt_lens, (chunk_finals if finals is not None else None), mismatches


def _figures(metrics: dict[str, Any]) -> dict[str, float]:
    """tau, acceptance_rate and acc_pos{k} (positions drafted at least once) of acceptance metrics."""
    result = {"tau": metrics["tau"], "acceptance_rate": metrics["acceptance_rate"]}
    for k, value in enumerate(metrics["per_position"], start=1):
        if value is not None:
            result[f"acc_pos{k}"] = value
    return result
