"""fastml's C++ CPU AdamW, `torch.ops.fastml.adamw_step_` (csrc/cpu_adam.cpp): one AdamW step over optimizer state
in host memory, in one pass over memory, for the layers whose optimizer states or master weights are offloaded.

The op is compiled on first use with fastml's other C++ ops (native.py); a machine that cannot build it gets one
`UserError`, never a slower Python step in its place. `adamw_step_reference_` is the same step in plain torch ops:
the reference the op is tested against.
"""

from __future__ import annotations

import torch

from fastml.executor.native import load

def adamw_step_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                weight_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """One AdamW step in place, by the C++ op (built on first use). master, exp_avg, exp_avg_sq: contiguous fp32 CPU
    tensors; grad: bf16 or fp32; weight_out (optional, bf16 or fp32) receives the new master weights rounded to
    nearest even. `step` counts this step (1 on the first). The gradient is multiplied by `grad_scale` first (in
    bf16 for a bf16 gradient, as clipping it in place would). Arithmetic: `adamw_step_reference_`."""
    load()
    torch.ops.fastml.adamw_step_(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay,
                                 step, grad_scale)


@torch.no_grad()
def adamw_step_reference_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                          weight_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: int, grad_scale: float = 1.0) -> None:
    """The op's step in plain torch ops, those of torch.optim.AdamW's single-tensor step (torch/optim/adam.py,
    `_single_tensor_adam` with decoupled weight decay) in the same order."""
    g = (grad * grad_scale if grad_scale != 1 else grad).to(master.dtype)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (_sqrt(exp_avg_sq) / bias_correction2**0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if weight_out is not None:
        weight_out.copy_(master)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root, as the op, the GPU and torch's fused CPU AdamW take it. torch's float32
    `sqrt` on a CPU (MKL's vector math in x86 builds) is 1 ulp off for about one value in six; taken in float64 and
    rounded once, the root is exact (a double rounding of sqrt is harmless from 53 bits to 24: 53 >= 2 * 24 + 2)."""
    return x.double().sqrt().to(x.dtype)
