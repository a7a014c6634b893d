"""The LM head and its cross-entropy, slice by slice of the tokens, with the gradients made in the forward pass.

The loss is the model's last op and its gradient is the softmax's, known as soon as the logits are: each slice's
logits (slice x vocab, bf16) are made, turned in place into their gradient by one kernel (fused.cross_entropy_, which
also returns the rows' losses), and multiplied at once into the gradients of the hidden states and of the head's
weight, so that no (tokens x vocab) tensor outlives its slice, none is float32, and nothing is recomputed in the
backward pass (the chunked head before this recomputed each slice's logits there, and moved about ten times the
bytes a logit). The backward pass only scales the two gradients by the gradient of the loss.

What it holds from its forward to its backward pass: the hidden states' gradient (where the hidden states were
held before) and the head weight's, one weight-sized tensor (planner/memory.py `loss_workspace_bytes`).

Under tensor parallelism (`tp`) each rank holds the head's rows of its slice of the vocabulary: its logits are that
slice, the cross-entropy reduces over the group (parallel/tensor.py), and the hidden states' gradient is this slice's
part, summed over the group by the collective before the head (`TensorParallel.enter`).
"""

from __future__ import annotations

import torch

from fastml.executor.model import fused
from fastml.executor.parallel.tensor import TensorParallel, vocab_parallel_cross_entropy_


def lm_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, num_chunks: int = 1,
                tp: TensorParallel | None = None) -> torch.Tensor:
    """The summed cross-entropy (float32) of hidden states (N, h) under the LM head `weight` (V, h; this rank's
    rows of it under tensor parallelism `tp`), over `num_chunks` slices of the rows. Without gradients (evaluation)
    the slices' losses alone."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, targets, num_chunks, tp)
    total = hidden.new_zeros((), dtype=fused.loss_dtype(hidden.dtype))
    for h, t in zip(hidden.tensor_split(num_chunks), targets.tensor_split(num_chunks)):
        total += _cross_entropy_(h @ weight.t(), t, tp).sum()
    return total


def _cross_entropy_(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """Each row's loss, the logits turned into their gradient."""
    if tp is None:
        return fused.cross_entropy_(logits, targets)
    return vocab_parallel_cross_entropy_(logits, targets, tp, fused.loss_dtype(logits.dtype))


class LinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of `hidden @ weight.T` against `targets`, its gradients made in the forward pass
    (the module's docstring). Its backward pass may run once: it scales the gradients it kept in place."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, num_chunks: int,
                tp: TensorParallel | None) -> torch.Tensor:
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = None
        total = hidden.new_zeros((), dtype=fused.loss_dtype(hidden.dtype))
        grad_slices = grad_hidden.tensor_split(num_chunks) if needs_hidden else [None] * num_chunks
        for h, t, grad_h in zip(hidden.tensor_split(num_chunks), targets.tensor_split(num_chunks), grad_slices):
            logits = h @ weight.t()
            total += _cross_entropy_(logits, t, tp).sum()  # logits now hold their gradient
            if needs_hidden:
                torch.mm(logits, weight, out=grad_h)
            if needs_weight:  # after the first slice, summed in the GEMM itself (cuBLAS's beta 1)
                grad_weight = logits.t() @ h if grad_weight is None else \
                    torch.addmm(grad_weight, logits.t(), h, out=grad_weight)
            del logits  # before the next slice's are made: one slice's logits at a time
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        if ctx.used:
            raise RuntimeError("the LM head's loss was differentiated twice; its backward pass scales in place "
                               "the gradients it made, and may run once")
        ctx.used = True
        grad_hidden, grad_weight = ctx.saved_tensors
        scaled = [None if g is None else g.mul_(grad_total) for g in (grad_hidden, grad_weight)]
        return *scaled, None, None, None
