"""The drafter's RMSNorm: the reference's normalisation, through one fused operator where the weight and the input
share a dtype (dflash/models/drafter.py DFlashRMSNorm; one kernel on CUDA, where the live drafting step is bound by
its kernel count)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dflash.models.drafter import DFlashRMSNorm


def norm_of(size: int, dtype: torch.dtype, seed: int = 0) -> tuple[DFlashRMSNorm, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    norm = DFlashRMSNorm(size, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size, generator=generator) + 0.5)
    x = torch.randn(3, 5, size, generator=generator) * 4
    return norm.to(dtype), x.to(dtype)


def test_it_normalises_as_the_reference_in_float32():
    norm, x = norm_of(64, torch.float32)
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)


def test_in_bfloat16_it_rounds_once_after_the_weight_within_one_step_of_the_reference():
    norm, x = norm_of(576, torch.bfloat16)
    wide = x.float()
    normalised = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
    once = (norm.weight.float() * normalised).to(torch.bfloat16)
    twice = norm.weight * normalised.to(torch.bfloat16)  # the reference: rounded before the weight, then after
    got = norm(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), once.float(), atol=0, rtol=2 ** -8)
    torch.testing.assert_close(got.float(), twice.float(), atol=0, rtol=2 ** -7)


def test_a_weight_of_another_dtype_keeps_the_reference_form_and_its_dtype():
    norm, x = norm_of(64, torch.float32)
    x = x.to(torch.bfloat16)
    expected = norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    got = norm(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_dispatches_one_operator(dtype):
    norm, x = norm_of(64, dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        norm(x)
    assert [e.name for e in prof.events() if e.cpu_parent is None] == ["aten::rms_norm"]
