"""fastml's C++ CPU AdamW (`torch.ops.fastml.adamw_step_`): against torch.optim.AdamW in float64 over a schedule,
against its Python reference, its gradient scaling, its refusals, and the one error of a machine that cannot build it.
The first run on a machine compiles the op (tens of seconds); later runs load the cached build."""

import os
import subprocess
import sys

import pytest
import torch

from fastml.config import UserError
from fastml.executor.memory import cpu_adam
from fastml.executor import native
from fastml.executor.memory.optim import EPS, lr_at
from fastml.plan import Training

U = 2.0**-24
"""The unit roundoff of float32: one rounding changes a value by at most this fraction of it."""
# A length that is no multiple of any vector width and spans several of the op's per-thread chunks (65,536 elements).
NUM_PARAMS = 2 * 65536 + 13


@pytest.fixture(scope="module", autouse=True)
def built_op():
    cpu_adam.load()


def fresh_state(num_params: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Master weights and Adam moments as after some training: random, none zero."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(num_params, generator=gen)
    exp_avg = torch.randn(num_params, generator=gen) * 1e-3
    exp_avg_sq = torch.rand(num_params, generator=gen) * 1e-5 + 1e-12
    return master, exp_avg, exp_avg_sq


def gradients(num_params: int, steps: int, dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    """Fresh gradients each step, each element with its own scale from 1e-7 to 1: the small ones make eps matter."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-7, 0, num_params)[torch.randperm(num_params, generator=gen)]
    return [(torch.randn(num_params, generator=gen) * scales).to(dtype) for _ in range(steps)]


def fp32_uses_fma_like_the_op() -> bool:
    """torch's eager lerp and addcmul round as the op does (each with one fused multiply-add) where its float kernels
    are vectorised for AVX2 or AVX-512; its scalar kernels (ATEN_CPU_CAPABILITY=default, other CPUs) round the
    multiply and the add apart."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("grad_dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_op_follows_torch_adamw_in_float64_over_a_schedule(grad_dtype, out_dtype):
    """150 steps with warmup, cosine decay, weight decay and bias correction (beta2 0.999 keeps it large throughout),
    fp32 state in the op, float64 in torch.optim.AdamW, the same gradients (bf16 ones are exact in float64)."""
    training = Training(steps=150, lr=1e-2, warmup_steps=15, weight_decay=0.1, beta1=0.9, beta2=0.999)
    master = torch.randn(NUM_PARAMS, generator=torch.Generator().manual_seed(0))
    exp_avg, exp_avg_sq = torch.zeros(NUM_PARAMS), torch.zeros(NUM_PARAMS)
    weight_out = torch.empty(NUM_PARAMS, dtype=out_dtype) if out_dtype else None
    param = torch.nn.Parameter(master.double())
    optimizer = torch.optim.AdamW([param], lr=training.lr, betas=(training.beta1, training.beta2), eps=EPS,
                                  weight_decay=training.weight_decay, foreach=False)
    max_abs_grad = torch.zeros(NUM_PARAMS, dtype=torch.float64)
    for step, grad in enumerate(gradients(NUM_PARAMS, training.steps, grad_dtype)):
        lr = lr_at(step, training)
        cpu_adam.adamw_step_(master, exp_avg, exp_avg_sq, grad, weight_out, lr, training.beta1, training.beta2, EPS,
                             training.weight_decay, step + 1)
        optimizer.param_groups[0]["lr"] = lr
        param.grad = grad.double()
        optimizer.step()
        max_abs_grad = torch.maximum(max_abs_grad, grad.double().abs())

    # Tolerances: each step rounds a few times (four on the weight: the decay, the update's product and quotient, the
    # sum, with Adam's update about lr or less; three on m and on v), each by at most U of the value rounded. At worst
    # the errors add up over the steps; m's older errors shrink by beta1 a step, so m's stay under 1 / (1 - beta1)
    # steps' worth. Measured here: the weight's error is about a third of its bound, m's and v's less than a tenth.
    state = optimizer.state[param]
    steps = training.steps
    assert_within(master, param.detach(), 4 * steps * U * (param.detach().abs() + training.lr))
    assert_within(exp_avg, state["exp_avg"], 3 * U * max_abs_grad / (1 - training.beta1))
    assert_within(exp_avg_sq, state["exp_avg_sq"], 3 * steps * U * state["exp_avg_sq"])
    if weight_out is not None:
        assert torch.equal(weight_out, master.to(out_dtype))  # the op's own master, rounded to nearest even
        # and so at most one bf16 step (at most 2**-7 of the value) from the float64 weight rounded to bf16
        assert_within(weight_out, param.detach().to(out_dtype), 2.0**-7 * param.detach().abs())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tolerance: torch.Tensor) -> None:
    error = (actual.double() - expected.double()).abs()
    worst = int((error - tolerance).argmax())
    assert bool((error <= tolerance).all()), (f"element {worst}: {actual[worst].item()} vs {expected[worst].item()}, "
                                              f"error {error[worst].item():.3g} > {tolerance[worst].item():.3g}")


# (master, m and v) dtypes: fp32, bf16 moments, bf16 masters too (no weight_out then)
STATE_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                (torch.bfloat16, torch.float32)]


def fresh_state_in(num_params: int, master_dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 0):
    master, exp_avg, exp_avg_sq = fresh_state(num_params, seed)
    return master.to(master_dtype), exp_avg.to(state_dtype), exp_avg_sq.to(state_dtype)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # torch's lerp takes another formula for a weight 1 - beta1 >= 0.5
@pytest.mark.parametrize("dtypes, out_dtype, compensated", [  # a weight_out beside fp32 masters only, a
    (dtypes, out, False) for dtypes in STATE_DTYPES  # compensation beside bf16 ones only
    for out in ([None, torch.float32, torch.bfloat16] if dtypes[0] == torch.float32 else [None])] + [
    (dtypes, None, True) for dtypes in STATE_DTYPES if dtypes[0] == torch.bfloat16])
def test_op_matches_its_python_reference(grad_dtype, beta1, dtypes, out_dtype, compensated):
    """Bit for bit where torch's kernels round as the op does (x86 with AVX2 or AVX-512); within a few roundings
    elsewhere. bf16 masters and moments round stochastically, with the same random bits in both; bf16 masters with
    a compensation to nearest."""
    op_state, ref_state = fresh_state_in(NUM_PARAMS, *dtypes), fresh_state_in(NUM_PARAMS, *dtypes)
    op_out, ref_out = [torch.zeros(NUM_PARAMS, dtype=out_dtype) if out_dtype else None for _ in range(2)]
    op_low, ref_low = [torch.zeros(NUM_PARAMS, dtype=torch.bfloat16) if compensated else None for _ in range(2)]
    for step, grad in enumerate(gradients(NUM_PARAMS, 20, grad_dtype)):
        args = (3e-3 * (step + 1) / 20, beta1, 0.95, EPS, 0.1, step + 1, 0.7 if step % 2 else 1.0, 1234 + step, 77)
        cpu_adam.adamw_step_(*op_state, grad, op_out, *args, master_low=op_low)
        cpu_adam.adamw_step_reference_(*ref_state, grad, ref_out, *args, master_low=ref_low)
    for name, op, ref in zip(["master", "exp_avg", "exp_avg_sq", "weight_out", "master_low"],
                             [*op_state, op_out, op_low], [*ref_state, ref_out, ref_low]):
        if op is None:
            continue
        if compensated and name in ("master", "master_low") and not fp32_uses_fma_like_the_op():
            # a float32 rounding apart can tip the weight to the other bf16 neighbour and its compensation with it:
            # their sum, the master, agrees to its own precision (about 16 bits)
            if name == "master":
                torch.testing.assert_close(op.float() + op_low.float(), ref.float() + ref_low.float(),
                                           rtol=2**-15, atol=0, msg=name)
        elif fp32_uses_fma_like_the_op():
            assert torch.equal(op, ref), f"{name}: {int((op != ref).sum())} of {op.numel()} elements differ"
        elif op.dtype == torch.float32:
            torch.testing.assert_close(op, ref, rtol=20 * 4 * U, atol=0, msg=name)
        else:  # a float32 rounding apart can tip a stochastic rounding to the other bf16 neighbour
            torch.testing.assert_close(op, ref, rtol=2**-7, atol=0, msg=name)


def test_reference_steps_like_torch_adamw():
    """The reference's arithmetic is torch.optim.AdamW's single-tensor step but for the square root, which it takes in
    float64 (torch's float32 sqrt on a CPU is not always correctly rounded): on float64 tensors, where that is torch's
    own sqrt, the two agree bit for bit."""
    master, exp_avg, exp_avg_sq = (t.double() for t in fresh_state(1000))
    param = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1, foreach=False)
    optimizer.state[param] = {"step": torch.tensor(4.0), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    grad = gradients(1000, 1, torch.float64)[0]
    param.grad = grad
    optimizer.step()
    cpu_adam.adamw_step_reference_(master, exp_avg, exp_avg_sq, grad, None, 1e-3, 0.9, 0.95, EPS, 0.1, 5)
    assert torch.equal(master, param.detach())
    assert torch.equal(exp_avg, optimizer.state[param]["exp_avg"])
    assert torch.equal(exp_avg_sq, optimizer.state[param]["exp_avg_sq"])


def step_once(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    master, exp_avg, exp_avg_sq = fresh_state(NUM_PARAMS)
    cpu_adam.adamw_step_(master, exp_avg, exp_avg_sq, grad, None, 1e-3, 0.9, 0.95, EPS, 0.1, 3, grad_scale)
    return torch.cat([master, exp_avg, exp_avg_sq])


def test_grad_scale_is_scaling_the_gradient_first():
    grad = gradients(NUM_PARAMS, 1, torch.float32)[0]
    assert torch.equal(step_once(grad, 0.3), step_once(grad * 0.3, 1.0))
    assert not torch.equal(step_once(grad, 0.3), step_once(grad, 1.0))


def test_bf16_gradient_is_scaled_in_bf16_as_clipping_in_place_would():
    grad = gradients(NUM_PARAMS, 1, torch.bfloat16)[0]
    clipped = grad.clone().mul_(0.3)  # what clipping does to a bf16 gradient: rounded back to bf16
    assert torch.equal(step_once(grad, 0.3), step_once(clipped, 1.0))
    # and the rounding is there to see: scaling in float32 without it steps elsewhere
    assert not torch.equal(step_once(grad, 0.3), step_once(grad.float() * 0.3, 1.0))


def test_meta_tensors_pass_for_tracing():
    meta = [torch.empty(10, device="meta") for _ in range(4)]
    torch.ops.fastml.adamw_step_(*meta, None, 1e-3, 0.9, 0.95, EPS, 0.0, 1, 1.0, 0, 0)
    compensated = [torch.empty(10, device="meta", dtype=torch.bfloat16), *meta[1:]]
    torch.ops.fastml.adamw_step_(*compensated, None, 1e-3, 0.9, 0.95, EPS, 0.0, 1, 1.0, 0, 0,
                                 torch.empty(10, device="meta", dtype=torch.bfloat16))


@pytest.mark.parametrize("dtypes, message", [
    ((torch.float32, torch.bfloat16, torch.float32, None, None), "exp_avg and exp_avg_sq must have one dtype"),
    ((torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, None), "weight_out goes with float32 masters"),
    ((torch.float32, torch.float32, torch.float32, None, torch.bfloat16), "master_low, the compensation of bfloat16"),
    ((torch.bfloat16, torch.float32, torch.float32, None, torch.float32), "master_low, the compensation of bfloat16"),
])
def test_meta_tensors_are_refused_as_the_cpu_kernel_refuses_them(dtypes, message):
    """torch.compile traces the op through its meta kernel: a call the kernels would refuse fails there already."""
    master, exp_avg, exp_avg_sq, weight_out, master_low = (
        None if dtype is None else torch.empty(10, device="meta", dtype=dtype) for dtype in dtypes)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fastml.adamw_step_(master, exp_avg, exp_avg_sq, torch.empty(10, device="meta"), weight_out, 1e-3,
                                     0.9, 0.95, EPS, 0.0, 1, 1.0, 0, 0, master_low)


def bad_call(master=None, exp_avg=None, exp_avg_sq=None, grad=None, weight_out=None, **hyper):
    n = 10
    args = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=EPS, weight_decay=0.1, step=1, grad_scale=1.0, seed=0,
                offset=0) | hyper
    cpu_adam.adamw_step_(torch.zeros(n) if master is None else master,
                         torch.zeros(n) if exp_avg is None else exp_avg,
                         torch.zeros(n) if exp_avg_sq is None else exp_avg_sq,
                         torch.zeros(n) if grad is None else grad, weight_out, **args)


SHARED = torch.zeros(15)


@pytest.mark.parametrize("kwargs, message", [
    (dict(master=torch.zeros(10, dtype=torch.float16)), "master must be float32 or bfloat16, got Half"),
    (dict(exp_avg_sq=torch.zeros(10, dtype=torch.float64)), "exp_avg_sq must be float32 or bfloat16, got Double"),
    (dict(exp_avg=torch.zeros(10, dtype=torch.bfloat16)), "exp_avg and exp_avg_sq must have one dtype"),
    (dict(master=torch.zeros(10, dtype=torch.bfloat16), weight_out=torch.zeros(10, dtype=torch.bfloat16)),
     "weight_out goes with float32 masters; bfloat16 masters are the weights"),
    (dict(offset=2**32 - 9), "offset \\+ elements must be within \\[0, 2\\*\\*32\\]"),
    (dict(master_low=torch.zeros(10, dtype=torch.bfloat16)),
     "master_low, the compensation of bfloat16 masters, goes with bfloat16 masters and is bfloat16; got Float masters "
     "and a BFloat16 master_low"),
    (dict(master=torch.zeros(10, dtype=torch.bfloat16), master_low=torch.zeros(10)),
     "master_low, the compensation of bfloat16 masters, goes with bfloat16 masters and is bfloat16; got BFloat16 "
     "masters and a Float master_low"),
    (dict(master=torch.zeros(10, dtype=torch.bfloat16), master_low=torch.zeros(9, dtype=torch.bfloat16)),
     "master_low has 9 elements, master has 10"),
    (dict(grad=torch.zeros(10, dtype=torch.float16)), "grad must be float32 or bfloat16, got Half"),
    (dict(weight_out=torch.zeros(10, dtype=torch.float16)), "weight_out must be float32 or bfloat16, got Half"),
    (dict(grad=torch.zeros(10, device="meta")), "grad must be a CPU tensor"),
    (dict(exp_avg=torch.zeros(20)[::2]), "exp_avg must be contiguous"),
    (dict(grad=torch.zeros(9)), "grad has 9 elements, master has 10"),
    (dict(weight_out=torch.zeros(11, dtype=torch.bfloat16)), "weight_out has 11 elements, master has 10"),
    (dict(master=SHARED[:10], exp_avg=SHARED[5:]), "master and exp_avg share memory"),
    (dict(step=0), "step counts the steps taken including this one, so it is >= 1, got 0"),
    (dict(beta2=1.0), "beta2 must be in \\[0, 1\\), got 1"),
    (dict(lr=-1e-3), "lr must be >= 0"),
    (dict(grad_scale=float("inf")), "grad_scale must be finite"),
])
def test_bad_inputs_are_refused(kwargs, message):
    with pytest.raises(RuntimeError, match=f"fastml::adamw_step_: {message}"):
        bad_call(**kwargs)


def test_a_later_process_loads_the_cached_build_without_compiling():
    code = "from fastml.executor.memory import cpu_adam; import torch; cpu_adam.load(); print(torch.ops.fastml.adamw_step_)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert "fastml.adamw_step_" in result.stdout
    assert "compiling" not in result.stderr


@pytest.fixture
def unbuilt(tmp_path, monkeypatch):
    """A process that has not loaded the op, with an empty cache."""
    monkeypatch.setenv("FASTML_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", set())
    return tmp_path


def test_no_compiler_is_one_clear_error_and_no_fallback(unbuilt, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler++")
    for attempt in (native.load, lambda: bad_call()):  # the step too: no Python step in the op's place
        with pytest.raises(UserError) as error:
            attempt()
        assert "no C++ compiler was found ('no-such-compiler++' is not on PATH)" in str(error.value)
        assert "\n" not in str(error.value)


def test_cuda_ops_without_a_gpu_are_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="fastml's CUDA ops \\(csrc/\\) need a CUDA GPU and a CUDA build of torch"):
        native.load_cuda()


def test_cuda_ops_without_nvcc_are_one_clear_error(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(native.shutil, "which", lambda name: None if name == "nvcc" else "/usr/bin/" + name)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(UserError) as error:
        native._check_tools(native.CUDA_OPS)
    assert "nvcc was not found (not on PATH, nor in $CUDA_HOME/bin)" in str(error.value)
    assert "\n" not in str(error.value)


def test_failed_build_is_one_line_with_the_compiler_output_in_a_file(unbuilt, monkeypatch):
    from torch.utils import cpp_extension

    def failing_build(*args, **kwargs):
        raise RuntimeError("Error building extension 'fastml_native'\n[1/2] c++ -O3 cpu_adam.cpp\n"
                           "cpu_adam.cpp:1: error: something the compiler said")

    monkeypatch.setattr(native, "_check_tools", lambda library: None)
    monkeypatch.setattr(cpp_extension, "load", failing_build)
    with pytest.raises(UserError) as error:
        cpu_adam.load()
    message = str(error.value)
    assert "\n" not in message
    assert "(fastml's C++ ops (csrc/)) failed: cpu_adam.cpp:1: error: something the compiler said" in message
    log = native.build_directory() / "build.log"
    assert str(log) in message
    assert "something the compiler said" in log.read_text()
    assert not (native.build_directory() / "complete").exists()  # the next process tries again


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    os.utime(stale, (0, 0))
    for lock in (stale, fresh, tmp_path / "absent"):
        native._remove_stale_lock(lock)
    assert not stale.exists() and fresh.exists()


# ---------------------------------------------------------------------------------------------------- stochastic rounding


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each float32 value (by truncating its bits, and one step on)."""
    bits = x.view(torch.int32) & ~0xFFFF
    low = bits.view(torch.float32)
    high = (bits + 0x10000).view(torch.float32)
    return torch.minimum(low, high), torch.maximum(low, high)


@pytest.mark.parametrize("dtypes", STATE_DTYPES[1:], ids=["bf16-moments", "bf16-all", "bf16-masters"])
def test_stochastic_rounding_is_unbiased(dtypes):
    """Many copies of one element step alike: each bf16 result is one of the two bf16 neighbours of the float32 one
    (the same step with float32 state), and their mean is that float32 value within 5 standard errors."""
    n = 2**20
    master_dtype, state_dtype = dtypes
    base = [t[:1].to(master_dtype if i == 0 else state_dtype).float().expand(n).contiguous()
            for i, t in enumerate(fresh_state(1, seed=3))]
    grad = torch.full((n,), 3e-4)
    exact = [t.clone() for t in base]
    cpu_adam.adamw_step_(*exact, grad, None, 1e-3, 0.9, 0.95, EPS, 0.1, 7)
    rounded = [t.to(master_dtype if i == 0 else state_dtype) for i, t in enumerate(base)]
    cpu_adam.adamw_step_(*rounded, grad, None, 1e-3, 0.9, 0.95, EPS, 0.1, 7, seed=99)
    for name, value, want in zip(["master", "exp_avg", "exp_avg_sq"], rounded, exact):
        if value.dtype != torch.bfloat16:
            continue
        target = want[0].item()
        low, high = (t[0].item() for t in bf16_neighbours(want[:1]))
        assert low < target < high, f"{name}: {target} is a bf16 value: nothing to round"
        got = value.float()
        assert bool(((got == low) | (got == high)).all()), name
        p = (target - low) / (high - low)
        standard_error = (high - low) * (p * (1 - p) / n) ** 0.5
        assert abs(got.double().mean().item() - target) < 5 * standard_error, name


def test_rounding_draws_depend_on_seed_and_element_only():
    """The same seed rounds alike; another seed otherwise; and a slice stepped with its offset draws what it drew
    inside the whole tensor, so that sharding or chunking the step changes no bit."""
    def step(seed, start=0, end=NUM_PARAMS):
        master, exp_avg, exp_avg_sq = (t[start:end].clone() for t in fresh_state_in(NUM_PARAMS, *STATE_DTYPES[2]))
        grad = gradients(NUM_PARAMS, 1, torch.bfloat16)[0][start:end].clone()
        cpu_adam.adamw_step_(master, exp_avg, exp_avg_sq, grad, None, 1e-3, 0.9, 0.95, EPS, 0.1, 2, seed=seed,
                             offset=start)
        return torch.cat([master.float(), exp_avg.float(), exp_avg_sq.float()])

    whole = step(5)
    assert torch.equal(whole, step(5))
    assert not torch.equal(whole, step(6))
    half = NUM_PARAMS // 2
    first, second = step(5, 0, half), step(5, half, NUM_PARAMS)
    split = torch.cat([torch.cat([a, b]) for a, b in zip(first.chunk(3), second.chunk(3))])
    assert torch.equal(split, whole)


def test_bf16_masters_with_stochastic_rounding_follow_fp32_masters():
    """An update below half a bf16 step is lost to rounding to nearest, every step; stochastic rounding keeps it on
    average. 200 steps of a constant gradient at lr 1e-4 on weights just below 1 (bf16 step there: 2**-8, about 39
    times the update): round to nearest never moves, stochastic rounding ends near the fp32 masters' weights."""
    n, steps = 4096, 200
    fp32 = [torch.ones(n), torch.zeros(n), torch.zeros(n)]
    bf16 = [torch.ones(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n)]
    grad = torch.ones(n)
    for step in range(1, steps + 1):
        cpu_adam.adamw_step_(*fp32, grad, None, 1e-4, 0.9, 0.95, EPS, 0.0, step)
        cpu_adam.adamw_step_(*bf16, grad, None, 1e-4, 0.9, 0.95, EPS, 0.0, step, seed=step)
    nearest = torch.ones(n, dtype=torch.bfloat16) - 1e-4  # one step's update, rounded to nearest: lost
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    moved = 1 - fp32[0].mean().item()
    assert moved == pytest.approx(steps * 1e-4, rel=0.01)
    assert 1 - bf16[0].float().mean().item() == pytest.approx(moved, rel=0.05)


def test_compensated_bf16_masters_keep_what_rounding_drops():
    """The same 200 steps with a compensation (knobs.master_dtype "bf16_kahan"): the weight moves as the fp32 masters'
    does, and the sum of weight and compensation stays within its precision of them. Each step rounds the compensation
    once, by at most half its last bit: below 1 the weight's bf16 step is 2**-8, the compensation at most half of that,
    its last bit 2**-16; and fp32 masters round once a step too, by at most 2**-25 there."""
    n, steps = 4096, 200
    fp32 = [torch.ones(n), torch.zeros(n), torch.zeros(n)]
    bf16 = [torch.ones(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n)]
    low = torch.zeros(n, dtype=torch.bfloat16)
    grad = torch.ones(n)
    for step in range(1, steps + 1):
        cpu_adam.adamw_step_(*fp32, grad, None, 1e-4, 0.9, 0.95, EPS, 0.0, step)
        cpu_adam.adamw_step_(*bf16, grad, None, 1e-4, 0.9, 0.95, EPS, 0.0, step, master_low=low)
    master = bf16[0].float() + low.float()
    assert (master - fp32[0]).abs().max().item() <= steps * (2.0**-17 + 2.0**-25)
    assert 1 - bf16[0].float().mean().item() == pytest.approx(steps * 1e-4, rel=0.1)  # the weight moved: 5 bf16 steps


def test_reference_stochastic_rounding_is_bf16_of_truncation_or_the_next_value():
    values = torch.randn(10000)
    rounded = cpu_adam.bf16_stochastic(values, torch.randint(0, 2**16, (10000,))).float()
    low, high = bf16_neighbours(values)
    exact = values == values.to(torch.bfloat16).float()
    assert bool((exact & (rounded == values) | ~exact & ((rounded == low) | (rounded == high))).all())
