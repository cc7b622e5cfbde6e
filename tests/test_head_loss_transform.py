"""The head loss through a target's final logit transform (soft cap, scale): values and gradients equal autograd
over the transformed logits, for CE, KL and the fused chunk math; the frozen head file carries the transform; and a
262k vocabulary stays within the memory of one chunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash.models.targets.logit_transform import LogitTransform
from dflash.train.frozen_head import load_frozen_head, load_logit_transform, save_frozen_head
from dflash.train.head_cross_entropy import head_loss

TRANSFORMS = [LogitTransform(softcap=2.0), LogitTransform(scale=0.25), LogitTransform(scale=3.0, softcap=5.0)]


def reference(hidden, weight, labels, transform, target_hidden=None, kl_weight=0.0):
    logits = transform(hidden @ weight.T)
    log_q = torch.log_softmax(logits, dim=-1)
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    if kl_weight == 0:
        return ce
    log_p = torch.log_softmax(transform(target_hidden @ weight.T), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (1 - kl_weight) * ce + kl_weight * kl


@pytest.mark.parametrize("transform", TRANSFORMS, ids=str)
@pytest.mark.parametrize("kl_weight,fused", [(0.0, False), (0.0, True), (0.3, False), (0.3, True)])
def test_loss_and_gradient_through_the_transform(transform, kl_weight, fused):
    torch.manual_seed(0)
    rows, hidden_size, vocab = 12, 16, 50
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64)
    hidden = (torch.randn(rows, hidden_size, dtype=torch.float64) * 2).requires_grad_()
    target = torch.randn(rows, hidden_size, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,))
    position_weights = torch.rand(rows, dtype=torch.float64)
    expected = reference(hidden, weight, labels, transform, target, kl_weight)
    (expected_grad,) = torch.autograd.grad((expected * position_weights).sum(), hidden)
    # chunk_size 1 keeps the fused path on its eager chunk (the compiled one is for CUDA).
    terms, ce, _ = head_loss(hidden, weight, labels, chunk_size=1 if fused else 5, target_hidden=target,
                             kl_weight=kl_weight, fused=fused, transform=transform)
    (grad,) = torch.autograd.grad((terms * position_weights).sum(), hidden)
    torch.testing.assert_close(terms, expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)
    untransformed, _, _ = head_loss(hidden, weight, labels, chunk_size=5, target_hidden=target,
                                    kl_weight=kl_weight)
    assert not torch.allclose(untransformed, terms)


def test_frozen_head_file_keeps_the_transform(tmp_path):
    embed, head = torch.randn(10, 4), torch.randn(10, 4)
    path = str(tmp_path / "frozen_head.safetensors")
    save_frozen_head(embed, head, path, LogitTransform(scale=0.5, softcap=30.0))
    assert load_logit_transform(path) == LogitTransform(scale=0.5, softcap=30.0)
    assert all(torch.equal(a, b) for a, b in zip(load_frozen_head(path), (embed, head)))
    save_frozen_head(embed, head, path)  # most targets: no metadata, as files written before the transform
    assert load_logit_transform(path).identity


def test_a_tied_head_is_stored_once_and_loads_as_both(tmp_path):
    from safetensors import safe_open

    embed = torch.randn(10, 4)
    path = str(tmp_path / "frozen_head.safetensors")
    for head in (embed, embed.clone()):  # the same tensor, or a copy of it (a target that ties by value)
        save_frozen_head(embed, head, path)
        with safe_open(path, framework="pt") as f:
            assert list(f.keys()) == ["embed_tokens"]
        loaded_embed, loaded_head = load_frozen_head(path)
        assert torch.equal(loaded_embed, embed) and torch.equal(loaded_head, embed)


PEAK = """
import json, resource, sys, torch
from dflash.models.targets.logit_transform import LogitTransform
from dflash.train.head_cross_entropy import head_loss
rows, hidden_size, vocab, chunk = 1024, 64, 262144, int(sys.argv[1])
torch.manual_seed(0)
weight = torch.randn(vocab, hidden_size) * 0.05
hidden = torch.randn(rows, hidden_size).requires_grad_()
labels = torch.randint(0, vocab, (rows,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
terms, _, _ = head_loss(hidden, weight, labels, chunk_size=chunk, transform=LogitTransform(softcap=30.0))
terms.sum().backward()
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grown_mib": grown / 1024, "loss": float(terms.detach().mean())}))
"""


@pytest.mark.slow
def test_a_262k_vocabulary_stays_within_one_chunk_of_memory():
    """1024 rows x 262,144 vocab: all logits at once would be 1 GiB per float32 copy (~3 GiB grown, measured with
    chunk 1024); chunks of 128 rows, 128 MiB. One thread, as the suite's other processes run beside it."""
    run = subprocess.run([sys.executable, "-c", PEAK, "128"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # One chunk holds the logits, their log-softmax and the transform's slope: three 128 MiB float32 buffers.
    assert result["grown_mib"] < 700, result
    assert 11.0 < result["loss"] < 14.0  # about log(262144) = 12.5: near-uniform logits under the cap
