"""fp8 matmuls for the blocks' linear layers (knobs.matmul_dtype = "fp8"): the forward pass multiplies e4m3 inputs
by e4m3 weights, the backward pass e5m2 gradients (more range, less precision) by e4m3 weights and inputs, each
tensor cast with a scale from its own current absolute maximum just before the cast (csrc/fp8_cuda.cu,
`torch.ops.fastml.quantize_fp8`), so nothing is ever clipped. The GEMMs are torch._scaled_mm's (cuBLASLt), with bf16
outputs; the forward GEMMs accumulate in the tensor cores' fast mode, the backward ones add their partial sums into
fp32 as they go unless knobs.fp8_backward_fast_accum says otherwise. Embeddings, the LM head, norms and attention
stay bf16.

A converted linear keeps its parameter (so checkpoints, sharding and offload see the same model) and saves for its
backward pass the fp8 transpose of its input (1 byte an element, not bf16's 2) and the weight itself, which it casts
again there: a streamed weight is then fetched for backward as any other (offload.py), never kept in fp8 on the GPU.
With knobs.cache_fp8_weights the blocks whose weights stay on the GPU keep them in fp8 instead, cast once per
optimizer step (`CachedFP8Linear`): the weights' casts then cost a step what they cost each micro-batch's passes.
The feed-forward layer becomes one autograd function (`FP8FeedForward`): its linears' own forwards and its SwiGLU
module are then not called, their weights read by the function, so that SwiGLU's kernels can give the casts the
maxima they need.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fastml.config import fail
from fastml.executor.model import fused
from fastml.executor.model.transformer import FeedForward
from fastml.plan import block_group

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in (E4M3, E5M2)}  # the CUDA cast reads the same types' limits
MIN_CAPABILITY = (8, 9)
"""fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) or later."""
MIN_CAPABILITY_TEXT = "compute capability {}.{}".format(*MIN_CAPABILITY)


def quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool = True, transposed: bool = False,
             partial_amax: torch.Tensor | None = None):
    """(fp8 x or an empty tensor, fp8 x.T contiguous or an empty tensor, the inverse scale) of a bf16 matrix.
    `partial_amax`: maxima of |x|'s parts as float32 bits (int32), from the kernel that made x (fused.py's `_amax`
    ops); the op then reads x once, to cast it."""
    return torch.ops.fastml.quantize_fp8(x, dtype, rowwise, transposed, partial_amax)


def quantize_reference(x: torch.Tensor, dtype: torch.dtype, rowwise: bool = True, transposed: bool = False,
                       partial_amax: torch.Tensor | None = None):
    """The op's result in plain torch ops: scale = fp8_max / amax in float32 (1 for an all-zero x, at most float32's
    largest), x * scale rounded to the nearest fp8, and the inverse 1 / scale."""
    amax = x.abs().max().float() if partial_amax is None else partial_amax.max().view(torch.float32)
    scale = torch.where(amax == 0, 1.0, torch.tensor(FP8_MAX[dtype], device=x.device) / amax)
    scale = torch.clamp(scale, max=torch.finfo(torch.float32).max)
    q = (x.float() * scale).to(dtype)
    empty = x.new_empty((0, 0), dtype=dtype)
    return q if rowwise else empty, q.t().contiguous() if transposed else empty, 1 / scale


def _quantize_fake(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, transposed: bool,
                   partial_amax: torch.Tensor | None = None):
    rows, cols = x.shape
    return (x.new_empty((rows, cols) if rowwise else (0, 0), dtype=dtype),
            x.new_empty((cols, rows) if transposed else (0, 0), dtype=dtype), x.new_empty((), dtype=torch.float32))


@functools.cache
def register_fakes() -> None:
    """What the op returns, in shapes and dtypes: torch.compile traces it with this. Once per process, after the
    op is loaded (native.load_cuda)."""
    torch.library.register_fake("fastml::quantize_fp8")(_quantize_fake)


def forward_gemm(flat: torch.Tensor, weight: torch.Tensor, cache: tuple, partial_amax: torch.Tensor | None = None):
    """flat (tokens, in) @ weight.T in fp8, and what the weight's gradient needs of flat: (y, fp8 flat.T, its inverse
    scale). `cache`: the weight's fp8 copies (row-major, transposed, inverse scale) or ()."""
    xq, xq_t, x_inv = quantize(flat, E4M3, rowwise=True, transposed=weight.requires_grad, partial_amax=partial_amax)
    wq, _, w_inv = cache or quantize(weight, E4M3)
    # Fast accumulation only forward, as Transformer Engine: the gradients keep full-precision sums.
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=flat.dtype, use_fast_accum=True)
    return y, xq_t, x_inv


def backward_gemms(grad: torch.Tensor, xq_t: torch.Tensor, x_inv: torch.Tensor, weight: torch.Tensor, cache: tuple,
                   needs_x: bool, needs_weight: bool, fast_accum: bool, partial_amax: torch.Tensor | None = None):
    """The gradients of forward_gemm's input and weight (each None where not needed) from the gradient of its
    output, grad (tokens, out); `fast_accum`: knobs.fp8_backward_fast_accum."""
    if not (needs_x or needs_weight):
        return None, None
    gq, gq_t, g_inv = quantize(grad, E5M2, rowwise=needs_x, transposed=needs_weight, partial_amax=partial_amax)
    # _scaled_mm wants its first operand row-major and its second column-major: the transposes' .t() are.
    grad_x = grad_weight = None
    if needs_x:
        wq_t, w_inv = (cache[1], cache[2]) if cache else quantize(weight, E4M3, rowwise=False, transposed=True)[1:]
        grad_x = torch._scaled_mm(gq, wq_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=grad.dtype,
                                  use_fast_accum=fast_accum)
    if needs_weight:
        grad_weight = torch._scaled_mm(gq_t, xq_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=grad.dtype,
                                       use_fast_accum=fast_accum)
    return grad_x, grad_weight


def _cache(*tensors) -> tuple:
    return () if tensors[0] is None else tensors


class FP8Matmul(torch.autograd.Function):
    """x @ weight.T in fp8, x (..., in) and weight (out, in) bf16; the result bf16. Given the weight's fp8 copies
    (`CachedFP8Linear`: `wq` row-major, `wq_t` transposed, `w_inv` their inverse scale), it uses them instead of
    casting the weight. `fast_accum`: knobs.fp8_backward_fast_accum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fast_accum: bool = False, wq: torch.Tensor | None = None,
                wq_t: torch.Tensor | None = None, w_inv: torch.Tensor | None = None) -> torch.Tensor:
        cache = _cache(wq, wq_t, w_inv)
        ctx.fast_accum = fast_accum
        y, xq_t, x_inv = forward_gemm(fused.as_rows(x), weight, cache)
        ctx.save_for_backward(xq_t, x_inv, weight, *cache)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq_t, x_inv, weight, *cache = ctx.saved_tensors
        grad_x, grad_weight = backward_gemms(fused.as_rows(grad), xq_t, x_inv, weight, tuple(cache),
                                             *ctx.needs_input_grad[:2], ctx.fast_accum)
        return None if grad_x is None else grad_x.view(ctx.x_shape), grad_weight, None, None, None, None


class FP8FeedForwardFunction(torch.autograd.Function):
    """down(swiglu(gate_up(x))) with both matmuls in fp8, as two FP8Matmuls around the fused SwiGLU would compute it,
    bit for bit, but with fewer reads: SwiGLU's kernels give the absolute maxima of what they write (fused.py's
    `_amax` ops), so the casts of SwiGLU's output (forward) and of gate_up's output gradient (backward), the largest
    a block makes, read their input once instead of twice. It keeps what the three ops kept: gate_up's input in fp8,
    transposed, gate_up's output for SwiGLU's backward pass, and SwiGLU's output in fp8, transposed. `caches`: each
    weight's fp8 copies (CachedFP8Linear's buffers) or three Nones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, fast_accum: bool,
                *caches) -> torch.Tensor:
        gate_up_cache, down_cache = _cache(*caches[:3]), _cache(*caches[3:])
        ctx.fast_accum = fast_accum
        h, xq_t, x_inv = forward_gemm(fused.as_rows(x), gate_up, gate_up_cache)
        a, a_amax = fused.swiglu_amax(h)
        y, aq_t, a_inv = forward_gemm(a, down, down_cache, partial_amax=a_amax)
        ctx.save_for_backward(xq_t, x_inv, h, aq_t, a_inv, gate_up, down, *caches)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], down.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq_t, x_inv, h, aq_t, a_inv, gate_up, down, *caches = ctx.saved_tensors
        gate_up_cache, down_cache = _cache(*caches[:3]), _cache(*caches[3:])
        needs_x, needs_gate_up, needs_down = ctx.needs_input_grad[:3]
        needs_a = needs_x or needs_gate_up
        grad_a, grad_down = backward_gemms(fused.as_rows(grad), aq_t, a_inv, down, down_cache, needs_a, needs_down,
                                           ctx.fast_accum)
        grad_x = grad_gate_up = None
        if needs_a:
            grad_h, h_amax = fused.swiglu_backward_amax(grad_a, h)
            del grad_a  # h and aq_t stay until this function returns: autograd frees what a node saved after it
            grad_x, grad_gate_up = backward_gemms(grad_h, xq_t, x_inv, gate_up, gate_up_cache, needs_x,
                                                  needs_gate_up, ctx.fast_accum, partial_amax=h_amax)
        grad_x = None if grad_x is None else grad_x.view(ctx.x_shape)
        return grad_x, grad_gate_up, grad_down, *[None] * (len(ctx.needs_input_grad) - 3)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cache=(),
               fast_accum: bool = False) -> torch.Tensor:
    y = FP8Matmul.apply(x, weight, fast_accum, *cache)
    return y if bias is None else y + bias


class FP8Linear(nn.Linear):
    """An nn.Linear that multiplies in fp8. A linear becomes one by a change of class (`convert_to_fp8`), not by a new
    module: it keeps its parameters and their names, and recompute and compile (apply.py) wrap it as any module."""

    fast_accum = False
    """knobs.fp8_backward_fast_accum, set by `convert_to_fp8`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, fast_accum=self.fast_accum)


class CachedFP8Linear(FP8Linear):
    """An fp8 linear that keeps its weight cast to fp8, row-major and transposed, in buffers (`convert_to_fp8`) that
    `refresh_weight_caches` casts anew once per optimizer step: every micro-batch's passes use them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, weight_cache(self), self.fast_accum)


def weight_cache(linear: nn.Linear) -> tuple:
    """A cached fp8 linear's copies of its weight (row-major, transposed, inverse scale), else three Nones."""
    if isinstance(linear, CachedFP8Linear):
        return tuple(getattr(linear, name) for name in CACHE_BUFFERS)
    return None, None, None


class FP8FeedForward(FeedForward):
    """A feed-forward layer whose linears are fp8 (`convert_to_fp8`): one FP8FeedForwardFunction instead of two fp8
    matmuls around SwiGLU, the same bits with fewer reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # convert_to_fp8 sets fast_accum on both linears alike: gate_up's speaks for the two. Under tensor
        # parallelism the fused layer is this rank's slice of the FFN, entered and left as FeedForward's linears.
        out = FP8FeedForwardFunction.apply(self.tp.enter(x), self.gate_up.weight, self.down.weight,
                                           self.gate_up.fast_accum, *weight_cache(self.gate_up),
                                           *weight_cache(self.down))
        return self.tp.leave(out)


def block_linears(block: nn.Module) -> list[nn.Linear]:
    return [block.attn.qkv, block.attn.out, block.ffn.gate_up, block.ffn.down]


def convert_to_fp8(model: nn.Module, cached: frozenset[str] = frozenset(), fast_accum: bool = False) -> None:
    """Makes every block's linear layers multiply in fp8; those of the blocks `cached` names (`fastml.plan.block_group`
    names, fastml.plan.fp8_cached_blocks) also keep their weights cast to fp8, in buffers that `refresh_weight_caches`
    fills (non-persistent: checkpoints hold the weights alone); `fast_accum` (knobs.fp8_backward_fast_accum) is set on
    every linear. One class for all of them, not a forward per module: the compiled blocks (apply.py) then share one
    graph instead of recompiling for each block's own function."""
    for i, block in model.held_blocks():
        if block.ffn.gate_up.bias is not None or block.ffn.down.bias is not None:
            raise ValueError("FP8FeedForward multiplies the feed-forward's weights alone: its linears have no bias")
        block.ffn.__class__ = FP8FeedForward
        for linear in block_linears(block):
            linear.__class__ = CachedFP8Linear if block_group(i) in cached else FP8Linear
            linear.fast_accum = fast_accum
            if block_group(i) in cached:
                for name in CACHE_BUFFERS:
                    linear.register_buffer(name, None, persistent=False)


CACHE_BUFFERS = ("weight_fp8", "weight_fp8_t", "weight_fp8_inv")


def _cast_both(weight: torch.Tensor):
    with torch.no_grad():
        return quantize(weight, E4M3, rowwise=True, transposed=True)


def cached_linears(model: nn.Module) -> list[CachedFP8Linear]:
    return [m for m in model.modules() if isinstance(m, CachedFP8Linear)]


def refresh_weight_caches(model: nn.Module) -> None:
    """Casts every cached fp8 weight anew from the weight as it is now, both layouts in one pass. Called at the start
    of each optimizer step (executor/loop/step.py): the weights change only between steps. The buffers are replaced, not
    written into: a compiled block takes them as inputs, without recompiling."""
    for linear in cached_linears(model):
        for name, tensor in zip(CACHE_BUFFERS, _cast_both(linear.weight)):
            setattr(linear, name, tensor)


def check_fp8(device: torch.device) -> None:
    """Refuses, with the reason, an fp8 plan on a device without fp8 tensor cores (the plan itself checked that the
    matmuls' shapes suit them, fastml.plan.fp8_shape_problem)."""
    if device.type != "cuda":
        fail("knobs.matmul_dtype", f"'fp8' matmuls run on a GPU with fp8 tensor cores; this run is on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        fail("knobs.matmul_dtype", f"'fp8' needs fp8 tensor cores ({MIN_CAPABILITY_TEXT} or later); "
                                   f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
