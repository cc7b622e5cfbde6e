"""head_cross_entropy: per-row CE through a frozen head, gradient made in the forward pass, equals autograd."""

import pytest
import torch
import torch.nn.functional as F

from dflash.train.head_cross_entropy import head_cross_entropy

ROWS, HIDDEN, VOCAB = 37, 16, 50


def case(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator).to(dtype)
    head = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    row_weights = torch.rand(ROWS, generator=generator)
    return hidden, head, labels, row_weights


def reference(hidden, head, labels, row_weights):
    """Plain autograd in float64: the weighted CE sum, its gradient and the argmax hits."""
    leaf = hidden.detach().double().requires_grad_()
    logits = leaf @ head.double().t()
    ce = F.cross_entropy(logits, labels, reduction="none")
    (ce * row_weights.double()).sum().backward()
    return ce, leaf.grad, logits.argmax(-1) == labels


@pytest.mark.parametrize("chunk_size", [1, 5, ROWS, 4096])
def test_loss_gradient_and_accuracy_equal_autograd_for_any_chunking(chunk_size):
    hidden, head, labels, row_weights = case()
    leaf = hidden.clone().requires_grad_()
    ce, correct = head_cross_entropy(leaf, head, labels, chunk_size)
    (ce * row_weights).sum().backward()
    want_ce, want_grad, want_correct = reference(hidden, head, labels, row_weights)
    torch.testing.assert_close(ce.double(), want_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(correct, want_correct) and correct.dtype == torch.bool


def test_bfloat16_hidden_gets_a_bfloat16_gradient_close_to_float64():
    hidden, head, labels, row_weights = case(torch.bfloat16, seed=1)
    leaf = hidden.clone().requires_grad_()
    ce, _ = head_cross_entropy(leaf, head, labels, chunk_size=8)
    (ce * row_weights).sum().backward()
    want_ce, want_grad, _ = reference(hidden, head, labels, row_weights)
    assert ce.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    # Logits are made in bf16 (as the trainer's old path did), so the CE carries bf16 rounding of the logits.
    torch.testing.assert_close(ce.double(), want_ce, rtol=0.05, atol=0.3)
    scale = want_grad.abs().max()
    assert (leaf.grad.double() - want_grad).abs().max() < 0.02 * scale


def test_no_gradient_is_made_without_grad():
    hidden, head, labels, _ = case()
    with torch.no_grad():
        ce, correct = head_cross_entropy(hidden, head, labels)
    assert not ce.requires_grad and ce.shape == correct.shape == (ROWS,)


def test_a_trainable_head_or_bad_shapes_are_refused():
    hidden, head, labels, _ = case()
    with pytest.raises(ValueError, match="must be frozen"):
        head_cross_entropy(hidden, head.clone().requires_grad_(), labels)
    with pytest.raises(ValueError, match="need hidden"):
        head_cross_entropy(hidden, head, labels[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        head_cross_entropy(hidden, head, labels, chunk_size=0)
