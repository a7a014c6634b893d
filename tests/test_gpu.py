"""On a CUDA GPU: bf16 training with fp32 master weights, recompute and compile, and the MFU figure."""

import contextlib
import json
import shutil

import pytest
import torch

from fastml.plan import pinned
from fastml.planner.planner import make_plan
from fastml.executor.loop.build import build_training_model
from fastml.executor.memory.optim import AdamW
from fastml.executor.loop.train import train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")]


def gpu_plan(steps, sequences=16, training=(), **knobs):
    """The plan with exactly these knobs (every other searched knob at its default), on one GPU of this machine."""
    plan = make_plan(seq_len=256, global_batch_tokens=256 * sequences, steps=steps, gpus=1,
                     overrides=pinned(**knobs) + list(training)).plan
    assert plan.hardware.device == "cuda"
    return plan


def run(tmp_path, name, steps=30, **knobs):
    summary = train(gpu_plan(steps, **knobs), log_json=tmp_path / name, show_progress=False)
    return summary, [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]


@pytest.mark.parametrize("knobs", [
    dict(micro_batch_size=16),
    dict(micro_batch_size=4, recompute=("block",), lm_head_chunks=4),
    dict(micro_batch_size=8, recompute=("ffn", "attention", "norm"), compile=True),
])
def test_gpu_training_loss_falls(tmp_path, knobs):
    summary, records = run(tmp_path, "log.jsonl", **knobs)
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-10:]) / 10
    assert last <= 0.9 * first, (first, last)
    assert records[-1]["peak_gpu_memory_bytes"] > 0
    if summary["mfu"] is not None:
        assert 0 < summary["mfu"] < 1


def test_bf16_training_keeps_fp32_masters_in_the_optimizer_state():
    plan = gpu_plan(1, micro_batch_size=4)
    assert (plan.knobs.param_dtype, plan.knobs.master_dtype, plan.knobs.optimizer_dtype) == ("bf16", "fp32", "fp32")
    model = build_training_model(plan, torch.device("cuda"))
    optimizer = AdamW(model, plan.training, plan.knobs, model.placement)
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and p.is_cuda
        state = optimizer.state[p]
        assert state["master"].dtype == torch.float32 and state["master"].is_cuda
        assert torch.equal(state["master"].to(torch.bfloat16), p)
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        p.grad = torch.randn_like(p)
    optimizer.set_lr(1e-3)
    optimizer.step()  # fused on the GPU: the parameters receive the rounded masters
    for p in model.parameters():
        assert torch.equal(optimizer.state[p]["master"].to(torch.bfloat16), p)
        assert optimizer.state[p]["step"].is_cuda and optimizer.state[p]["step"] == 1


def test_recompute_changes_no_math_on_gpu(tmp_path):
    """Same seed, same data: recomputing the block gives the same first loss, bit for bit (same kernels), and
    the same later losses up to the run-to-run noise of flash attention's backward, which is not deterministic."""
    _, plain = run(tmp_path, "a.jsonl", steps=4, micro_batch_size=4)
    _, recomputed = run(tmp_path, "b.jsonl", steps=4, micro_batch_size=4, recompute=("block",))
    assert plain[0]["loss"] == recomputed[0]["loss"]
    assert [r["loss"] for r in recomputed] == pytest.approx([r["loss"] for r in plain], rel=1e-3)


def test_resume_on_gpu_restores_the_exact_state(tmp_path):
    """The first step after a resume computes its loss (a forward pass, deterministic) from the restored weights:
    bit-identical to the uninterrupted run's. Later steps go through flash attention's backward pass, which adds
    with atomics and is not deterministic, so they agree only closely."""
    plan = gpu_plan(5, sequences=8, micro_batch_size=4,
                    training=[f"training.checkpoint_dir=\"{tmp_path / 'ck'}\"", "training.checkpoint_interval=2"])
    train(plan, log_json=tmp_path / "whole.jsonl", show_progress=False)
    for extra in (tmp_path / "ck").iterdir():
        if extra.name != "step-00000002":
            shutil.rmtree(extra)
    train(plan, log_json=tmp_path / "resumed.jsonl", show_progress=False, resume=True)
    whole = [json.loads(line)["loss"] for line in (tmp_path / "whole.jsonl").read_text().splitlines()]
    resumed = [json.loads(line)["loss"] for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert len(resumed) == 3
    assert resumed[0] == whole[2]
    assert resumed == pytest.approx(whole[2:], rel=1e-2)


@contextlib.contextmanager
def deterministic():
    """Runs that repeat bit for bit: attention through the math backend (flash attention's backward adds with
    atomics) and torch's deterministic kernels elsewhere."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(False)


OFFLOAD_BASE = dict(micro_batch_size=4, recompute=("block",))  # 16 sequences: 4 micro-batches a step


def offload_losses(tmp_path, name, **knobs):
    with deterministic():
        _, records = run(tmp_path, name, steps=4, **OFFLOAD_BASE, **knobs)
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def no_offload_losses(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("no-offload")
    losses = offload_losses(tmp_path, "a.jsonl")
    assert offload_losses(tmp_path, "b.jsonl") == losses  # else the comparisons below would mean nothing
    return losses


@pytest.mark.parametrize("knobs", [
    dict(offload_weights=1.0), dict(offload_gradients=1.0), dict(offload_residuals=1.0), dict(offload_master=1.0),
    dict(offload_weights=0.5, offload_gradients=0.5, offload_residuals=0.5, offload_master=0.5),
    dict(offload_weights=1.0, offload_gradients=1.0, offload_residuals=1.0, offload_master=1.0),
])
def test_offload_that_only_moves_tensors_changes_no_loss_on_gpu(tmp_path, no_offload_losses, knobs):
    """Copies on side streams change nothing of the arithmetic: the same losses, bit for bit."""
    assert offload_losses(tmp_path, "offload.jsonl", **knobs) == no_offload_losses


@pytest.mark.parametrize("recompute", [(), ("ffn", "norm")])
def test_streamed_weights_and_offloaded_inputs_without_block_recompute(tmp_path, recompute):
    """Without block recompute autograd saves the streamed weights (and views of them) and tensors that share the
    offloaded block input's storage: the weights are rebuilt from the copy fetched for backward, the input's storage
    refilled, and the losses do not change."""
    def losses(name, **knobs):
        with deterministic():
            _, records = run(tmp_path, name, steps=4, micro_batch_size=4, recompute=recompute, **knobs)
        return [r["loss"] for r in records]
    assert losses("offload.jsonl", offload_weights=1.0, offload_residuals=1.0, offload_gradients=0.5) == \
        losses("plain.jsonl")


def test_offloaded_optimizer_steps_on_the_cpu_within_rounding(tmp_path, no_offload_losses):
    """The C++ AdamW on the CPU: the same formula in another order of operations, so the fp32 masters differ in
    their last bits and a bf16 weight now and then rounds the other way."""
    losses = offload_losses(tmp_path, "cpu-adam.jsonl", offload_optimizer=1.0, offload_weights=1.0,
                            offload_gradients=1.0, offload_master=1.0)
    assert losses[0] == no_offload_losses[0]
    assert losses == pytest.approx(no_offload_losses, rel=2e-3)


@pytest.mark.parametrize("knobs", [
    dict(offload_optimizer=1.0),  # resident weights: the CPU's results come back through the staging stream
    dict(offload_optimizer=0.5, offload_weights=0.5, offload_gradients=0.5),
    dict(offload_optimizer=1.0, offload_weights=1.0, offload_gradients=1.0, offload_master=1.0,
         offload_residuals=1.0),
    dict(offload_optimizer=1.0, offload_weights=0.75, offload_gradients=1.0, optimizer_dtype="bf16",
         master_dtype="bf16"),
])
def test_the_overlapped_cpu_step_changes_no_loss_on_gpu(tmp_path, knobs):
    """knobs.overlap_cpu_step changes when the forward pass waits for the CPU's step, not what either computes: the
    losses of the same plan without it, bit for bit (a forward pass that read a block's weights before its step
    was done would differ)."""
    assert offload_losses(tmp_path, "overlap.jsonl", overlap_cpu_step=True, **knobs) == \
        offload_losses(tmp_path, "plain.jsonl", **knobs)


@pytest.mark.parametrize("knobs", [dict(offload_residuals=1.0), dict(overlap_cpu_step=True)])
def test_streamed_masters_change_no_loss_on_gpu(tmp_path, knobs):
    """knobs.stream_masters: a block's fp32 masters come up to a staging buffer and are rounded to bf16 on the copy
    stream, to nearest as the CPU op rounds them otherwise: the same bits."""
    on_host = dict(offload_optimizer=1.0, offload_weights=1.0, offload_gradients=1.0, offload_master=1.0, **knobs)
    assert offload_losses(tmp_path, "masters.jsonl", stream_masters=True, **on_host) == \
        offload_losses(tmp_path, "plain.jsonl", **on_host)


@pytest.mark.parametrize("knobs", [dict(), dict(offload_optimizer=1.0, offload_master=1.0, stream_masters=True)])
def test_offload_with_compile_trains(tmp_path, knobs):
    """Streamed weights are fresh GPU tensors at every call of a compiled block (with streamed masters, fp32 host
    tensors between its calls): no recompilation error, and the loss falls as it does without offload."""
    summary, records = run(tmp_path, "log.jsonl", steps=20, micro_batch_size=4, recompute=("block",), compile=True,
                           offload_weights=1.0, offload_gradients=1.0, offload_residuals=1.0, **knobs)
    assert sum(r["loss"] for r in records[-5:]) / 5 <= 0.9 * sum(r["loss"] for r in records[:5]) / 5


def test_a_traced_gpu_step_holds_its_kernels(tmp_path):
    """The profiler's trace of a step on the GPU (`trace_step`) holds the GPU's kernels, which `fastml explain
    RUN_DIR --trace` sets beside the simulated step."""
    from fastml.planner.simulate import beside_measured

    train(gpu_plan(3, micro_batch_size=4, compile=True), show_progress=False, run_dir=tmp_path / "run", trace_step=2)
    measured = json.loads((tmp_path / "run" / "trace.json").read_text())
    kernels = [e for e in measured["traceEvents"] if e.get("cat") == "kernel"]
    assert len(kernels) > 20
    both = beside_measured({"traceEvents": []}, measured)["traceEvents"]
    assert any(e.get("cat") == "kernel" and e["pid"] != 0 for e in both)


def test_the_cpu_steps_staging_refuses_a_third_buffer_of_one_dtype_in_a_slice():
    """Two pinned buffers per dtype take turns: a third tensor of one slice would be handed the first's buffer while
    it is still in use. The CPU step stages at most two of a dtype (a gradient and a weight), and a third is refused."""
    from fastml.executor.memory.optim import _Staging

    staging = _Staging(1024)
    staging.begin_slice()
    a, b = (torch.zeros(1024, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert staging.fetch(a).data_ptr() != staging.fetch(b).data_ptr()
    with pytest.raises(RuntimeError, match="the CPU step stages more than 2 torch.bfloat16 tensors of one slice"):
        staging.slot(a)
    staging.begin_slice()
    staging.slot(a)  # a new slice takes turns again


@pytest.mark.parametrize("knobs", [
    dict(offload_weights=1.0, offload_gradients=1.0, offload_residuals=1.0, offload_master=1.0),
    dict(matmul_dtype="fp8", cache_fp8_weights=True),
], ids=["offload", "fp8-cached"])
def test_evaluating_on_gpu_changes_no_step_of_the_training(tmp_path, knobs):
    """The validation loss after every step (forward passes without gradients between the steps: streamed weights
    released, fp8 caches refreshed) leaves the training's losses as a run that evaluates only at the end has them,
    bit for bit."""
    if knobs.get("matmul_dtype") == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs fp8 tensor cores (compute capability 8.9 or later)")
    losses = {}
    for interval in (1, 0):
        with deterministic():
            plan = gpu_plan(4, training=[f"training.eval_interval={interval}"], **OFFLOAD_BASE, **knobs)
            train(plan, log_json=tmp_path / f"{interval}.jsonl", show_progress=False)
        records = [json.loads(line) for line in (tmp_path / f"{interval}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "val_loss" in r] == ([1, 2, 3, 4] if interval else [4])
        losses[interval] = [r["loss"] for r in records]
    assert losses[1] == losses[0]
