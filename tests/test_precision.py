"""Lower-precision optimizer state on a CPU: bf16 Adam moments and bf16 master weights (knobs.optimizer_dtype,
knobs.master_dtype), stepped by fastml's op with stochastic rounding. They train close to fp32 state, keep a third
of the optimizer's memory, and resume bit for bit (the rounding's random bits come from the seed, not a generator's
state). tests/test_gpu_precision.py trains with them on a GPU, and with fp8 matmuls, which need one."""

import json

import pytest
import torch

from fastml.plan import Knobs, Plan, Training
from fastml.spec import PRESETS
from fastml.executor.apply import build_training_model
from fastml.executor.optim import AdamW
from fastml.executor.train import train

LOWER = {"optimizer_dtype": "bf16", "master_dtype": "bf16"}


def cpu_plan(steps=12, checkpoint_dir=None, **knobs):
    """bf16 parameters, as on a GPU; two micro-batches a step."""
    training = Training(seq_len=32, global_batch_tokens=32 * 4, steps=steps, lr=3e-3, warmup_steps=2,
                        checkpoint_dir=checkpoint_dir, checkpoint_interval=3 if checkpoint_dir else 0)
    return Plan(model=PRESETS["tiny"], training=training, knobs=Knobs(micro_batch_size=2, grad_accum_steps=2, **knobs))


def run_losses(plan, log, **kwargs):
    train(plan, log_json=log, show_progress=False, **kwargs)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory):
    return run_losses(cpu_plan(), tmp_path_factory.mktemp("fp32") / "log.jsonl")


@pytest.mark.parametrize("knobs", [{"optimizer_dtype": "bf16"}, {"master_dtype": "bf16"}, LOWER],
                         ids=["bf16-moments", "bf16-masters", "both"])
def test_bf16_optimizer_state_trains_like_fp32_state(tmp_path, fp32_losses, knobs):
    losses = run_losses(cpu_plan(**knobs), tmp_path / "log.jsonl")
    assert losses[0] == fp32_losses[0]  # before any step
    assert losses[-1] < 0.9 * losses[0]  # it learns
    assert losses[-1] == pytest.approx(fp32_losses[-1], rel=0.02)
    assert losses != fp32_losses  # and it is another arithmetic


def test_bf16_state_keeps_a_third_of_the_optimizer_memory():
    sizes = {}
    for name, knobs in (("fp32", {}), ("bf16", LOWER)):
        plan = cpu_plan(**knobs)
        model = build_training_model(plan, torch.device("cpu"))
        optimizer = AdamW(model, plan.training, plan.knobs)
        sizes[name] = sum(t.nbytes for t in optimizer.state_tensors().values() if t.ndim > 0)
    # fp32: master 4 + m 4 + v 4 bytes a parameter; bf16: m 2 + v 2 (the bf16 weights are the masters)
    assert sizes["bf16"] * 3 == sizes["fp32"]


def test_bf16_state_resumes_bit_for_bit(tmp_path):
    whole = run_losses(cpu_plan(steps=8, checkpoint_dir=str(tmp_path / "a"), **LOWER), tmp_path / "a.jsonl")
    plan = cpu_plan(steps=8, checkpoint_dir=str(tmp_path / "b"), **LOWER)
    first = run_losses(plan, tmp_path / "b.jsonl", steps=3)  # stops at 3 as a killed run would (the same lrs so far)
    resumed = run_losses(plan, tmp_path / "b.jsonl", resume=True)
    assert first == whole[:3]
    assert resumed == whole
