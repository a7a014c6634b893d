"""The training loop in-process: deterministic on a CPU, optimizer math, schedule."""

import json

import pytest
import torch

from fastml.plan import Training
from fastml.planner.planner import make_plan
from fastml.executor.optim import AdamW, lr_at
from fastml.executor.train import train


# CPU training in fp32, said by the plan (older CPU plans say bf16 parameters and matmuls).
FP32 = ["knobs.param_dtype=fp32", "knobs.matmul_dtype=fp32"]


def losses(tmp_path, name, overrides=()):
    plan = make_plan(seq_len=64, global_batch_tokens=64 * 4, steps=3, device="cpu",
                     overrides=FP32 + list(overrides)).plan
    train(plan, log_json=tmp_path / name, show_progress=False)
    return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]


def test_cpu_training_is_deterministic(tmp_path):
    a = losses(tmp_path, "a.jsonl")
    assert a == losses(tmp_path, "b.jsonl")
    assert a != losses(tmp_path, "c.jsonl", overrides=["training.seed=1"])


def test_accumulation_matches_one_big_micro_batch(tmp_path):
    whole = losses(tmp_path, "a.jsonl", overrides=["knobs.micro_batch_size=4"])
    split = losses(tmp_path, "b.jsonl", overrides=["knobs.micro_batch_size=1"])
    assert whole[0] == pytest.approx(split[0], rel=1e-5)
    assert whole == pytest.approx(split, rel=1e-4)


# The losses of 6 steps of the tiny model on a CPU (micro-batch 4 x accumulation 2, fp32), recorded at b31c843.
# A change that does not change the math (a refactor of the executor, recompute) must leave them bit-identical.
PINNED_LOSSES = [6.1043701171875, 5.603823661804199, 4.802225112915039, 4.742988586425781, 4.496884346008301,
                 4.411572456359863]


@pytest.mark.parametrize("recompute", ["[]", '["block"]'])
def test_cpu_losses_are_the_pinned_ones(tmp_path, recompute):
    pins = FP32 + ["knobs.micro_batch_size=4", f"knobs.recompute={recompute}"]
    plan = make_plan(seq_len=64, global_batch_tokens=64 * 8, steps=6, device="cpu", overrides=pins).plan
    assert (plan.knobs.grad_accum_steps, plan.knobs.recompute) == (2, () if recompute == "[]" else ("block",))
    train(plan, log_json=tmp_path / "log.jsonl", show_progress=False)
    assert [json.loads(line)["loss"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == PINNED_LOSSES


def test_schedule_warms_up_then_decays_to_the_floor():
    t = Training(steps=101, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.55)  # halfway through the decay: halfway between lr and the floor
    assert lr_at(100, t) == pytest.approx(0.1)  # the last step
    assert all(lr_at(s, t) >= lr_at(s + 1, t) for s in range(10, 100))


def test_master_weights_step_like_fp32_adamw():
    """bf16 parameters stepped through fp32 masters equal fp32 AdamW rounded to bf16, and the masters keep the
    precision that bf16 parameters alone would lose."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(64, 64, bias=True)
    model = torch.nn.Linear(64, 64, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(model.weight.float())
        reference.bias.copy_(model.bias.float())
    t = Training(lr=1e-2, weight_decay=0.1)
    ours = AdamW(model, t)
    theirs = torch.optim.AdamW([{"params": [reference.weight], "weight_decay": 0.1},
                                {"params": [reference.bias], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
    for _ in range(5):
        grad_w, grad_b = torch.randn(64, 64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
        model.weight.grad, model.bias.grad = grad_w.clone(), grad_b.clone()
        reference.weight.grad, reference.bias.grad = grad_w.float(), grad_b.float()
        ours.set_lr(1e-2)
        ours.step()
        ours.zero_grad()
        theirs.step()
    assert torch.equal(ours.state[model.weight]["master"], reference.weight.detach())
    assert torch.equal(model.weight, reference.weight.detach().to(torch.bfloat16))
    assert model.weight.grad is None
