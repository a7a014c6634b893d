"""Fused elementwise kernels, written in Triton, as torch ops (`torch.ops.fastml.*`) beside their references.

SwiGLU, silu(gate) * up over the (..., 2f) output of the gate_up projection (model.py): one kernel forward, one
backward, each reading its inputs once and writing its outputs once. The backward kernel that torch.compile writes
for the same arithmetic reads gate_up once for each half of the gradient it writes (TinyLlama's profile: 0.038 s of
a 0.857 s step, the step's largest kernel that is not a matmul or attention). The op keeps only its input for the
backward pass, as a compiled block did; eager PyTorch kept silu's output as well.

On a GPU the ops run the Triton kernels, which need Triton (installed with CUDA builds of torch on Linux;
`require_triton` says so once, before training); on the CPU they compute the references: the torch ops autograd ran
for the same arithmetic before the op existed, so CPU runs are what they were bit for bit. The tests hold the
kernels (float32 inside, one rounding of each output) to them within the dtype's rounding.
"""

from __future__ import annotations

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


@swiglu.register_fake
def _swiglu_shape(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@swiglu_backward.register_fake
def _swiglu_backward_shape(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate_up)


def _keep_input(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    (gate_up,) = ctx.saved_tensors
    return swiglu_backward(grad, gate_up)


swiglu.register_autograd(_swiglu_grad, setup_context=_keep_input)


def require_triton(device: torch.device) -> None:
    """Refuses, with the remedy, a GPU run on a torch without Triton (the fused kernels' compiler)."""
    if device.type == "cuda" and triton is None:
        raise UserError(f"fastml's fused kernels run on the GPU through Triton, which this torch {torch.__version__} "
                        "lacks: pip install triton (the version your torch names)")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous (rows, last dim) matrix: a view where it is one already."""
    return x.contiguous().view(-1, x.shape[-1])


def launch_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """The forward kernel over gate_up (any device Triton runs on; under TRITON_INTERPRET=1 the CPU too)."""
    rows = _rows(gate_up)
    f = rows.shape[1] // 2
    out = rows.new_empty((rows.shape[0], f))
    if out.numel():
        _swiglu_forward_kernel[(rows.shape[0], triton.cdiv(f, BLOCK))](rows, out, f, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], f)


def launch_swiglu_backward(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    rows, grad_rows = _rows(gate_up), _rows(grad)
    f = rows.shape[1] // 2
    out = torch.empty_like(rows)
    if out.numel():
        _swiglu_backward_kernel[(rows.shape[0], triton.cdiv(f, BLOCK))](grad_rows, rows, out, f, BLOCK=BLOCK)
    return out.view(gate_up.shape)


if triton is not None:
    @triton.jit
    def _swiglu_forward_kernel(gate_up, out, f, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < f
        gate = tl.load(gate_up + row * 2 * f + cols, mask=inside).to(tl.float32)
        up = tl.load(gate_up + row * 2 * f + f + cols, mask=inside).to(tl.float32)
        tl.store(out + row * f + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _swiglu_backward_kernel(grad, gate_up, grad_gate_up, f, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < f
        g = tl.load(grad + row * f + cols, mask=inside).to(tl.float32)
        gate = tl.load(gate_up + row * 2 * f + cols, mask=inside).to(tl.float32)
        up = tl.load(gate_up + row * 2 * f + f + cols, mask=inside).to(tl.float32)
        s = tl.sigmoid(gate)
        dtype = grad_gate_up.dtype.element_ty
        tl.store(grad_gate_up + row * 2 * f + cols, (g * up * s * (1 + gate * (1 - s))).to(dtype), mask=inside)
        tl.store(grad_gate_up + row * 2 * f + f + cols, (g * gate * s).to(dtype), mask=inside)

    swiglu.register_kernel("cuda")(launch_swiglu)
    swiglu_backward.register_kernel("cuda")(launch_swiglu_backward)
