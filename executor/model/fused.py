"""Fused elementwise kernels, written in Triton, as torch ops (`torch.ops.fastml.*`) beside their references.

SwiGLU, silu(gate) * up over the (..., 2f) output of the gate_up projection (model.py): one kernel forward, one
backward, each reading its inputs once and writing its outputs once. The backward kernel that torch.compile writes
for the same arithmetic reads gate_up once for each half of the gradient it writes (TinyLlama's profile: 0.038 s of
a 0.857 s step, the step's largest kernel that is not a matmul or attention). The op keeps only its input for the
backward pass, as a compiled block did; eager PyTorch kept silu's output as well. Their `_amax` twins also give the
absolute maximum of what they write, as float32 bits, one for each block of the output (one value on the CPU): an
fp8 matmul that casts that output then reads it once instead of twice (fp8.py, `quantize_fp8`'s `partial_amax`).

Cross-entropy over rows of logits (`cross_entropy_`, the LM head's loss, loss.py): one kernel reads each row twice
(its log-sum-exp, then the softmax) and writes, in place of the logits, their gradient softmax - one_hot(target),
returning each row's loss. The eager loss it replaced (an fp32 copy of the logits, log-softmax, its backward and a
cast back) moved about 44 bytes a logit, 62 with the chunks recomputed; this moves 6.

On a GPU the ops run the Triton kernels, which need Triton (installed with CUDA builds of torch on Linux;
`require_triton` says so once, before training); on the CPU they compute the references. SwiGLU's are the torch ops
autograd ran for the same arithmetic before the op existed, so CPU runs kept their bits; cross-entropy's works in
place in float32, and its losses and gradients differ from the log-softmax it replaced by float32's rounding. The
tests hold the kernels (float32 inside, one rounding of each output) to the references within the dtype's rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastml.config import UserError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without it; the CPU runs the references
    triton = None

BLOCK = 1024
"""Elements of one row that one program handles: 8 bf16 a thread over 4 warps, in 16-byte loads."""


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, op for op as autograd ran it before the fused op: a CPU run's losses stay bit for bit."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The gradient of gate_up, both halves side by side, by the ops autograd ran for F.silu(gate) * up:
    d/dgate = silu'(gate) * (grad * up), d/dup = grad * silu(gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


@torch.library.custom_op("fastml::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the halves of gate_up's last dimension."""
    return swiglu_reference(gate_up)


@torch.library.custom_op("fastml::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return swiglu_backward_reference(grad, gate_up)


def amax_bits(x: torch.Tensor) -> torch.Tensor:
    """max |x| as the int32 bits of a float32, one value: what the `_amax` ops give on the CPU. A NaN's bits exceed
    every number's, as in the GPU kernels."""
    return x.abs().amax().float().reshape(1).view(torch.int32)


@torch.library.custom_op("fastml::swiglu_amax", mutates_args=())
def swiglu_amax(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """swiglu(gate_up) and its absolute maximum's float32 bits (int32; on the GPU one for each block the kernel
    wrote, whose largest is the maximum). No autograd: fp8.FP8FeedForwardFunction calls it and its backward twin."""
    out = swiglu_reference(gate_up)
    return out, amax_bits(out)


@torch.library.custom_op("fastml::swiglu_backward_amax", mutates_args=())
def swiglu_backward_amax(grad: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """swiglu_backward(grad, gate_up) and its absolute maximum's float32 bits, as `swiglu_amax` gives them."""
    grad_gate_up = swiglu_backward_reference(grad, gate_up)
    return grad_gate_up, amax_bits(grad_gate_up)


@swiglu.register_fake
def _swiglu_shape(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@swiglu_backward.register_fake
def _swiglu_backward_shape(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate_up)


def _amax_shape(gate_up: torch.Tensor, columns: int) -> torch.Tensor:
    """The partial maxima the ops return: one for each of the kernels' programs on the GPU, one on the CPU (the
    reference)."""
    return _partial_maxima(math.prod(gate_up.shape[:-1]), columns, gate_up) if gate_up.is_cuda else \
        gate_up.new_empty(1, dtype=torch.int32)


def _partial_maxima(rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """Room for one maximum for each program of the kernels: rows x blocks of BLOCK columns."""
    return like.new_empty(rows * -(-columns // BLOCK), dtype=torch.int32)


@swiglu_amax.register_fake
def _swiglu_amax_shape(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_shape(gate_up), _amax_shape(gate_up, gate_up.shape[-1] // 2)


@swiglu_backward_amax.register_fake
def _swiglu_backward_amax_shape(grad: torch.Tensor, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate_up), _amax_shape(gate_up, gate_up.shape[-1] // 2)


def _keep_input(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    (gate_up,) = ctx.saved_tensors
    return swiglu_backward(grad, gate_up)


swiglu.register_autograd(_swiglu_grad, setup_context=_keep_input)


def cross_entropy_reference_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's loss logsumexp(row) - row[target] (`loss_dtype`), the row replaced by its gradient softmax(row) -
    one_hot(target). In place where the logits are float32 or wider (the CPU's): no (rows x vocab) temporary."""
    x = logits.to(loss_dtype(logits.dtype))  # the logits themselves when they are float32 or float64
    picked = x.gather(1, targets[:, None])
    peak = x.amax(1, keepdim=True)
    x.sub_(peak).exp_()
    total = x.sum(1, keepdim=True)
    losses = (peak + total.log() - picked).squeeze(1)
    x.div_(total).scatter_add_(1, targets[:, None], x.new_full((len(x), 1), -1.0))
    if x is not logits:
        logits.copy_(x)
    return losses


@torch.library.custom_op("fastml::cross_entropy_", mutates_args=("logits",))
def cross_entropy_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each row of `logits` (rows, vocab) against `targets` (rows,), in float32 (`loss_dtype`); the
    logits are overwritten by their gradient (that of the summed losses). Targets must be in [0, vocab): the GPU
    kernel gives a NaN loss for one that is not (the data refuses such tokens before, storage/data.py)."""
    return cross_entropy_reference_(logits, targets)


@cross_entropy_.register_fake
def _cross_entropy_shape(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=loss_dtype(logits.dtype))


def loss_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The losses' dtype: float32, or float64 for float64 logits."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def require_triton(device: torch.device) -> None:
    """Refuses, with the remedy, a GPU run on a torch without Triton (the fused kernels' compiler)."""
    if device.type == "cuda" and triton is None:
        raise UserError(f"fastml's fused kernels run on the GPU through Triton, which this torch {torch.__version__} "
                        "lacks: pip install triton (the version your torch names)")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous (rows, last dim) matrix: a view where it is one already."""
    return x.contiguous().view(-1, x.shape[-1])


def launch_swiglu(gate_up: torch.Tensor, with_amax: bool = False):
    """The forward kernel over gate_up (any device Triton runs on; under TRITON_INTERPRET=1 the CPU too); with
    `with_amax`, (output, the partial maxima of `swiglu_amax`)."""
    rows = as_rows(gate_up)
    f = rows.shape[1] // 2
    out = rows.new_empty((rows.shape[0], f))
    amax = _partial_maxima(rows.shape[0], f, out) if with_amax else out
    if out.numel():
        _swiglu_forward_kernel[(rows.shape[0], triton.cdiv(f, BLOCK))](rows, out, amax, f, BLOCK=BLOCK,
                                                                       AMAX=with_amax)
    out = out.view(*gate_up.shape[:-1], f)
    return (out, amax) if with_amax else out


def launch_swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor, with_amax: bool = False):
    rows, grad_rows = as_rows(gate_up), as_rows(grad)
    f = rows.shape[1] // 2
    out = torch.empty_like(rows)
    amax = _partial_maxima(rows.shape[0], f, out) if with_amax else out
    if out.numel():
        _swiglu_backward_kernel[(rows.shape[0], triton.cdiv(f, BLOCK))](grad_rows, rows, out, amax, f, BLOCK=BLOCK,
                                                                        AMAX=with_amax)
    out = out.view(gate_up.shape)
    return (out, amax) if with_amax else out


CROSS_ENTROPY_BLOCK = 4096
"""Logits of a row that one program reads at a time: 16 bf16 a thread over 8 warps."""


def launch_cross_entropy_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy kernel over contiguous rows of logits (any device Triton runs on)."""
    if not logits.is_contiguous():
        raise ValueError("cross_entropy_ writes its gradient over the logits, which must be contiguous")
    rows, vocab = logits.shape
    losses = logits.new_empty(rows, dtype=loss_dtype(logits.dtype))
    if logits.numel():
        _cross_entropy_kernel[(rows,)](logits, targets.contiguous(), losses, vocab, BLOCK=CROSS_ENTROPY_BLOCK,
                                       num_warps=8)
    return losses


if triton is not None:
    @triton.jit
    def _cross_entropy_kernel(logits, targets, losses, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * vocab
        cols = tl.arange(0, BLOCK)
        # An online log-sum-exp, lane by lane: each lane keeps its running maximum and its sum of exp(x - maximum).
        # The start is a finite minimum, so that no lane ever computes exp(-inf - -inf).
        peak = tl.full([BLOCK], -3.0e38, tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            inside = start + cols < vocab
            x = tl.load(base + start + cols, mask=inside, other=-float("inf")).to(tl.float32)
            higher = tl.maximum(peak, x)
            total = total * tl.exp(peak - higher) + tl.where(inside, tl.exp(x - higher), 0.0)
            peak = higher
        row_peak = tl.max(peak, axis=0)
        lse = row_peak + tl.log(tl.sum(total * tl.exp(peak - row_peak), axis=0))
        target = tl.load(targets + row)
        valid = (target >= 0) & (target < vocab)
        picked = tl.load(base + target, mask=valid, other=float("nan")).to(tl.float32)
        tl.store(losses + row, lse - picked)
        for start in range(0, vocab, BLOCK):
            inside = start + cols < vocab
            x = tl.load(base + start + cols, mask=inside).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
            tl.store(base + start + cols, grad.to(logits.dtype.element_ty), mask=inside)

    cross_entropy_.register_kernel("cuda")(launch_cross_entropy_)

    @triton.jit
    def _abs_bits(values, inside):
        """The largest |value| where `inside`, as float32 bits (int32): a NaN's exceed every number's."""
        bits = values.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF  # the sign cleared, a NaN's too
        return tl.max(tl.where(inside, bits, 0), axis=0)

    @triton.jit
    def _store_amax(amax, largest):
        tl.store(amax + tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1), largest)

    @triton.jit
    def _swiglu_forward_kernel(gate_up, out, amax, f, BLOCK: tl.constexpr, AMAX: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < f
        gate = tl.load(gate_up + row * 2 * f + cols, mask=inside).to(tl.float32)
        up = tl.load(gate_up + row * 2 * f + f + cols, mask=inside).to(tl.float32)
        y = (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty)
        tl.store(out + row * f + cols, y, mask=inside)
        if AMAX:  # of the rounded values, which the cast reads
            _store_amax(amax, _abs_bits(y, inside))

    @triton.jit
    def _swiglu_backward_kernel(grad, gate_up, grad_gate_up, amax, f, BLOCK: tl.constexpr, AMAX: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < f
        g = tl.load(grad + row * f + cols, mask=inside).to(tl.float32)
        gate = tl.load(gate_up + row * 2 * f + cols, mask=inside).to(tl.float32)
        up = tl.load(gate_up + row * 2 * f + f + cols, mask=inside).to(tl.float32)
        s = tl.sigmoid(gate)
        dtype = grad_gate_up.dtype.element_ty
        grad_gate = (g * up * s * (1 + gate * (1 - s))).to(dtype)
        grad_up = (g * gate * s).to(dtype)
        tl.store(grad_gate_up + row * 2 * f + cols, grad_gate, mask=inside)
        tl.store(grad_gate_up + row * 2 * f + f + cols, grad_up, mask=inside)
        if AMAX:
            _store_amax(amax, tl.maximum(_abs_bits(grad_gate, inside), _abs_bits(grad_up, inside)))

    swiglu.register_kernel("cuda")(launch_swiglu)
    swiglu_backward.register_kernel("cuda")(launch_swiglu_backward)
    swiglu_amax.register_kernel("cuda")(lambda gate_up: launch_swiglu(gate_up, with_amax=True))
    swiglu_backward_amax.register_kernel("cuda")(
        lambda grad, gate_up: launch_swiglu_backward(grad, gate_up, with_amax=True))
