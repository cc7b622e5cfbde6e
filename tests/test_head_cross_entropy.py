"""head_loss: per-row CE and KL mix through a frozen head, the gradient made in forward, equal to autograd."""

import pytest
import torch
import torch.nn.functional as F

from dflash.train.head_cross_entropy import head_cross_entropy, head_loss

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


@pytest.mark.parametrize("kl_weight", [0.3, 1.0])
def test_kl_mix_terms_and_gradient_equal_autograd(kl_weight):
    hidden, head, labels, row_weights = case(seed=2)
    target = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(3))
    leaf = hidden.clone().requires_grad_()
    terms, ce, correct = head_loss(leaf, head, labels, 7, target, kl_weight)
    (terms * row_weights).sum().backward()
    dense = hidden.double().requires_grad_()
    log_q = (dense @ head.double().t()).log_softmax(-1)
    log_p = (target.double() @ head.double().t()).log_softmax(-1)
    want_ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    want_terms = (1 - kl_weight) * want_ce + kl_weight * (log_p.exp() * (log_p - log_q)).sum(-1)
    (want_terms * row_weights.double()).sum().backward()
    torch.testing.assert_close(terms.double(), want_terms.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ce.double(), want_ce.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), dense.grad, rtol=1e-4, atol=1e-6)
    assert not ce.requires_grad and torch.equal(correct, log_q.argmax(-1) == labels)


def test_kl_without_target_states_is_refused():
    hidden, head, labels, _ = case()
    with pytest.raises(ValueError, match="needs target_hidden shaped like hidden"):
        head_loss(hidden, head, labels, kl_weight=0.5)
    with pytest.raises(ValueError, match="kl_weight must be in"):
        head_loss(hidden, head, labels, kl_weight=1.5, target_hidden=hidden)


@pytest.mark.parametrize("kl_weight", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_chunks_give_the_eager_loss_gradient_and_accuracy(dtype, kl_weight):
    # The CUDA default, forced on CPU: the compiled chunk against the eager one (two chunk lengths, one graph), for
    # the CE alone and mixed with KL.
    hidden, head, labels, row_weights = case(dtype, seed=4)
    target = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(6)).to(dtype) if kl_weight else None
    results = []
    for fused in (False, True):
        leaf = hidden.clone().requires_grad_()
        terms, ce, correct = head_loss(leaf, head, labels, 8, target, kl_weight, fused=fused)
        (terms * row_weights).sum().backward()
        results.append((terms, ce, correct, leaf.grad))
    (terms, ce, correct, grad), (fused_terms, fused_ce, fused_correct, fused_grad) = results
    torch.testing.assert_close(fused_terms, terms, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_ce, ce, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_correct, correct)
    if dtype == torch.float32:
        torch.testing.assert_close(fused_grad, grad, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding of the gradient logits apart at most
        assert (fused_grad.float() - grad.float()).abs().max() <= 0.01 * grad.float().abs().max()
    if kl_weight:  # the KL is in the terms, not only the CE
        assert not torch.allclose(terms, ce)
    from dflash.train.head_cross_entropy import compiled_loss_chunk, loss_chunk
    assert compiled_loss_chunk() is not loss_chunk, "the compiler fell back to the eager chunk: nothing was compared"


def test_a_compiler_failure_falls_back_to_the_eager_chunk(monkeypatch):
    import dflash.train.head_cross_entropy as module

    def broken(*args, **kwargs):
        def fail(*a, **k):
            raise RuntimeError("inductor assertion on this GPU")
        return fail

    monkeypatch.setattr(module, "_compiled_loss_chunk", None)
    monkeypatch.setattr(module.torch, "compile", broken)
    logits, labels = torch.randn(5, 11), torch.tensor([0, 3, 10, 2, 2])
    with pytest.warns(UserWarning, match="compiled loss chunk failed"):
        got = module.compiled_loss_chunk()(logits, labels)
    for a, b in zip(got, module.loss_chunk(logits, labels)):
        assert torch.equal(a, b)
    assert module.compiled_loss_chunk() is module.loss_chunk  # the rest of the process runs eagerly


def test_a_one_row_last_chunk_does_not_recompile_the_fused_chunk():
    # The dynamic graph specialises sizes 0 and 1: a last chunk of one row (rows = k x chunk_size + 1) compiled a
    # second graph, ~1.4 s on an H200 once in ~4,096 steps. It goes to the eager chunk, the same math.
    from torch._dynamo.utils import counters

    hidden, head, labels, _ = case(torch.float32, seed=5)
    from dflash.train.head_cross_entropy import compiled_loss_chunk, loss_chunk

    head_loss(hidden[:11], head, labels[:11], 8, fused=True)  # chunks of 8 and 3 rows: the graph is built
    assert compiled_loss_chunk() is not loss_chunk, "the compiler fell back to the eager chunk: nothing to test"
    before = counters["stats"]["unique_graphs"]
    terms, ce, correct = head_loss(hidden[:9], head, labels[:9], 8, fused=True)  # 8 and 1
    assert counters["stats"]["unique_graphs"] == before
    eager_terms, _, eager_correct = head_loss(hidden[:9], head, labels[:9], 8, fused=False)
    torch.testing.assert_close(terms, eager_terms, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, eager_correct)
