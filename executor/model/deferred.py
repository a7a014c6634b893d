"""Weight gradients made a pass after the backward pass that would make them (zero-bubble pipeline schedules, Qi et
al. 2024): a backward pass makes its input's gradient, which the stage before waits for, and the weights' gradients,
which nothing waits for, fill the pipeline's bubble later.

A block's linears become `DeferredLinear`s (by a change of class, as fp8.py converts them: names, checkpoints and
hooks stay). Inside `put_off()`, a DeferredLinear's backward pass makes its input's gradient alone and keeps its input
and its output's gradient (`Kept`); `Kept.gradients` makes the weight's and bias's gradients from them. Outside it, a
DeferredLinear is an nn.Linear. The blocks' other parameters' gradients (the norms') the backward pass makes as ever:
the pipeline (parallel/pipeline.py) takes them with torch.autograd.grad and adds them with the weights' later, so
that each of a block's gradients reaches its hooks (ZeRO's reduction) in the weights' pass, once a micro-batch."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

class Kept(NamedTuple):
    """What a DeferredLinear's backward pass keeps for its weight's gradient."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    input: torch.Tensor
    grad: torch.Tensor
    """The gradient of the linear's output."""

    def gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its gradient) for the weight and the bias."""
        weight, bias = _weight_gradients(self.input, self.grad, self.bias is not None)
        return [(self.weight, weight)] + ([(self.bias, bias)] if self.bias is not None else [])


_kept: list[Kept] | None = None
"""While `put_off()` runs: what each DeferredLinear whose backward pass ran keeps."""


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
            _kept.append(Kept(*ctx.parameters, x, grad))
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
            if type(linear) is not nn.Linear:  # an fp8 linear would silently multiply in bf16 again
                raise TypeError(f"a {type(linear).__name__} cannot put off its weight gradients")
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

