"""fp8 (e4m3) feature compression with one scale per token and tap.

Each row of a [tokens, K*H] feature matrix holds K taps of H values. Every (token, tap) block is divided by
amax / 448 (the largest finite e4m3 value) before the cast, so each block uses the full fp8 range: hidden-state
magnitudes differ by orders of magnitude between taps and between tokens (attention-sink tokens), and one scale
per tensor would crush the small ones to zero.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def quantize_fp8(features: torch.Tensor, num_taps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K*H] float8_e4m3fn, scales [N, K] float32) with features ~= q * scales per tap block."""
    rows, width = features.shape
    if width % num_taps:
        raise ValueError(f"feature width {width} is not a multiple of the {num_taps} taps")
    blocks = features.float().reshape(rows, num_taps, width // num_taps)
    amax = blocks.abs().amax(dim=-1)
    # An all-zero block keeps scale 1 so it dequantises to zeros instead of NaN.
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(rows, width), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Features [N, K*H] in `dtype` from fp8 values and their per-(token, tap) scales [N, K]."""
    rows, width = q.shape
    num_taps = scales.shape[-1]
    blocks = q.float().reshape(rows, num_taps, width // num_taps) * scales.float()[..., None]
    return blocks.reshape(rows, width).to(dtype)
