"""On a CUDA GPU: fastml's CUDA ops (csrc/*.cu) against their references, and training with fp8 matmuls and bf16
optimizer state, alone and composed with recompute, compile and offload."""

import json

import pytest
import torch

from fastml.executor.memory import cpu_adam

from fastml.executor.model import fp8

from fastml.executor import native
from fastml.executor.loop.build import build_training_model
from fastml.executor.memory.optim import EPS, AdamW
from fastml.executor.loop.train import train
from fastml.plan import pinned
from fastml.planner.planner import make_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")]


@pytest.fixture(scope="module", autouse=True)
def built_ops():
    native.load_cuda()


def needs_fp8_tensor_cores():
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("needs fp8 tensor cores (compute capability 8.9 or later)")


# ---------------------------------------------------------------------------------------------------- quantize

SHAPES = [(256, 512), (2048, 4096), (136, 200), (100, 72), (37, 13), (1, 1), (1000, 8), (2056, 4104), (1288, 4104)]
"""Whole 64 x 128 tiles, large ones, whole tiles beside partial ones, partial tiles only, rows of odd length, one
element, one column of tiles (two groups of tile rows), and more tiles than the GPU holds blocks, whole and partial
(each block walks several): the cast walks groups of 8 tile rows, and the last two shapes end with a shorter group,
of one partial tile row and of five tile rows."""
FP8 = [fp8.E4M3, fp8.E5M2]
RELATIVE = {fp8.E4M3: 2.0**-4, fp8.E5M2: 2.0**-3}
"""Half an fp8 step relative to the value: e4m3 keeps 3 mantissa bits, e5m2 2."""
SMALLEST = {fp8.E4M3: 2.0**-9, fp8.E5M2: 2.0**-16}
"""The smallest subnormal: below it the error is absolute, at most half of it."""


def matrix(shape, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # magnitudes over ten decades, so that some elements land among the subnormals
    x = torch.randn(shape, device="cuda", generator=gen) * 10 ** (torch.rand(shape, device="cuda", generator=gen) * 10 - 8)
    return (x * scale).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rowwise, transposed", [(True, False), (False, True), (True, True)])
def test_quantize_is_its_reference_bit_for_bit(dtype, shape, rowwise, transposed):
    x = matrix(shape)
    q, q_t, scale_inv = fp8.quantize(x, dtype, rowwise, transposed)
    ref_q, ref_q_t, ref_scale_inv = fp8.quantize_reference(x, dtype, rowwise, transposed)
    assert scale_inv.item() == ref_scale_inv.item()
    for got, want in ((q, ref_q), (q_t, ref_q_t)):
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_from_partial_maxima_is_quantize_bit_for_bit(dtype, shape):
    """Given its rows' maxima (as the fused SwiGLU gives its blocks'), the cast skips its own maximum pass: the same
    scale and bytes. A NaN among the maxima stays visible, as one in x does."""
    x = matrix(shape)
    rows_amax = x.abs().float().amax(1).view(torch.int32)
    (q, q_t, scale_inv), (want_q, want_q_t, want_scale_inv) = (fp8.quantize(x, dtype, True, True, maxima)
                                                                for maxima in (rows_amax, None))
    assert torch.equal(scale_inv, want_scale_inv)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), want_q_t.view(torch.uint8))
    rows_amax[-1] = torch.tensor(float("nan")).view(torch.int32)
    assert fp8.quantize(x, dtype, True, True, rows_amax)[2].isnan().item()


def test_quantize_from_more_partial_maxima_than_threads():
    """Each thread reduces several of the maxima (grid-stride): one for each element of a matrix of few tiles."""
    x = matrix((64, 4096))
    for got, want in zip(fp8.quantize(x, fp8.E4M3, True, True, x.abs().float().flatten().view(torch.int32))[:2],
                         fp8.quantize(x, fp8.E4M3, True, True)[:2]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_quantize_of_a_matrix_that_starts_off_alignment(dtype):
    """A matrix whose storage starts 2 bytes past a 16-byte boundary takes the kernels' element-wise paths."""
    storage = torch.empty(128 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    x = storage[1:].view(128, 128).copy_(matrix((128, 128)))
    assert x.is_contiguous() and x.data_ptr() % 16 == 2
    q, q_t, scale_inv = fp8.quantize(x, dtype, True, True)
    want_q, want_q_t, want_scale_inv = fp8.quantize_reference(x, dtype, True, True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), want_q_t.view(torch.uint8))
    assert scale_inv.item() == want_scale_inv.item()


def test_quantize_finds_the_maximum_wherever_it_lies():
    """The maximum pass reads a large matrix four loads a thread at a time, then the rest one at a time: a single
    largest element planted at the start, the end, in each of the first loads' places and in the rest is found."""
    x = matrix((4096, 4100), seed=2)  # 16.8M elements: many rounds of the four loads, then a rest
    # a round of the pass: 8 elements a load for each thread of the grid, 256 a block and as many blocks as the GPU
    # holds at once (csrc/fp8_cuda.cu, a cooperative launch: 1 to 8 a multiprocessor, by the kernel's registers)
    numel, sms = x.numel(), torch.cuda.get_device_properties(0).multi_processor_count
    places = {0, 1, numel - 1, numel // 2}
    for stride in (8 * 256 * sms * per_sm for per_sm in range(1, 9)):
        places |= {*(u * stride + 3 for u in range(4)), numel - stride + 5}
    for place in sorted(places):
        planted = x.clone()
        planted.view(-1)[place] = -1e4
        assert fp8.quantize(planted, fp8.E4M3)[2].item() == pytest.approx(1e4 / fp8.FP8_MAX[fp8.E4M3], rel=1e-2), place


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_quantize_scale_is_exact_and_nothing_is_clipped(dtype):
    """The scale is fp8_max / amax of this very tensor: the largest element lands on fp8_max, none beyond it; and the
    round trip is within half an fp8 step (relative; absolute among the subnormals)."""
    x = matrix((512, 1024), seed=1, scale=1e3)
    amax = x.abs().max().float()
    q, _, scale_inv = fp8.quantize(x, dtype)
    assert scale_inv.item() == (1 / (fp8.FP8_MAX[dtype] / amax)).item()
    values = q.float()
    assert values.abs().max().item() == fp8.FP8_MAX[dtype]
    assert values.isfinite().all()
    back = values * scale_inv
    bound = torch.maximum(RELATIVE[dtype] * x.float().abs(), SMALLEST[dtype] / 2 * scale_inv)
    assert bool(((back - x.float()).abs() <= bound * (1 + 2**-20)).all())


def test_quantize_of_zeros_and_of_a_nan():
    zeros = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    q, _, scale_inv = fp8.quantize(zeros, fp8.E4M3)
    assert scale_inv.item() == 1.0 and not q.float().any()
    x = matrix((64, 64))
    x[3, 5] = float("nan")
    _, _, scale_inv = fp8.quantize(x, fp8.E4M3)
    assert scale_inv.isnan().item()  # visible downstream: the step's loss is NaN and the step is skipped


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_quantize_of_an_infinity_and_of_subnormal_magnitudes(dtype):
    """An infinite element makes amax infinite: the scale is 0, so the cast is NaN where x is infinite and 0 elsewhere,
    and the inverse scale infinite, as in the reference: the step's loss is not finite and the step is skipped. A
    matrix of subnormal bf16 magnitudes scales up to fp8_max (the scale clamped to float32's largest), also as in the
    reference, bit for bit: its largest element lands on amax times float32's largest, below fp8_max, and the inverse
    scale is a float32 subnormal, which the kernel must not flush to zero."""
    x = matrix((64, 64))
    x[7, 9] = float("inf")
    q, q_t, scale_inv = fp8.quantize(x, dtype, True, True)
    ref_q, ref_q_t, ref_scale_inv = fp8.quantize_reference(x, dtype, True, True)
    assert scale_inv.item() == ref_scale_inv.item() == float("inf")
    assert q.float()[7, 9].isnan() and not q.float().isinf().any()
    tiny = torch.full((64, 64), 2.0**-130, device="cuda").to(torch.bfloat16)  # bf16 subnormals
    tiny[0, 0] = -(2.0**-128)
    q, q_t, scale_inv = fp8.quantize(tiny, dtype, True, True)
    ref_q, ref_q_t, ref_scale_inv = fp8.quantize_reference(tiny, dtype, True, True)
    assert scale_inv.item() == ref_scale_inv.item() > 0
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), ref_q_t.view(torch.uint8))
    assert q.float().abs().max().item() < fp8.FP8_MAX[dtype]


def test_quantize_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        fp8.quantize(torch.zeros(8, 8, device="cuda"), fp8.E4M3)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        fp8.quantize(torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16).t(), fp8.E4M3)
    with pytest.raises(RuntimeError, match="dtype must be float8_e4m3fn or float8_e5m2"):
        fp8.quantize(torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16), torch.bfloat16)


def test_quantize_traces_under_compile():
    x = matrix((128, 256))
    compiled = torch.compile(lambda t: fp8.quantize(t, fp8.E4M3, True, True), fullgraph=True)
    q, q_t, scale_inv = compiled(x)
    want_q, want_q_t, want_scale_inv = fp8.quantize(x, fp8.E4M3, True, True)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), want_q_t.view(torch.uint8))
    assert torch.equal(scale_inv, want_scale_inv)


# ---------------------------------------------------------------------------------------------------- fp8 linear

FORWARD_TOLERANCE, BACKWARD_TOLERANCE = 0.08, 0.12
"""Relative (Frobenius) error of the fp8 matmul against bf16 inputs multiplied in float32. Each operand carries up to
half an fp8 step of relative error, about a third of it on average (2**-4 / sqrt(3) = 3.6% for e4m3, 7.2% for
e5m2); the errors of the products are independent, so the result's relative error is about the operands' combined:
5% forward (e4m3 x e4m3), 8% for the gradients (e5m2 x e4m3)."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("fast_accum", [False, True], ids=["split-accumulation", "fast-accumulation"])
def test_fp8_linear_matches_bf16_forward_and_backward(fast_accum):
    """Either way the backward GEMMs accumulate (knobs.fp8_backward_fast_accum), within the tolerances the fp8 casts
    alone set."""
    needs_fp8_tensor_cores()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 256, 1024, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(768, 1024, device="cuda", generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(4, 256, 768, device="cuda", generator=gen).to(torch.bfloat16)
    y = fp8.fp8_linear(x, weight, fast_accum=fast_accum)
    y.backward(grad)
    fp8_grads = x.grad, weight.grad
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    y32 = x32 @ w32.t()
    y32.backward(grad.float())
    assert y.dtype == torch.bfloat16 and y.shape == y32.shape
    assert relative_error(y, y32) < FORWARD_TOLERANCE
    assert relative_error(fp8_grads[0], x32.grad) < BACKWARD_TOLERANCE
    assert relative_error(fp8_grads[1], w32.grad) < BACKWARD_TOLERANCE
    # and against the same casts emulated in float32 (quantize_reference): only the GEMMs' summation order differs
    xq, _, x_inv = fp8.quantize_reference(x.detach().flatten(0, 1), fp8.E4M3)
    wq, _, w_inv = fp8.quantize_reference(weight.detach(), fp8.E4M3)
    emulated = (xq.float() * x_inv) @ (wq.float() * w_inv).t()
    assert relative_error(y.flatten(0, 1), emulated) < 0.01
    # the backward GEMMs too, fast accumulation or not: sums over 768 outputs and 1,024 tokens
    gq, gq_t, g_inv = fp8.quantize_reference(grad.flatten(0, 1), fp8.E5M2, transposed=True)
    _, xq_t, _ = fp8.quantize_reference(x.detach().flatten(0, 1), fp8.E4M3, transposed=True)
    grad_x = (gq.float() * g_inv) @ (wq.float() * w_inv)
    grad_weight = (gq_t.float() * g_inv) @ (xq_t.float() * x_inv).t()
    assert relative_error(fp8_grads[0].flatten(0, 1), grad_x) < 0.01
    assert relative_error(fp8_grads[1], grad_weight) < 0.01


def test_fp8_linear_with_a_frozen_weight_makes_only_the_input_gradient():
    needs_fp8_tensor_cores()
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    fp8.fp8_linear(x, weight).sum().backward()
    assert relative_error(x.grad, weight.float().sum(0).expand(256, -1)) < BACKWARD_TOLERANCE


def test_cached_fp8_weights_give_the_uncached_results_bit_for_bit():
    """The cache holds the casts the uncached linear makes (one pass writes both layouts): the same output and
    gradients, exactly."""
    needs_fp8_tensor_cores()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(384, 256, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    grad = torch.randn(512, 384, device="cuda", generator=gen).to(torch.bfloat16)
    results = []
    for cache in ((), fp8.quantize(weight, fp8.E4M3, rowwise=True, transposed=True)):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = fp8.fp8_linear(xi, wi, cache=cache)
        y.backward(grad)
        results.append((y, xi.grad, wi.grad))
    for name, uncached, cached in zip(("output", "input gradient", "weight gradient"), *results):
        assert torch.equal(uncached, cached), name


@pytest.mark.parametrize("fast_accum", [False, True], ids=["split-accumulation", "fast-accumulation"])
@pytest.mark.parametrize("cached", [False, True], ids=["cast", "cached"])
@pytest.mark.parametrize("shape", [(96, 64, 160), (8192, 4096, 14336)], ids=["small", "llama-3.1-8b"])
def test_the_fp8_feed_forward_is_its_parts_bit_for_bit(cached, shape, fast_accum):
    needs_fp8_tensor_cores()
    from test_precision import fused_feed_forward_matches_its_parts

    fused_feed_forward_matches_its_parts("cuda", cached, *shape, fast_accum=fast_accum)


@pytest.mark.parametrize("cached", [False, True], ids=["cast", "cached"])
@pytest.mark.parametrize("parts", [(), ("ffn", "attention"), ("block",)])
def test_compiled_fp8_blocks_share_one_graph(parts, cached):
    """Every converted block compiles to the same graph: torch.compile guards on the forward it calls, and a forward
    of each module's own would compile again for every block, to its recompile limit, then run the rest uncompiled."""
    needs_fp8_tensor_cores()
    from fastml.executor.model.apply import apply_plan
    from fastml.executor.model.transformer import build_model, materialize
    from fastml.plan import Knobs
    from fastml.spec import PRESETS

    torch._dynamo.reset()
    # the cached blocks with fast backward accumulation, to compile that knob too
    knobs = Knobs(matmul_dtype="fp8", recompute=parts, compile=True, cache_fp8_weights=cached,
                  fp8_backward_fast_accum=cached)
    model = materialize(apply_plan(build_model(PRESETS["tiny"]), knobs), "cuda", torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 65), device="cuda")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # a second step's casts are new tensors, taken without recompiling
            fp8.refresh_weight_caches(model)
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_recomputed_fp8_block_keeps_only_its_inputs(compiled):
    """The fp8 casts are recomputed with the rest of the block, compiled too (torch 2.11 had saved them)."""
    needs_fp8_tensor_cores()
    from test_precision import kept_by_a_recomputed_block

    assert kept_by_a_recomputed_block("cuda", matmul_dtype="fp8", compile=compiled) == []


# ---------------------------------------------------------------------------------------------------- AdamW op


def on_gpu_from(t: torch.Tensor, start: int) -> torch.Tensor:
    """t on the GPU, as a view `start` elements into a buffer of its own."""
    storage = torch.empty(start + t.numel(), dtype=t.dtype, device="cuda")
    return storage[start:].copy_(t)


def check_cuda_adamw_against_the_cpu_op(n: int, master_dtype, state_dtype, out_dtype, steps: int, beta1: float,
                                        start: int, seed: int, compensated: bool = False) -> None:
    """`steps` steps of the GPU op and the C++ CPU op on the same n elements (the GPU's tensors `start` elements into
    their buffers): master, m, v, the weight written beside fp32 masters and the compensation of bf16 ones the same
    bits."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen).to(master_dtype)
    m = (torch.randn(n, generator=gen) * 1e-3).to(state_dtype)
    v = (torch.rand(n, generator=gen) * 1e-5).to(state_dtype)
    out = torch.zeros(n, dtype=out_dtype) if out_dtype else None
    low = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) if compensated else None
    gpu = [on_gpu_from(t, start) if t is not None else None for t in (master, m, v, out, low)]
    cpu = [t.clone() if t is not None else None for t in (master, m, v, out, low)]
    for step in range(1, steps + 1):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
        # gradient scales as clipping makes them: 0.3 rounds the scaled bf16 gradient, 0.5 and 1 are exact
        args = (1e-3, beta1, 0.95, EPS, 0.1, step, (0.3, 0.5, 1.0)[step % 3], 40 + step, 11)
        cpu_adam.adamw_step_(*gpu[:3], on_gpu_from(grad, start), gpu[3], *args, master_low=gpu[4])
        cpu_adam.adamw_step_(*cpu[:3], grad, cpu[3], *args, master_low=cpu[4])
    for name, got, want in zip(["master", "exp_avg", "exp_avg_sq", "weight_out", "master_low"], gpu, cpu):
        if want is not None:
            assert torch.equal(got.cpu(), want), f"{name}: {int((got.cpu() != want).sum())} of {n} differ"


@pytest.mark.parametrize("master_dtype, state_dtype, out_dtype, compensated", [
    (torch.float32, torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, torch.bfloat16, None, False),
    (torch.bfloat16, torch.float32, None, False), (torch.float32, torch.float32, torch.bfloat16, False),
    (torch.float32, torch.float32, None, False), (torch.bfloat16, torch.bfloat16, None, True),
    (torch.bfloat16, torch.float32, None, True)])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # the two formulas of torch's lerp
@pytest.mark.parametrize("start", [0, 3])  # the GPU's buffers aligned (runs of 8, then the rest) or not (one by one)
def test_cuda_adamw_is_the_cpu_op_bit_for_bit(master_dtype, state_dtype, out_dtype, compensated, beta1, start):
    """The same arithmetic (csrc/adamw_math.h), the same random bits: the GPU's step is the C++ CPU op's, bit for
    bit, the weight it writes beside fp32 masters and the compensation of bf16 ones too, whichever of its kernels
    steps an element."""
    check_cuda_adamw_against_the_cpu_op(3 * 65536 + 5, master_dtype, state_dtype, out_dtype, steps=5, beta1=beta1,
                                        start=start, seed=0, compensated=compensated)


@pytest.mark.parametrize("master_dtype, state_dtype, out_dtype, compensated", [
    (torch.float32, torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, torch.bfloat16, None, False),
    (torch.bfloat16, torch.bfloat16, None, True)])
def test_cuda_adamw_of_more_runs_than_its_threads_is_the_cpu_op_bit_for_bit(master_dtype, state_dtype, out_dtype,
                                                                             compensated):
    """8M elements: each thread of the grid steps several runs of 8, each with the random bits of its own indices."""
    check_cuda_adamw_against_the_cpu_op(2**23 + 5, master_dtype, state_dtype, out_dtype, steps=1, beta1=0.9,
                                        start=0, seed=3, compensated=compensated)


# ---------------------------------------------------------------------------------------------------- training


def gpu_plan(steps, sequences=16, **knobs):
    plan = make_plan(seq_len=256, global_batch_tokens=256 * sequences, steps=steps, gpus=1,
                     overrides=pinned(**knobs)).plan
    assert plan.hardware.device == "cuda"
    return plan


def losses(tmp_path, name, steps=30, **knobs):
    train(gpu_plan(steps, **knobs), log_json=tmp_path / name, show_progress=False)
    return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    return losses(tmp_path_factory.mktemp("bf16"), "log.jsonl", micro_batch_size=4)


@pytest.mark.parametrize("knobs", [
    dict(matmul_dtype="fp8"),
    dict(optimizer_dtype="bf16", master_dtype="bf16"),
    dict(optimizer_dtype="bf16", master_dtype="bf16_kahan", offload_optimizer=0.5),
    dict(matmul_dtype="fp8", optimizer_dtype="bf16", master_dtype="bf16", recompute=("ffn", "attention"),
         compile=True),
    dict(matmul_dtype="fp8", recompute=("block",), offload_weights=1.0, offload_gradients=1.0,
         offload_optimizer=0.5, optimizer_dtype="bf16"),
], ids=["fp8", "bf16-state", "compensated-bf16-state+offload", "fp8+bf16-state+recompute+compile",
        "fp8+offload+bf16-state"])
def test_lower_precision_trains_like_bf16(tmp_path, bf16_losses, knobs):
    got = losses(tmp_path, "log.jsonl", micro_batch_size=4, **knobs)
    assert got[0] == pytest.approx(bf16_losses[0], rel=0.01)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(got[-5:]) <= 0.9 * mean(got[:5])
    assert mean(got[-5:]) == pytest.approx(mean(bf16_losses[-5:]), rel=0.03)


@pytest.mark.parametrize("knobs", [dict(), dict(recompute=("block",), compile=True),
                                   dict(offload_weights=0.5, recompute=("block",))],
                         ids=["eager", "compile", "offload"])
def test_cached_fp8_weights_train_as_the_uncached_bit_for_bit(tmp_path, knobs):
    """Two micro-batches a step: the cached weights are the step's, cast at its start (a stale cache would give the
    second step's losses away). With half the blocks streamed, only the others cache."""
    needs_fp8_tensor_cores()
    cast = losses(tmp_path, "cast.jsonl", steps=4, micro_batch_size=8, matmul_dtype="fp8", **knobs)
    cached = losses(tmp_path, "cached.jsonl", steps=4, micro_batch_size=8, matmul_dtype="fp8",
                    cache_fp8_weights=True, **knobs)
    assert cached == cast


def test_cached_fp8_weights_are_counted_as_the_planner_counts_them():
    """The cache's bytes (fp8 and transposed, 2 a weight of the cached blocks) are in the "weights" the meter
    measures, and in the planner's "weights" the same."""
    needs_fp8_tensor_cores()
    from fastml.executor.loop.meter import memory_tensors
    from fastml.executor.loop.meter import storage_bytes
    from fastml.planner.memory import memory

    measured = {}
    for cache in (False, True):
        plan = gpu_plan(1, micro_batch_size=8, matmul_dtype="fp8", offload_weights=0.5, cache_fp8_weights=cache)
        model = build_training_model(plan, torch.device("cuda"))
        gpu_bytes, _ = storage_bytes(memory_tensors(model, AdamW(model, plan.training, plan.knobs, model.placement)))
        predicted = memory(plan.model, plan.training.seq_len, plan.knobs, 1, 1, "cuda").gpu["weights"]
        measured[cache] = gpu_bytes["weights"], predicted
        del model
    spec = plan.model
    cached_blocks = spec.num_layers - round(0.5 * spec.num_layers)
    cache_bytes = cached_blocks * spec.layer_matmul_params() * 2
    scales = cached_blocks * 4 * 4  # a float32 inverse scale for each of a block's 4 linears: the planner omits them
    assert measured[True][0] - measured[False][0] == cache_bytes + scales
    assert measured[True][1] - measured[False][1] == cache_bytes


def test_bf16_state_lives_in_bf16_on_the_gpu():
    plan = gpu_plan(1, micro_batch_size=4, optimizer_dtype="bf16", master_dtype="bf16")
    model = build_training_model(plan, torch.device("cuda"))
    optimizer = AdamW(model, plan.training, plan.knobs, model.placement)
    for p in model.parameters():
        state = optimizer.state[p]
        assert "master" not in state  # the bf16 weights are the masters
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and state["exp_avg"].is_cuda
