"""fastml's AdamW op, `torch.ops.fastml.adamw_step_`: one AdamW step over one tensor's optimizer state in one pass over
memory. On the CPU (csrc/cpu_adam.cpp) it steps the layers whose optimizer states or master weights are offloaded; on
a GPU (csrc/adamw_cuda.cu) the layers whose masters or moments are bf16. Both share their arithmetic (csrc/adamw_math.h)
and so give the same bits. bf16 masters and moments are written with stochastic rounding, its random bits a hash of
`seed` and each element's index (`offset` + i), so that a run resumed from a checkpoint draws what the uninterrupted
one drew; or, bf16 masters with a compensation (`master_low`), rounded to nearest, the master being their sum.

The ops are compiled on first use with fastml's other native ops (native.py); a machine that cannot build them gets one
`UserError`, never a slower Python step in their place. `adamw_step_reference_` is the same step in plain torch ops:
the reference the ops are tested against.
"""

from __future__ import annotations

import torch

from fastml.executor.native import load, load_cuda

M32 = 0xFFFFFFFF


def adamw_step_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                weight_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, grad_scale: float = 1.0, seed: int = 0, offset: int = 0,
                master_low: torch.Tensor | None = None) -> None:
    """One AdamW step in place, by the op of the tensors' device (built on first use). master: fp32 or bf16;
    exp_avg, exp_avg_sq: fp32 or bf16 (one dtype); grad: bf16 or fp32; all contiguous, on one device. weight_out
    (optional, bf16 or fp32, only beside fp32 masters) receives the new master weights rounded to nearest even.
    master_low (optional, bf16, only beside bf16 masters): their compensation, the master being master + master_low,
    both written rounded to nearest (csrc/adamw_math.h). `step` counts this step (1 on the first). The gradient is
    multiplied by `grad_scale` first (in bf16 for a bf16 gradient, as clipping it in place would). Arithmetic:
    `adamw_step_reference_`."""
    load_cuda() if master.device.type == "cuda" else load()
    torch.ops.fastml.adamw_step_(master, exp_avg, exp_avg_sq, grad, weight_out, lr, beta1, beta2, eps, weight_decay,
                                 step, grad_scale, seed, offset, master_low)


@torch.no_grad()
def adamw_step_reference_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                          weight_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: int, grad_scale: float = 1.0, seed: int = 0,
                          offset: int = 0, master_low: torch.Tensor | None = None) -> None:
    """The op's step in plain torch ops, those of torch.optim.AdamW's single-tensor step (torch/optim/adam.py,
    `_single_tensor_adam` with decoupled weight decay) in the same order, in the masters' dtype; bf16 tensors are read
    into float32 and written back with stochastic rounding, but for bf16 masters with a compensation (`master_low`),
    read as their sum and written as the nearest bf16 and the nearest bf16 to what that dropped."""
    w, m, v = (t.float() if t.dtype == torch.bfloat16 else t for t in (master, exp_avg, exp_avg_sq))
    if master_low is not None:
        w = w + master_low.float()
    g = (grad * grad_scale if grad_scale != 1 else grad).to(w.dtype)
    w.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (_sqrt(v) / bias_correction2**0.5).add_(eps)
    w.addcdiv_(m, denom, value=-(lr / bias_correction1))
    bits = random_bits(*rounding_keys(seed), offset + torch.arange(master.numel(), device=master.device))
    stochastic = ((exp_avg, m, bits >> 16), (exp_avg_sq, v, mix32(bits)))
    if master_low is None:
        stochastic += ((master, w, bits),)
    else:
        high = w.to(torch.bfloat16)
        master_low.copy_(w - high.float())
        master.copy_(high)
    for target, value, random16 in stochastic:
        if target.dtype == torch.bfloat16:
            target.copy_(bf16_stochastic(value, random16).view(target.shape))
    if weight_out is not None:
        weight_out.copy_(w)


def mix32(x):
    """csrc/adamw_math.h's 32-bit hash, of a Python int or an int64 tensor of values below 2**32 (products wrap
    modulo 2**64, which leaves their low 32 bits exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def rounding_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of a 64-bit seed, each depending on all of it."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    a, b = s & M32, s >> 32
    return mix32(a ^ mix32(b)), mix32(b ^ mix32((a + 0x9E3779B9) & M32))


def random_bits(key_low: int, key_high: int, index: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of each element `index` (int64) under the keys, as int64."""
    return mix32((mix32((index & M32) ^ key_low) + key_high) & M32)


def bf16_stochastic(value: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """float32 `value` rounded to bf16 up or down at random: adds 16 random bits below the kept ones and truncates."""
    bits = value.contiguous().view(-1).view(torch.int32).to(torch.int64) & M32
    rounded = (bits + (random16 & 0xFFFF)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = torch.where(nan, torch.full_like(rounded, 0x7FC0), rounded)
    return rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root, as the op, the GPU and torch's fused CPU AdamW take it. torch's float32
    `sqrt` on a CPU (MKL's vector math in x86 builds) is 1 ulp off for about one value in six; taken in float64 and
    rounded once, the root is exact (a double rounding of sqrt is harmless from 53 bits to 24: 53 >= 2 * 24 + 2)."""
    return x.double().sqrt().to(x.dtype)
