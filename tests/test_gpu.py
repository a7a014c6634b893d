"""On a CUDA GPU: bf16 training with fp32 master weights, recompute and compile, and the MFU figure."""

import json
import shutil

import pytest
import torch

from fastml.planner.planner import make_plan
from fastml.executor.train import train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")]


def run(tmp_path, name, pins, steps=30):
    plan = make_plan(seq_len=256, global_batch_tokens=256 * 16, steps=steps, overrides=pinned(pins)).plan
    assert plan.hardware.device == "cuda"
    summary = train(plan, log_json=tmp_path / name, show_progress=False)
    return summary, [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]


def pinned(pins: list[str]) -> list[str]:
    """All searched knobs pinned: the defaults where `pins` says nothing, so the plan is exactly the one named."""
    defaults = {"knobs.recompute": "[]", "knobs.lm_head_chunks": "1", "knobs.compile": "false"}
    named = {p.partition("=")[0] for p in pins}
    return pins + [f"{k}={v}" for k, v in defaults.items() if k not in named]


@pytest.mark.parametrize("pins", [
    ["knobs.micro_batch_size=16"],
    ["knobs.micro_batch_size=4", "knobs.recompute=block", "knobs.lm_head_chunks=4"],
    ["knobs.micro_batch_size=8", "knobs.recompute=swiglu,attention,norm", "knobs.compile=true"],
])
def test_gpu_training_loss_falls(tmp_path, pins):
    summary, records = run(tmp_path, "log.jsonl", pins)
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-10:]) / 10
    assert last <= 0.9 * first, (first, last)
    assert records[-1]["peak_gpu_memory_bytes"] > 0
    if summary["mfu"] is not None:
        assert 0 < summary["mfu"] < 1


def test_recompute_changes_no_math_on_gpu(tmp_path):
    """Same seed, same data: recomputing the block gives the same first loss, bit for bit (same kernels), and
    the same later losses up to the run-to-run noise of flash attention's backward, which is not deterministic."""
    _, plain = run(tmp_path, "a.jsonl", ["knobs.micro_batch_size=4"], steps=4)
    _, recomputed = run(tmp_path, "b.jsonl", ["knobs.micro_batch_size=4", "knobs.recompute=block"], steps=4)
    assert plain[0]["loss"] == recomputed[0]["loss"]
    assert [r["loss"] for r in recomputed] == pytest.approx([r["loss"] for r in plain], rel=1e-3)


def test_resume_on_gpu_restores_the_exact_state(tmp_path):
    """The first step after a resume computes its loss (a forward pass, deterministic) from the restored weights:
    bit-identical to the uninterrupted run's. Later steps go through flash attention's backward pass, which adds
    with atomics and is not deterministic, so they agree only closely."""
    pins = pinned(["knobs.micro_batch_size=4", f"training.checkpoint_dir=\"{tmp_path / 'ck'}\"",
                   "training.checkpoint_interval=2"])
    plan = make_plan(seq_len=256, global_batch_tokens=256 * 8, steps=5, overrides=pins).plan
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
