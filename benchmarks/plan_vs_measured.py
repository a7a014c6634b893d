"""The planner's prediction next to a real run, on this machine: for each shape, the plan `fastml plan` picks
(knobs the executor runs) and a few pinned alternatives, each trained for a few steps. Writes
benchmarks/results/plan_vs_measured-<gpu>.json.

    python benchmarks/plan_vs_measured.py --steps 6
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from record import gpu_tag, write_result

from fastml.executor.loop.train import train
from fastml.plan import pinned
from fastml.planner.planner import make_plan

SEQ_LEN = 2048
# shape -> (sequences per step, knob sets to run besides the planner's own choice: `pinned` sets the other knobs)
CASES = {
    "tinyllama-1.1b": (32, [dict(micro_batch_size=8)]),
    "llama-3.1-8b": (16, [dict(micro_batch_size=1, lm_head_chunks=4, compile=True),
                          dict(micro_batch_size=4, recompute=("block",), lm_head_chunks=8, compile=True)]),
}


def run_case(shape: str, sequences: int, knobs: dict | None, steps: int) -> dict:
    """The planner's own plan where `knobs` is None, else the plan with exactly these knobs."""
    plan = make_plan(model=shape, seq_len=SEQ_LEN, global_batch_tokens=sequences * SEQ_LEN, steps=steps, gpus=1,
                     overrides=[] if knobs is None else pinned(**knobs), trials=200).plan
    try:
        summary = train(plan, show_progress=False)
        measured = {"step_time_s": summary["step_time_s"], "peak_memory_bytes": summary["peak_gpu_memory_bytes"]}
    except torch.cuda.OutOfMemoryError as e:
        measured = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    gc.collect()
    torch.cuda.empty_cache()
    p = plan.predicted
    row = {"shape": shape, "pins": knobs, "knobs": json.loads(plan.to_json())["knobs"],
           "predicted": {"step_time_s": p.step_time_s, "peak_memory_bytes": p.peak_memory_bytes, "time_s": p.time_s},
           "measured": measured}
    if "error" not in measured:
        row["step_time_error"] = p.step_time_s / measured["step_time_s"] - 1
        row["peak_memory_error"] = p.peak_memory_bytes / measured["peak_memory_bytes"] - 1
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = [run_case(shape, sequences, knobs, args.steps)
            for shape, (sequences, alternatives) in CASES.items() for knobs in [None, *alternatives]]
    write_result(f"plan_vs_measured-{gpu_tag()}.json", {"rows": rows})
    for r in rows:
        if "step_time_error" in r:
            print(f"{r['shape']:>16} {str(r['pins'] or 'planner'):>60}: step time {r['step_time_error']:+.1%}, "
                  f"peak memory {r['peak_memory_error']:+.1%}")


if __name__ == "__main__":
    main()
