"""Checks of captured features: every batch's shape, finite values and non-zero variance per tap and sample, and
a sampled sequence against a plain `output_hidden_states` forward. A capture path can silently produce wrong or
all-zero states (method.md §8); these checks catch it before anything is written or trained on."""

from __future__ import annotations

import logging

import torch

from dflash.extract.forward_budget import release_device_memory
from dflash.host_copy import host_to_device
from dflash.models.targets.base import TargetAdapter

logger = logging.getLogger(__name__)

# Relative L2 error allowed between captured features and a plain forward of the same sample: batching and
# padding change the kernels' summation order (large in bfloat16), a wrong tap or zero states give ~1.
CROSSCHECK_RTOL = 0.05


def check_features(features: torch.Tensor, lengths: list[int], ids: list[str], layer_ids: list[int]) -> None:
    """Raise ValueError naming the sample and tap on a shape mismatch, a non-finite value or zero variance."""
    raise_on_bad_features(feature_flags(features, lengths, layer_ids).cpu(), ids, layer_ids)


def feature_flags(features: torch.Tensor, lengths: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[b, taps, 2] float on the features' device: (all finite, variance) of each sample's real rows per tap.

    Nothing here waits for the device: the caller decides when to look (raise_on_bad_features), so a colocated
    trainer can launch its step before the target's forward has finished. The shape is checked at once.
    """
    b, t, width = features.shape
    if b != len(lengths) or t < max(lengths) or width % len(layer_ids):
        raise ValueError(
            f"captured features have shape {tuple(features.shape)} for {len(lengths)} samples of up to "
            f"{max(lengths)} tokens and {len(layer_ids)} taps (one row per token expected)"
        )
    sizes = host_to_device(torch.tensor(lengths), features.device)
    sample = torch.arange(b, device=features.device).repeat_interleave(t)
    real = (torch.arange(t, device=features.device)[None, :] < sizes[:, None]).flatten()
    return _sample_flags(features.reshape(b * t, width), sample, real, sizes, len(layer_ids))


def packed_feature_flags(features: torch.Tensor, lengths: list[int], layer_ids: list[int]) -> torch.Tensor:
    """feature_flags of a packed row: `features` [T, K*H] holds samples of `lengths` end to end; returns
    [samples, taps, 2] (all finite, variance) on the features' device, without waiting for it."""
    t, width = features.shape
    if t != sum(lengths) or width % len(layer_ids):
        raise ValueError(
            f"captured features have shape {tuple(features.shape)} for {len(lengths)} packed samples of "
            f"{sum(lengths)} tokens and {len(layer_ids)} taps (one row per token expected)"
        )
    sizes = host_to_device(torch.tensor(lengths), features.device)
    # Sample index of every token; output_size spares a device-to-host read of the total.
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=features.device), sizes, output_size=t)
    return _sample_flags(features, sample, None, sizes, len(layer_ids))


def _sample_flags(rows: torch.Tensor, sample: torch.Tensor, real: torch.Tensor | None, sizes: torch.Tensor,
                  num_taps: int) -> torch.Tensor:
    """[samples, taps, 2]: (all finite, variance) per sample and tap of `rows` [N, K*H], where row i belongs to
    sample `sample[i]` and counts only where `real[i]` (None: every row); `sizes` [samples] counts the real rows."""
    hidden = rows.shape[1] // num_taps
    count = sizes.float() * hidden

    def per_sample(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(sizes), device=rows.device).index_add_(0, sample, values)

    finite, var = [], []
    for k in range(num_taps):
        # One tap at a time keeps the float32 temporaries at 1/K of the rows.
        x = rows[:, k * hidden:(k + 1) * hidden].float()
        bad = (~torch.isfinite(x)).any(dim=1)
        if real is not None:  # padding: neither checked nor counted
            bad &= real
            x = torch.where(real[:, None], x, 0.0)
        finite.append(per_sample(bad.float()) == 0)
        mean = per_sample(x.sum(dim=1)) / count
        spread = (x - mean[sample, None]).pow(2).sum(dim=1)
        var.append(per_sample(spread if real is None else torch.where(real, spread, 0.0)) / count)
    return torch.stack([torch.stack(finite, dim=1).float(), torch.stack(var, dim=1)], dim=2)


def raise_on_bad_features(flags: torch.Tensor, ids: list[str], layer_ids: list[int]) -> None:
    """ValueError naming the first sample and tap whose flags (feature_flags, on the CPU) show a problem."""
    # One test for the whole batch (per-element indexing would be ~5 operators per sample, tap and flag); the
    # first bad flag in (sample, tap, flag) order is the one named. `not > 0` also catches NaN.
    bad = ~(flags > 0)
    if not bool(bad.any()):
        return
    first = int(bad.flatten().nonzero()[0])
    row, rest = divmod(first, flags.shape[1] * flags.shape[2])
    k, which = divmod(rest, flags.shape[2])
    if which == 0:
        raise ValueError(f"sample {ids[row]!r}: tap {layer_ids[k]} has non-finite hidden states")
    raise ValueError(f"sample {ids[row]!r}: tap {layer_ids[k]} has zero variance (all-constant states)")


def crosscheck_sample(
    adapter: TargetAdapter, input_ids: list[int], features: torch.Tensor, layer_ids: list[int], sample_id: str,
    final: torch.Tensor | None = None,
) -> None:
    """Compare one sample's captured features [T, K*H] with HF `output_hidden_states[L+1]` of a plain forward, and
    its final normed hidden state [T, H] (`final`, when given) with the last of them.

    Taps on the last layer are skipped: HF's last hidden state is taken after the final norm. The plain forward runs
    the layers eagerly where capture.compile compiled them: the reference is the model's own code, and a one-row
    forward would make every compiled layer compile again (a batch of one is a shape of its own to torch.compile).
    """
    hidden = adapter.hidden_size
    ids = torch.tensor([input_ids], device=adapter.device)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        states = adapter.text_model()(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    compared = [(f"tap {layer_id}", f"output_hidden_states[{layer_id + 1}]", states[layer_id + 1],
                 features[:, k * hidden:(k + 1) * hidden])
                for k, layer_id in enumerate(layer_ids) if layer_id < adapter.num_layers - 1]
    if final is not None:
        compared.append(("the final normed state", f"output_hidden_states[{len(states) - 1}]", states[-1], final))
    for name, reference, state, got in compared:
        ref = state[0].float()
        error = float((got.to(ref.device).float() - ref).norm() / ref.norm().clamp_min(1e-12))
        if not error <= CROSSCHECK_RTOL:
            raise ValueError(
                f"sample {sample_id!r}: {name} differs from {reference} of a plain forward (relative error "
                f"{error:.3g} > {CROSSCHECK_RTOL}): the capture hooks are wrong"
            )


def crosscheck_if_it_fits(adapter: TargetAdapter, input_ids: list[int], features: torch.Tensor,
                          layer_ids: list[int], sample_id: str, final: torch.Tensor | None = None) -> None:
    """crosscheck_sample, skipped with a warning where its plain forward runs out of device memory: that forward
    keeps every layer's states, the most memory any step of capture takes for a long sample."""
    try:
        crosscheck_sample(adapter, input_ids, features, layer_ids, sample_id, final)
        return
    except torch.OutOfMemoryError:
        pass
    release_device_memory()
    logger.warning(f"[capture] warning: the check of sample {sample_id} ({len(input_ids):,} tokens) against a plain "
                   f"forward was skipped: that forward ran out of device memory")
