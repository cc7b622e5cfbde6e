"""The loss through the frozen lm_head, chunk by chunk, with the gradient made during the forward pass.

The drafter's lm_head is the target's and never trains, so the only gradient the loss sends back is the one for
the drafter's hidden states. For position i with drafter distribution q_i = softmax(h_i W^T):
  CE_i = -log q_i[y_i]                          d CE_i / d h_i = (q_i - onehot(y_i)) W
  KL_i = KL(p_i || q_i), p_i the target's       d KL_i / d h_i = (q_i - p_i) W
so the loss term (1 - w) CE_i + w KL_i has the gradient (q_i - (1 - w) onehot(y_i) - w p_i) W. That vector does
not depend on how the term is weighted later, so each chunk of logits is made once, turned into the loss terms,
the accuracy and that gradient, and dropped. Backward only scales the stored [positions, hidden] gradient by each
position's incoming weight.

A target with a final logit transform t (dflash/models/targets/logit_transform.py: Gemma's soft cap, Granite's or
Cohere's scale) has logits z = t(h W^T) and distributions softmax(z); the gradient above is then taken through t:
d CE_i / d h_i = ((q_i - onehot(y_i)) * t'(x_i)) W, with t' computed from z itself.

Against autograd over checkpointed chunks (forward, then a second forward and a backward per chunk in backward),
this makes the [chunk, vocab] logits and the logits-sized matmul once instead of twice, and walks the float32
logits far fewer times; the large-vocab CE is most of a small drafter's step.

On CUDA each chunk goes through one compiled function (`loss_chunk`): the float32 view of the bf16 logits, their
log-sum-exp, the CE, the argmax, and q - onehot (with KL: the target's log-softmax, the KL and q - (1 - w) onehot -
w p as well) are fused into a few Triton kernels that read the bf16 logits and write the bf16 gradient logits,
where the eager version walks six float32 [chunk, vocab] arrays for the CE alone (upcast, log_softmax, exp, cast
back) and about twice as many with KL. Same formula; float32 rounding may differ in the last bits. Elsewhere the
eager version runs, so the CPU math never changes.
"""

from __future__ import annotations

import warnings

import torch

from dflash.models.targets.logit_transform import LogitTransform

_compiled_loss_chunk = None


def loss_chunk(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None = None,
               kl_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss terms [rows] float32, CE [rows] float32, argmax == label [rows], d terms / d logits [rows, V] in
    logits' dtype) of one chunk. With target_logits (the target's logits of the same rows) the terms are
    (1 - kl_weight) CE + kl_weight KL(p || q) and the gradient q - (1 - kl_weight) onehot - kl_weight p; without,
    the terms are the CE and the gradient q - onehot.

    The subtractions happen in float32 before the cast (1 - q for q near 1 needs float32's mantissa).
    """
    x = logits.float()
    correct = logits.argmax(-1) == labels
    log_q = x - torch.logsumexp(x, dim=-1, keepdim=True)
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (columns[None, :] == labels[:, None]).to(torch.float32)
    if target_logits is None:
        return ce, ce, correct, (log_q.exp() - onehot).to(logits.dtype)
    t = target_logits.float()
    log_p = t - torch.logsumexp(t, dim=-1, keepdim=True)
    p = log_p.exp()
    # p log p is 0 where p underflows to 0 (log p may be -inf there).
    kl = (torch.where(p > 0, p * log_p, 0.0) - p * log_q).sum(-1)
    terms = (1.0 - kl_weight) * ce + kl_weight * kl
    grad_logits = log_q.exp() - (1.0 - kl_weight) * onehot - kl_weight * p
    return terms, ce, correct, grad_logits.to(logits.dtype)


def compiled_loss_chunk():
    """loss_chunk under torch.compile, built once (dynamic: the last chunk of a step is shorter).

    Should the compiler fail on this machine (inductor has asserted on new GPUs before), the eager loss_chunk, the
    same formula, takes over for the rest of the process with a warning: a training run does not die of it.
    """
    global _compiled_loss_chunk
    if _compiled_loss_chunk is None:
        compiled = torch.compile(loss_chunk, dynamic=True)

        def guarded(*args):
            global _compiled_loss_chunk
            try:
                return compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # noqa: BLE001 (any compiler failure; the eager path is equivalent)
                warnings.warn(f"the compiled loss chunk failed ({type(error).__name__}: {error}); using the eager "
                              "one from now on", stacklevel=2)
                _compiled_loss_chunk = loss_chunk
                return loss_chunk(*args)

        _compiled_loss_chunk = guarded
    return _compiled_loss_chunk


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                target_hidden: torch.Tensor | None, kl_weight: float, fused: bool, transform: LogitTransform):
        rows = hidden.shape[0]
        head = weight.to(hidden.dtype)
        terms = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        ce = torch.empty_like(terms)
        correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, chunk_size):
            end = min(start + chunk_size, rows)
            h, y = hidden[start:end], labels[start:end]
            logits = h @ head.t()
            # A transform runs in float32 (a cap's tanh in bf16 would round the logits), with its slope t'(x) kept
            # for the gradient; the identity (most targets) makes nothing extra.
            slope = None
            if not transform.identity:
                logits = transform(logits.float())
                slope = transform.derivative(logits)
            if fused:
                target_logits = None
                if kl_weight > 0:
                    target_logits = target_hidden[start:end] @ weight.to(target_hidden.dtype).t()
                    if not transform.identity:
                        target_logits = transform(target_logits.float())
                # A one-row chunk (rows one more than a multiple of chunk_size) would recompile the dynamic graph,
                # which specialises sizes 0 and 1: ~1.4 s, once in ~4,096 steps of the recipe. Eager is the same math.
                chunk_fn = compiled_loss_chunk() if end - start > 1 else loss_chunk
                if target_logits is None:
                    terms[start:end], ce[start:end], correct[start:end], grad_logits = chunk_fn(logits, y)
                else:
                    terms[start:end], ce[start:end], correct[start:end], grad_logits = chunk_fn(
                        logits, y, target_logits, kl_weight)
                del logits, target_logits
                if grad is not None:
                    if slope is not None:
                        grad_logits = (grad_logits * slope).to(head.dtype)
                    grad[start:end] = grad_logits @ head
                del grad_logits, slope  # before the next chunk's logits: one chunk's buffers at a time
                continue
            correct[start:end] = logits.argmax(-1) == y
            # log_softmax(dtype=float32) of bf16 logits makes this same float32 copy inside, but keeps the bf16
            # logits alive next to it and its output: rebinding frees them first, so the chunk's peak is two float32
            # [chunk, vocab] buffers instead of two plus the bf16 one (about 2 GB less at 4096 x 248k). Same values.
            logits = logits.float()
            log_q = torch.log_softmax(logits, dim=-1)
            del logits
            ce[start:end] = -log_q.gather(1, y[:, None]).squeeze(1)
            p = None
            if kl_weight > 0:
                target = target_hidden[start:end]
                log_p = torch.log_softmax(transform(target @ weight.to(target.dtype).t()), dim=-1,
                                          dtype=torch.float32)
                p = log_p.exp()
                # p log p is 0 where p underflows to 0 (log p may be -inf there).
                neg_entropy = torch.where(p > 0, p * log_p, 0.0).sum(-1)
                del log_p
                kl = neg_entropy - (p * log_q).sum(-1)
                terms[start:end] = (1.0 - kl_weight) * ce[start:end] + kl_weight * kl
            else:
                terms[start:end] = ce[start:end]
            if grad is not None:
                # q - (1 - w) onehot - w p, in place in the float32 buffer: the subtractions must happen before the
                # cast (1 - q for q near 1 needs float32's mantissa).
                q = log_q.exp_()
                if p is not None:
                    q.sub_(p, alpha=kl_weight)
                q.scatter_add_(1, y[:, None], torch.full_like(q[:, :1], -(1.0 - kl_weight)))
                if slope is not None:
                    q.mul_(slope)
                grad[start:end] = q.to(hidden.dtype) @ head
                del q
            # Freed before the next chunk's logits are made: held over, this chunk's float32 [chunk, vocab] buffer
            # would sit next to all of the next chunk's (4 GB more at 4096 x 248k).
            del log_q, p, slope
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(ce, correct)
        return terms, ce, correct

    @staticmethod
    def backward(ctx, grad_terms: torch.Tensor, grad_ce: torch.Tensor | None, grad_correct: torch.Tensor | None):
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None, None, None, None
        scaled = (grad.float() * grad_terms[:, None].float()).to(grad.dtype)
        return scaled, None, None, None, None, None, None, None


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096,
              target_hidden: torch.Tensor | None = None, kl_weight: float = 0.0,
              fused: bool | None = None,
              transform: LogitTransform | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss terms through the frozen head, the CE alone, and whether the drafter's argmax is the label.

    hidden: [rows, H] (differentiable); weight: [V, H], frozen (a weight that requires grad is refused: its
    gradient is never made); labels: [rows] long. kl_weight > 0 mixes in KL(p || q) with p = softmax(target_hidden
    @ weight^T), target_hidden [rows, H] the target's final hidden states: terms = (1 - kl_weight) CE + kl_weight
    KL. At most `chunk_size` rows of logits exist at a time. fused: the compiled chunk (module doc); None = on
    CUDA. transform: the target's final logit transform, applied to both heads' logits (None: the
    identity). Returns (terms [rows] float32 with a gradient to hidden, ce [rows] float32 without one,
    correct [rows] bool).
    """
    if weight.requires_grad:
        raise ValueError("head_loss makes no gradient for the head weight; it must be frozen (requires_grad=False)")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"need hidden [rows, H], labels [rows], weight [V, H]; got {tuple(hidden.shape)}, "
                         f"{tuple(labels.shape)}, {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight must be in [0, 1], got {kl_weight}")
    if kl_weight > 0 and (target_hidden is None or target_hidden.shape != hidden.shape):
        raise ValueError(f"kl_weight={kl_weight} needs target_hidden shaped like hidden {tuple(hidden.shape)}, got "
                         f"{None if target_hidden is None else tuple(target_hidden.shape)}")
    if fused is None:
        fused = hidden.is_cuda
    return _HeadLoss.apply(hidden, weight, labels, chunk_size, target_hidden if kl_weight > 0 else None,
                           float(kl_weight), bool(fused), transform or LogitTransform())


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """head_loss without KL: (ce [rows] float32 with a gradient to hidden, correct [rows] bool)."""
    terms, _, correct = head_loss(hidden, weight, labels, chunk_size)
    return terms, correct
