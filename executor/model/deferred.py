"""Weight gradients made a pass after the backward pass that would make them (zero-bubble pipeline schedules, Qi et
al. 2024): a backward pass makes its input's gradient, which the stage before waits for, and the weights' gradients,
which nothing waits for, fill the pipeline's bubble later.

A block's linears become `DeferredLinear`s (by a change of class, as fp8.py converts them: names, checkpoints and
hooks stay). Inside `put_off()`, a DeferredLinear's backward pass makes its input's gradient alone and keeps its input
and its output's gradient; `weight_gradients` makes the weights' gradients of what was kept. Outside it, a
DeferredLinear is an nn.Linear. The other parameters' gradients (the norms') the backward pass makes as ever: the
pipeline (parallel/pipeline.py) takes them with torch.autograd.grad and adds them with the weights' later, so that
each parameter's gradient reaches its hooks (ZeRO's reduction) in the weights' pass, once a micro-batch."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_kept: list | None = None
"""While `put_off()` runs: (weight, bias, input, output gradient) of each DeferredLinear whose backward pass ran."""


class DeferredLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.parameters = weight, bias  # the parameters themselves (leaves): what the weights' pass accumulates into
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_input = grad @ weight
        if _kept is not None:
            _kept.append((*ctx.parameters, x, grad))
            return grad_input, None, None
        grad_weight, grad_bias = _weight_gradients(x, grad, ctx.parameters[1] is not None)
        return grad_input, grad_weight, grad_bias


def _weight_gradients(x: torch.Tensor, grad: torch.Tensor, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    return grad_rows.T @ rows, grad_rows.sum(0) if bias else None


def convert(blocks) -> None:
    """The linears of `blocks` become DeferredLinears."""
    for block in blocks:
        for linear in (block.attn.qkv, block.attn.out, block.ffn.gate_up, block.ffn.down):
            linear.__class__ = DeferredLinear


@contextlib.contextmanager
def put_off():
    """Within it, DeferredLinears' backward passes keep what their weights' gradients need, in the list it yields."""
    global _kept
    if _kept is not None:
        raise RuntimeError("weight gradients are already being put off")
    _kept = kept = []
    try:
        yield kept
    finally:
        _kept = None


def weight_gradients(kept: list) -> dict[nn.Parameter, torch.Tensor]:
    """The gradients of the weights (and biases) whose backward passes `put_off` kept."""
    grads: dict[nn.Parameter, torch.Tensor] = {}
    for weight, bias, x, grad in kept:
        for p, g in zip((weight, bias), _weight_gradients(x, grad, bias is not None)):
            if p is not None:
                grads[p] = grads[p] + g if p in grads else g
    return grads
