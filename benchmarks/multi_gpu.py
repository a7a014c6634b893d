"""Training on the GPUs of one machine, through the `fastml` command as a user runs it, side by side in one run:

- `scaling_2_vs_1`: the model with the plan `fastml plan` makes for both GPUs against the plan it makes for one
  (tokens/s; the goal on two H200s with Llama-3.1-8B is 1.9x, and above FSDP2's 13,667 tokens/s, DESIGN.md);
- `memcpy_vs_nccl_no_p2p`: with peer-to-peer access disabled (NCCL_P2P_DISABLE=1: NCCL then goes through host
  memory, as on consumer GPUs, and the planner sees no P2P), fastml's memcpy collectives against NCCL, on the plan
  the planner picks for that topology and on a communication-bound one (ZeRO-3, micro-batch 1): the same knobs but
  `comm` (tokens/s; the goal is 1.3x);
- `layouts_vs_zero3`: tensor parallelism over both GPUs, and a pipeline of both, against ZeRO-3 (tokens/s; the
  planner picks each one's other knobs; issue 28);
- `plans`: every run's knobs, and its predicted beside its measured step time and peak GPU memory (rank 0's).

Each case is `fastml plan` then `fastml run --steps N`, whose launcher starts one worker per GPU. Writes
benchmarks/results/multi_gpu-<machine>.json, merging with what an earlier invocation measured, so that the cases can
run in several calls (`--case`); each case names the commit it ran at.

    python benchmarks/multi_gpu.py [--model llama-3.1-8b] [--steps 12] [--case NAME ...]
    python benchmarks/multi_gpu.py --device cpu --model tiny      # the same cases with CPU processes (a dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from record import RESULTS, _commit, machine_tag, write_result

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # the lent machines' rule
NO_P2P = {"NCCL_P2P_DISABLE": "1"}
ZERO_3 = ["knobs.shard_optimizer=true", "knobs.shard_gradients=true", "knobs.shard_weights=true"]
# name -> (GPUs, environment, `fastml plan` --set pins, the comm to run it with: None for the plan's)
CASES = {
    "1 GPU": (1, {}, [], None),
    "2 GPUs": (2, {}, [], None),
    "no P2P, planned, memcpy": (2, NO_P2P, [], "memcpy"),
    "no P2P, planned, nccl": (2, NO_P2P, [], "nccl"),
    "no P2P, ZeRO-3 mb 1, memcpy": (2, NO_P2P, ZERO_3 + ["knobs.micro_batch_size=1"], "memcpy"),
    "no P2P, ZeRO-3 mb 1, nccl": (2, NO_P2P, ZERO_3 + ["knobs.micro_batch_size=1"], "nccl"),
    "ZeRO-3": (2, {}, ZERO_3, None),
    "TP 2": (2, {}, ["knobs.tensor_parallel=2"], None),
    "PP 2": (2, {}, ["knobs.pipeline_parallel=2"], None),
}


def fastml(args: list[str], env: dict, cwd: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "fastml", *args], cwd=cwd, env={**os.environ, **ENV, **env},
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"fastml {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")


def run_case(name: str, model: str, steps: int, device: str) -> dict:
    gpus, env, pins, comm = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        where = ["--device", device, "--gpus", str(gpus)]
        fastml(["plan", "--model", model, *where, *[a for pin in pins for a in ("--set", pin)], "-o", "plan.json"],
               env, Path(tmp))
        plan = json.loads((Path(tmp) / "plan.json").read_text())
        if comm is not None and plan["knobs"]["comm"] != comm:  # the planner's knobs with the other collectives,
            knobs = {**plan["knobs"], "comm": comm}  # planned again for its prediction
            fastml(["plan", "--model", model, *where, *[a for name, value in knobs.items()
                                                        if name != "grad_accum_steps"
                                                        for a in ("--set", f"knobs.{name}={json.dumps(value)}")],
                    "-o", "plan.json"], env, Path(tmp))
            plan = json.loads((Path(tmp) / "plan.json").read_text())
        fastml(["run", "plan.json", "--steps", str(steps), "--no-progress", "--summary-json", "summary.json"], env,
               Path(tmp))
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    predicted = plan["predicted"]
    return {"git_commit": _commit(), "gpus": gpus, "env": env, "knobs": plan["knobs"],
            "tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"],
            "step_time_s": {"predicted": predicted["step_time_s"], "measured": summary["step_time_s"]},
            "peak_gpu_memory_bytes": {"predicted": predicted["peak_memory_bytes"],
                                      "measured": summary["peak_gpu_memory_bytes"]},
            "first_loss": summary["first_loss"], "last_loss": summary["last_loss"], "steps": summary["steps"]}


def ratio(runs: dict, a: str, b: str) -> float | None:
    return runs[a]["tokens_per_s"] / runs[b]["tokens_per_s"] if a in runs and b in runs else None


def main() -> None:
    parser = argparse.ArgumentParser(description="fastml on several GPUs against one, and memcpy against NCCL")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--case", action="append", choices=list(CASES), help="run only these (repeatable)")
    args = parser.parse_args()
    tag = "cpu" if args.device == "cpu" else machine_tag()
    path = RESULTS / f"multi_gpu-{tag}.json"
    runs = json.loads(path.read_text())["runs"] if path.is_file() else {}
    for name in args.case or CASES:
        print(f"{name} ...", file=sys.stderr, flush=True)
        runs[name] = {"model": args.model, **run_case(name, args.model, args.steps, args.device)}
        print(f"{name}: {runs[name]['tokens_per_s']:,.0f} tokens/s", file=sys.stderr, flush=True)
    planned = [ratio(runs, "no P2P, planned, memcpy", "no P2P, planned, nccl"),
               ratio(runs, "no P2P, ZeRO-3 mb 1, memcpy", "no P2P, ZeRO-3 mb 1, nccl")]
    write_result(path.name, {
        "scaling_2_vs_1": ratio(runs, "2 GPUs", "1 GPU"),
        "memcpy_vs_nccl_no_p2p": {"planned": planned[0], "zero3_micro_batch_1": planned[1]},
        "layouts_vs_zero3": {"tensor_parallel_2": ratio(runs, "TP 2", "ZeRO-3"),
                             "pipeline_parallel_2": ratio(runs, "PP 2", "ZeRO-3")},
        "plans": {name: {k: run[k] for k in ("knobs", "step_time_s", "peak_gpu_memory_bytes")} for name, run in
                  runs.items() if run["gpus"] > 1},
        "runs": runs})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
