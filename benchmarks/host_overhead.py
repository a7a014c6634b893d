"""Where a small model's step goes when the GPU waits for the host: the executor's step time over a grid of depths and
micro-batch counts (eager and compiled), fitted as a fixed cost per step, per block of the optimizer, per micro-batch
of the head and per block pass; beside it, the aten ops each block pass dispatches on this device (counted, for the
variants the planner prices). Run on a GPU machine; writes benchmarks/results/host_overhead-<gpu>.json.

    python benchmarks/host_overhead.py
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from record import gpu_tag, write_result

from fastml.hwprofiles.host import fit, op_counter
from fastml.plan import Knobs
from fastml.spec import PRESETS

LAYERS = (2, 8)
MICRO_BATCHES = (1, 4)
STEPS = 40
RECOMPUTE = ((), ("attention",), ("ffn",), ("ffn", "attention"), ("block",))


def pass_ops(spec, recompute: tuple[str, ...], device: str) -> dict[str, int]:
    """The aten ops one block's forward and backward pass dispatch (the backward's include what recompute runs)."""
    from fastml.executor.model.apply import apply_plan
    from fastml.executor.model.transformer import build_model, materialize, rotary_tables

    model = apply_plan(build_model(dataclasses.replace(spec, num_layers=1)), Knobs(recompute=recompute))
    materialize(model, device, torch.bfloat16 if device == "cuda" else torch.float32)
    x = torch.randn(1, 64, spec.hidden_size, device=device, dtype=next(model.parameters()).dtype, requires_grad=True)
    cos, sin = rotary_tables(spec, 64, x.device, x.dtype)
    with op_counter() as forward:
        y = model.blocks[0](x, cos, sin)
    with op_counter() as backward:
        y.sum().backward()
    return {"forward": forward.ops, "backward": backward.ops}


def step_time_s(layers: int, micro_batches: int, compile: bool, workdir: Path) -> dict:
    """The steady step time of the tiny model at this depth, as `fastml run` trains it: micro-batches of one
    sequence."""
    plan, log = workdir / f"plan-{layers}-{micro_batches}-{compile}.json", workdir / "log.jsonl"
    fastml = [sys.executable, "-m", "fastml"]
    subprocess.run([*fastml, "plan", "--set", f"model.num_layers={layers}", "--set", "knobs.micro_batch_size=1",
                    "--set", f"knobs.compile={str(compile).lower()}", "--set", "knobs.lm_head_chunks=1",
                    "--global-batch-tokens", str(256 * micro_batches), "-o", str(plan)], check=True, capture_output=True)
    subprocess.run([*fastml, "run", str(plan), "--steps", str(STEPS), "--no-progress", "--log-json", str(log)],
                   check=True, capture_output=True, cwd=workdir)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    times = sorted(r["step_time_s"] for r in records[STEPS // 4:])
    predicted = json.loads(plan.read_text())["predicted"]["step_time_s"]
    return {"layers": layers, "micro_batches": micro_batches, "compile": compile, "measured_step_time_s":
            times[len(times) // 2], "predicted_step_time_s": predicted}


def main() -> None:
    spec = PRESETS["tiny"]
    counts = {",".join(r) or "none": pass_ops(spec, r, "cuda") for r in RECOMPUTE}
    counts |= {f"{name},none": pass_ops(dataclasses.replace(spec, **{name: True}), (), "cuda")
               for name in ("qkv_bias", "qk_norm")}
    print(json.dumps(counts), flush=True)
    figures = {"pass_ops": counts}
    with tempfile.TemporaryDirectory() as tmp:
        for compile in (False, True):
            rows = [step_time_s(layers, micro, compile, Path(tmp)) for layers in LAYERS for micro in MICRO_BATCHES]
            for row in rows:
                print(json.dumps(row), flush=True)
            fitted = fit([(r["layers"], r["micro_batches"], r["measured_step_time_s"]) for r in rows])
            figures["compiled" if compile else "eager"] = {"runs": rows, "fit": fitted}
            print(json.dumps(figures["compiled" if compile else "eager"]["fit"]), flush=True)
    write_result(f"host_overhead-{gpu_tag()}.json", figures)


if __name__ == "__main__":
    main()
