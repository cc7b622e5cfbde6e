"""Cross-entropy through the frozen lm_head, chunk by chunk, with the gradient made during the forward pass.

The drafter's lm_head is the target's and never trains, so the only gradient the loss sends back is the one for
the drafter's hidden states: for position i, d CE_i / d h_i = (softmax(h_i W^T) - onehot(y_i)) W. That vector does
not depend on how CE_i is weighted later, so each chunk of logits is made once, turned into the loss, the
accuracy and that gradient, and dropped. Backward only scales the stored [positions, hidden] gradient by each
position's incoming weight.

Against autograd over checkpointed chunks (forward, then a second forward and a backward per chunk in backward),
this makes the [chunk, vocab] logits and the logits-sized matmul once instead of twice, and walks the float32
logits far fewer times; the large-vocab CE is most of a small drafter's step.
"""

from __future__ import annotations

import torch


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        head = weight.to(hidden.dtype)
        ce = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        correct = torch.empty(rows, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, chunk_size):
            end = min(start + chunk_size, rows)
            h, y = hidden[start:end], labels[start:end]
            logits = h @ head.t()
            correct[start:end] = logits.argmax(-1) == y
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            del logits
            ce[start:end] = -log_probs.gather(1, y[:, None]).squeeze(1)
            if grad is not None:
                # softmax - onehot, in place in the float32 buffer: the subtraction must happen before the cast
                # (1 - p for p near 1 needs float32's mantissa).
                probs = log_probs.exp_()
                probs.scatter_add_(1, y[:, None], torch.full_like(probs[:, :1], -1.0))
                grad[start:end] = probs.to(hidden.dtype) @ head
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return ce, correct

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_correct: torch.Tensor | None):
        (grad,) = ctx.saved_tensors
        if grad is None:
            return None, None, None, None
        scaled = (grad.float() * grad_ce[:, None].float()).to(grad.dtype)
        return scaled, None, None, None


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       chunk_size: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE of `labels` under softmax(hidden @ weight^T), and whether the argmax is the label.

    hidden: [rows, H] (differentiable); weight: [V, H], frozen (a weight that requires grad is refused: its
    gradient is never made); labels: [rows] long. At most `chunk_size` rows of logits exist at a time. Returns
    (ce [rows] float32 with a gradient to hidden, correct [rows] bool).
    """
    if weight.requires_grad:
        raise ValueError("head_cross_entropy makes no gradient for the head weight; it must be frozen "
                         "(requires_grad=False)")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"need hidden [rows, H], labels [rows], weight [V, H]; got {tuple(hidden.shape)}, "
                         f"{tuple(labels.shape)}, {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _HeadCrossEntropy.apply(hidden, weight, labels, chunk_size)
