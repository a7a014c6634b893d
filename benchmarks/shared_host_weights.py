"""Weights shared in host memory by a node's ranks (knobs.share_host_weights), predicted against measured: Llama-3.1-8B
planned for 2 GPUs of 24 GiB (`fastml plan --gpus 2 --gpu-mem 24GiB`, bf16 matmuls, the rest the planner's), run as
2 ranks on this machine's one GPU (FASTML_TEST_ONE_GPU: each rank under its own 24 GiB cap), with the streamed
weights' host copy shared ("shared") and, with the same knobs otherwise, one copy a rank ("own"). Two ranks on one
GPU share its compute and its PCIe link, so the measured step is slower than the prediction for two GPUs (up to
twice); the host memory is the figure this compares: the node's ranks' proportional set sizes at the end of the run
(shared pages once) against the plan's host total. "own" cannot overlap its CPU step with the next step as "shared"
may (its updated shards are gathered as the step ends). Writes benchmarks/results/shared_host_weights-<gpu>.json.

    python benchmarks/shared_host_weights.py [--runs shared,own] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from record import RESULTS, _commit, gpu_tag, write_result

MODEL, GPUS, CAP = "llama-3.1-8b", 2, "24GiB"
ENV = {"FASTML_TEST_ONE_GPU": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
PLAN_ARGS = ["--model", MODEL, "--hw", "h200", "--gpus", str(GPUS), "--gpu-mem", CAP, "--seq", "2048",
             "--global-batch-tokens", str(2048 * 16), "--lower-precision", "--set", "knobs.matmul_dtype=bf16",
             "--set", "knobs.comm=memcpy"]


def plan_pair(workdir: Path) -> dict[str, Path]:
    """The planner's plan with shared host weights pinned, and the same knobs with a copy a rank."""
    shared = workdir / "shared.plan.json"
    subprocess.run(["fastml", "plan", *PLAN_ARGS, "--set", "knobs.share_host_weights=true", "-o", str(shared)],
                   check=True, stdout=subprocess.DEVNULL)
    # a copy a rank cannot overlap sharded steps: the updated shards are gathered as the step ends
    knobs = json.loads(shared.read_text())["knobs"] | {"share_host_weights": False, "overlap_cpu_step": False}
    own = workdir / "own.plan.json"
    pins = [arg for name, value in knobs.items() if name != "grad_accum_steps"
            for arg in ("--set", f"knobs.{name}={json.dumps(value)}")]
    subprocess.run(["fastml", "plan", *PLAN_ARGS, *pins, "-o", str(own)], check=True, stdout=subprocess.DEVNULL)
    return {"shared": shared, "own": own}


def run_one(name: str, plan_path: Path, steps: int, workdir: Path) -> dict:
    log, summary = workdir / f"{name}.jsonl", workdir / f"{name}.summary.json"
    run = ["fastml", "run", str(plan_path), "--steps", str(steps), "--no-progress", "--log-json", str(log),
           "--summary-json", str(summary), "--gpu-mem", CAP]
    started = time.perf_counter()
    done = subprocess.run(run, capture_output=True, text=True, env={**os.environ, **ENV})
    plan = json.loads(plan_path.read_text())
    predicted = plan["predicted"]
    result = {"name": name, "git_commit": _commit(), "model": MODEL, "knobs": plan["knobs"], "steps": steps,
              "wall_s": round(time.perf_counter() - started, 1), "exit_code": done.returncode,
              "predicted": {"step_time_s": predicted["step_time_s"], "tokens_per_s": predicted["tokens_per_s"],
                            "peak_gpu_memory_bytes": predicted["peak_memory_bytes"],
                            "node_host_memory_bytes": sum(predicted["host_memory_bytes"].values()),
                            "host_memory_by_category": predicted["host_memory_bytes"]}}
    if done.returncode != 0:
        result["error"] = done.stderr.strip().splitlines()[-8:]
        return result
    records = [json.loads(line) for line in log.read_text().splitlines()]
    figures = json.loads(summary.read_text())
    result["measured"] = {"step_time_s": figures["step_time_s"], "tokens_per_s": figures["tokens_per_s"],
                          "peak_gpu_memory_bytes": figures["peak_gpu_memory_bytes"],
                          "node_host_memory_bytes": figures["node_host_memory_bytes"],
                          "rank0_peak_rss_bytes": figures["peak_host_memory_bytes"],
                          "rank0_host_memory_by_category": figures["host_memory_bytes"],
                          "losses": [r["loss"] for r in records]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="shared,own")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    filename = f"shared_host_weights-{gpu_tag()}.json"
    previous = json.loads((RESULTS / filename).read_text()) if (RESULTS / filename).exists() else {}
    runs = {r["name"]: r for r in previous.get("runs", [])}
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"shared-host-weights-{os.getpid()}"
    workdir.mkdir(parents=True)
    plans = plan_pair(workdir)
    for name in args.runs.split(","):
        print(f"{name}: training {args.steps} steps", flush=True)
        runs[name] = run_one(name, plans[name], args.steps, workdir)
        print(json.dumps({k: runs[name].get(k) for k in ("knobs", "predicted", "measured", "error")}), flush=True)
        write_result(filename, summarize(runs))  # after every run: a run cut short keeps the others


def summarize(runs: dict) -> dict:
    """The runs, and where both measured: the node's host memory saved by sharing, measured and predicted."""
    result = {"runs": list(runs.values())}
    shared, own = (runs.get(name, {}) for name in ("shared", "own"))
    if "measured" in shared and "measured" in own:
        result["host_bytes_saved"] = {
            "measured": own["measured"]["node_host_memory_bytes"] - shared["measured"]["node_host_memory_bytes"],
            "predicted": own["predicted"]["node_host_memory_bytes"] - shared["predicted"]["node_host_memory_bytes"]}
        # the same arithmetic: bit for bit on a CPU (tests/test_distributed.py); a GPU's atomics add in any order
        result["loss_max_rel_diff"] = max(abs(a / b - 1) for a, b in zip(shared["measured"]["losses"],
                                                                          own["measured"]["losses"]))
    return result


if __name__ == "__main__":
    main()
