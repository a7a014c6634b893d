"""Lower-precision optimizer state on a CPU: bf16 Adam moments and bf16 master weights (knobs.optimizer_dtype,
knobs.master_dtype), stepped by fastml's op with stochastic rounding, or the bf16 masters with a compensation
("bf16_kahan"). They train close to fp32 state, keep a third (a half with the compensation) of the optimizer's
memory, and resume bit for bit (the rounding's random bits come from the seed, not a generator's
state). tests/test_gpu_precision.py trains with them on a GPU, and with fp8 matmuls, which need one; here fp8 runs
emulated, for what surrounds its casts and GEMMs (the weights' fp8 cache)."""

import json

import pytest
import torch

from fastml.plan import Knobs, Plan, Training
from emulated_fp8 import emulated_fp8 as emulated
from small_model import EVAL_TOKENS, SMALL
from fastml.executor.loop.build import build_training_model
from fastml.executor.memory.optim import AdamW
from fastml.executor.loop.train import train

LOWER = {"optimizer_dtype": "bf16", "master_dtype": "bf16"}
KAHAN = {"optimizer_dtype": "bf16", "master_dtype": "bf16_kahan"}


def cpu_plan(steps=12, checkpoint_dir=None, **knobs):
    """bf16 parameters, as on a GPU; two micro-batches a step."""
    training = Training(seq_len=32, global_batch_tokens=32 * 4, steps=steps, lr=3e-3, warmup_steps=2,
                        eval_tokens=EVAL_TOKENS, checkpoint_dir=checkpoint_dir, checkpoint_interval=3 if checkpoint_dir else 0)
    return Plan(model=SMALL, training=training, knobs=Knobs(micro_batch_size=2, grad_accum_steps=2, **knobs))


def run_losses(plan, log, **kwargs):
    train(plan, log_json=log, show_progress=False, **kwargs)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory):
    return run_losses(cpu_plan(), tmp_path_factory.mktemp("fp32") / "log.jsonl")


@pytest.mark.parametrize("knobs", [{"optimizer_dtype": "bf16"}, {"master_dtype": "bf16"}, LOWER,
                                   {"master_dtype": "bf16_kahan"}, KAHAN],
                         ids=["bf16-moments", "bf16-masters", "both", "compensated-masters", "both-compensated"])
def test_bf16_optimizer_state_trains_like_fp32_state(tmp_path, fp32_losses, knobs):
    losses = run_losses(cpu_plan(**knobs), tmp_path / "log.jsonl")
    assert losses[0] == fp32_losses[0]  # before any step
    assert losses[-1] < 0.9 * losses[0]  # it learns
    assert losses[-1] == pytest.approx(fp32_losses[-1], rel=0.02)
    assert losses != fp32_losses  # and it is another arithmetic


def test_the_weights_are_their_fp32_masters_rounded_to_nearest(tmp_path):
    """fastml's op writes the bf16 weight beside the fp32 master in the same pass: the weight is the master rounded
    to nearest even, as a copy would round it."""
    plan = cpu_plan(steps=2, **{"optimizer_dtype": "bf16"})
    model = build_training_model(plan, torch.device("cpu"))
    optimizer = AdamW(model, plan.training, plan.knobs)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
    optimizer.step()
    for p in model.parameters():
        master = optimizer.state[p]["master"]
        assert not torch.equal(master, master.to(torch.bfloat16).float())  # stepped, and finer than bf16
        assert torch.equal(p.detach(), master.to(torch.bfloat16).view(p.shape))


def test_bf16_state_keeps_a_third_of_the_optimizer_memory():
    sizes = {}
    for name, knobs in (("fp32", {}), ("bf16", LOWER)):
        plan = cpu_plan(**knobs)
        model = build_training_model(plan, torch.device("cpu"))
        optimizer = AdamW(model, plan.training, plan.knobs)
        sizes[name] = sum(t.nbytes for t in optimizer.state_tensors().values() if t.ndim > 0)
    # fp32: master 4 + m 4 + v 4 bytes a parameter; bf16: m 2 + v 2 (the bf16 weights are the masters)
    assert sizes["bf16"] * 3 == sizes["fp32"]


def test_compensated_masters_keep_a_compensation_beside_the_moments_and_step_alike_offloaded(tmp_path):
    """master_dtype "bf16_kahan": a bf16 compensation a parameter with its m and v (half the fp32 state's bytes,
    2 a parameter more than bf16's), starting at zero and written by the step; offload_optimizer steps it in host
    memory slice by slice with the same op, so the losses are the same bits, and not those of stochastic rounding
    (which a step that left the compensation out would fall back to)."""
    plan = cpu_plan(**KAHAN)
    model = build_training_model(plan, torch.device("cpu"))
    optimizer = AdamW(model, plan.training, plan.knobs)
    lows = [optimizer.state[p]["master_low"] for p in model.parameters()]
    assert all(low.dtype == torch.bfloat16 and low.shape == p.shape and not low.any()
               for low, p in zip(lows, model.parameters()))
    state_bytes = sum(t.nbytes for t in optimizer.state_tensors().values() if t.ndim > 0)
    assert state_bytes == 6 * sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
    optimizer.step()
    assert all(low.any() for low in lows)  # each kept some of what rounding its weights dropped
    losses = run_losses(plan, tmp_path / "resident.jsonl")
    assert run_losses(cpu_plan(offload_optimizer=1.0, **KAHAN), tmp_path / "offloaded.jsonl") == losses
    assert run_losses(cpu_plan(**LOWER), tmp_path / "stochastic.jsonl")[1:] != losses[1:]


@pytest.mark.parametrize("knobs", [LOWER, KAHAN], ids=["bf16", "compensated"])
def test_bf16_state_resumes_bit_for_bit(tmp_path, knobs):
    whole = run_losses(cpu_plan(steps=8, checkpoint_dir=str(tmp_path / "a"), **knobs), tmp_path / "a.jsonl")
    plan = cpu_plan(steps=8, checkpoint_dir=str(tmp_path / "b"), **knobs)
    first = run_losses(plan, tmp_path / "b.jsonl", steps=3)  # stops at 3 as a killed run would (the same lrs so far)
    resumed = run_losses(plan, tmp_path / "b.jsonl", resume=True)
    assert first == whole[:3]
    assert resumed == whole


# ---------------------------------------------------------------------------------------------------- fp8, emulated

@pytest.fixture
def emulated_fp8():
    """fp8 matmuls on a CPU (tests/emulated_fp8.py)."""
    with emulated() as fp8:
        yield fp8


def test_cached_fp8_weights_follow_the_weights_from_step_to_step(tmp_path, emulated_fp8, monkeypatch):
    """Casting the weights once a step (at its start) trains exactly as casting them at every use; a cache left as
    the first step cast it would not (the test would see it)."""
    plan = cpu_plan(steps=4, matmul_dtype="fp8")
    cast = run_losses(plan, tmp_path / "cast.jsonl")
    cached_plan = cpu_plan(steps=4, matmul_dtype="fp8", cache_fp8_weights=True)
    assert run_losses(cached_plan, tmp_path / "cached.jsonl") == cast
    refresh, calls = emulated_fp8.refresh_weight_caches, []
    monkeypatch.setattr(emulated_fp8, "refresh_weight_caches",
                        lambda model: calls.append(1) or (refresh(model) if len(calls) == 1 else None))
    stale = run_losses(cached_plan, tmp_path / "stale.jsonl")
    assert stale[0] == cast[0] and stale[1:] != cast[1:]


def test_cached_fp8_weights_are_not_in_checkpoints(emulated_fp8):
    model = build_training_model(cpu_plan(matmul_dtype="fp8", cache_fp8_weights=True), torch.device("cpu"))
    assert len(emulated_fp8.cached_linears(model)) == 4 * SMALL.num_layers
    assert not any("fp8" in name for name in model.state_dict())


@pytest.mark.parametrize("cached", [False, True], ids=["fp8", "fp8-cached"])
@pytest.mark.parametrize("part", ["norm", "ffn", "qkv", "attention", "block"])
def test_every_recompute_part_runs_the_converted_linears(emulated_fp8, monkeypatch, part, cached):
    """Each recompute choice composed with each module conversion: every linear multiplies in fp8, cached ones with
    their cache, in the forward pass and again where recompute reruns it (a conversion after recompute would have
    been bypassed: the recompute reruns the forward it wrapped)."""
    calls = []
    gemm = emulated_fp8.forward_gemm
    monkeypatch.setattr(emulated_fp8, "forward_gemm", lambda flat, w, cache, partial_amax=None:
                        calls.append(bool(cache)) or gemm(flat, w, cache, partial_amax))
    plan = cpu_plan(matmul_dtype="fp8", recompute=(part,), cache_fp8_weights=cached)
    model = build_training_model(plan, torch.device("cpu"))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    recomputed_linears = {"norm": 0, "attention": 0, "qkv": 1, "ffn": 2, "block": 4}[part]
    assert len(calls) == len(model.blocks) * (4 + recomputed_linears)
    assert set(calls) == {cached}


@pytest.mark.parametrize("fast_accum", [False, True])
def test_the_backward_gemms_accumulate_as_the_knob_says(emulated_fp8, monkeypatch, fast_accum):
    """knobs.fp8_backward_fast_accum reaches every backward GEMM of every fp8 linear (the feed-forward's function's
    too), and only those: the forward GEMMs always accumulate fast."""
    modes = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, use_fast_accum=False, **kwargs:
                        modes.append(use_fast_accum) or scaled_mm(*args, use_fast_accum=use_fast_accum, **kwargs))
    model = build_training_model(cpu_plan(matmul_dtype="fp8", fp8_backward_fast_accum=fast_accum), torch.device("cpu"))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    forward, modes[:] = list(modes), []
    loss.backward()
    assert forward == [True] * 4 * len(model.blocks)
    assert modes == [fast_accum] * 2 * 4 * len(model.blocks)


def fused_feed_forward_matches_its_parts(device: str, cached: bool, tokens=96, hidden=64, ffn=160,
                                         needs_grad=(True, True, True), fast_accum=False) -> None:
    """fp8.FP8FeedForwardFunction against the two fp8 linears around SwiGLU it replaces: the same output and gradients
    bit for bit, since it runs the same kernels and takes the same maxima (SwiGLU's, not the cast's own pass)."""
    from fastml.executor.model import fp8, fused

    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(2, tokens // 2, hidden, device=device, generator=gen).to(torch.bfloat16)
    gate_up = (torch.randn(2 * ffn, hidden, device=device, generator=gen) * 0.05).to(torch.bfloat16)
    down = (torch.randn(hidden, ffn, device=device, generator=gen) * 0.05).to(torch.bfloat16)
    grad = torch.randn(2, tokens // 2, hidden, device=device, generator=gen).to(torch.bfloat16)

    def caches(*weights):
        return [fp8.quantize(w, fp8.E4M3, rowwise=True, transposed=True) if cached else () for w in weights]

    def parts(x, gate_up, down):
        gate_up_cache, down_cache = caches(gate_up, down)
        h = fp8.fp8_linear(x, gate_up, cache=gate_up_cache, fast_accum=fast_accum)
        return fp8.fp8_linear(fused.swiglu(h), down, cache=down_cache, fast_accum=fast_accum)

    def fused_function(x, gate_up, down):
        flat = [t for cache in caches(gate_up, down) for t in (cache or (None,) * 3)]
        return fp8.FP8FeedForwardFunction.apply(x, gate_up, down, fast_accum, *flat)

    results = []
    for forward in (parts, fused_function):
        inputs = [t.clone().requires_grad_(needs) for t, needs in zip((x, gate_up, down), needs_grad)]
        y = forward(*inputs)
        if any(needs_grad):
            y.backward(grad)
        results.append((y, *(t.grad for t in inputs)))
    for name, want, got in zip(("output", "input gradient", "gate_up gradient", "down gradient"), *results):
        assert (got is None and want is None) or torch.equal(got, want), name


@pytest.mark.parametrize("needs_grad", [(True, True, True), (True, False, False), (False, True, False),
                                        (False, False, True), (False, False, False)], ids=str)
@pytest.mark.parametrize("cached", [False, True], ids=["cast", "cached"])
def test_the_fp8_feed_forward_is_its_parts_bit_for_bit(emulated_fp8, cached, needs_grad):
    """Every weight trained or frozen, the input needing its gradient or not: the gradients asked for, the same."""
    fused_feed_forward_matches_its_parts("cpu", cached, needs_grad=needs_grad)


def kept_by_a_recomputed_block(device: str, backend: str = "inductor", **knobs) -> list:
    """The shapes and dtypes of what one block with block recompute saves for its backward pass, beyond its inputs
    and parameters, the random generators' states (uint8) and empty tensors: what it computes and keeps. Compiled
    blocks compile with `backend`: on a CPU, "aot_eager_decomp_partition" splits forward from backward with the
    partitioner inductor uses, without generating C++ (seconds instead of half a minute)."""
    from fastml.executor.model.apply import apply_plan
    from fastml.executor.model.transformer import build_model, materialize, rotary_tables

    torch._dynamo.reset()
    spec = SMALL
    model = apply_plan(build_model(spec), Knobs(recompute=("block",), **knobs))
    if knobs.get("compile") and backend != "inductor":
        for block in model.blocks:
            block.compile(backend=backend)
    block = materialize(model, torch.device(device), torch.bfloat16).blocks[0]
    x = torch.randn(2, 64, spec.hidden_size, dtype=torch.bfloat16, device=device, requires_grad=True)
    cos, sin = rotary_tables(spec, 64, x.device, x.dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = block(x, cos, sin)
    y.float().sum().backward()  # and recomputes what it did not keep
    given = {t.data_ptr() for t in (x, cos, sin, *block.parameters())}
    return [(tuple(t.shape), t.dtype) for t in saved
            if t.numel() and t.data_ptr() not in given and t.dtype != torch.uint8]


@pytest.mark.parametrize("matmul_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_recomputed_block_keeps_only_its_inputs(emulated_fp8, matmul_dtype, compiled):
    """Block recompute saves a block's inputs and nothing it computes, compiled or not, its linears in fp8 or not: the
    planner's activation memory counts just that. Traced by torch.compile 2.11, the fp8 linears' casts and outputs
    were saved (tests/test_gpu_precision.py checks the real fp8 op on a GPU)."""
    assert kept_by_a_recomputed_block("cpu", "aot_eager_decomp_partition", matmul_dtype=matmul_dtype,
                                      compile=compiled) == []
