"""A big model on a small GPU: Llama-3.1-8B under a 16 GiB cap of the H200's memory (`--gpu-mem 16GiB`, the plan
`fastml plan --gpu-mem 16GiB --full-precision` chooses) against the same model uncapped with its best plan, at the
same tokens per optimizer step, in full precision and with the planner's lower-precision choice
(`--lower-precision`); then each offload knob alone and together on a smaller model, predicted against
measured. Each run is its own process, so that its cap, pinned memory and peak figures are its own.
Writes benchmarks/results/memory_cap-<gpu>.json; runs already there are kept unless run again (each names the
commit it ran).

    python benchmarks/memory_cap.py                      # everything
    python benchmarks/memory_cap.py --runs capped,uncapped,capped-lower,uncapped-lower
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from record import RESULTS, _commit, gpu_tag, write_result

BIG = "llama-3.1-8b"
SMALL = "qwen2.5-0.5b"
CAP = "16GiB"
KNOB_RUNS = {  # name -> knobs pinned on the small model (the rest at their defaults), recompute kept as the base
    "small-none": {},
    "small-weights": {"offload_weights": 1.0},
    "small-gradients": {"offload_gradients": 1.0},
    "small-residuals": {"offload_residuals": 1.0},
    "small-master": {"offload_master": 1.0},
    "small-optimizer": {"offload_optimizer": 1.0},
    "small-all": {name: 1.0 for name in ("offload_weights", "offload_gradients", "offload_residuals",
                                         "offload_master", "offload_optimizer")},
}
SMALL_BASE = {"micro_batch_size": 4, "recompute": ["block"]}


BIG_RUNS = {  # name -> (capped, precision flag, pins): the 8B at each precision, under the cap and uncapped
    "capped": (True, "--full-precision", ()), "uncapped": (False, "--full-precision", ()),
    "capped-lower": (True, "--lower-precision", ()), "uncapped-lower": (False, "--lower-precision", ()),
    # the CPU's optimizer step overlapped with the next forward pass (knobs.overlap_cpu_step), pinned
    "capped-overlap": (True, "--full-precision", ("--set", "knobs.overlap_cpu_step=true")),
    "capped-lower-overlap": (True, "--lower-precision", ("--set", "knobs.overlap_cpu_step=true")),
    # the blocks' bf16 weights kept in host memory beside their fp32 masters (knobs.stream_masters pinned off)
    "capped-weights-copy": (True, "--full-precision", ("--set", "knobs.stream_masters=false")),
}


def plan_command(name: str, path: Path) -> list[str]:
    if name in BIG_RUNS:
        capped, precision, pins = BIG_RUNS[name]
        cap = ["--gpu-mem", CAP] if capped else []
        return ["fastml", "plan", "--model", BIG, "--gpus", "1", *cap, precision, *pins, "-o", str(path)]
    from fastml.plan import pinned
    sets = [arg for s in pinned(**SMALL_BASE, **KNOB_RUNS[name]) for arg in ("--set", s)]
    return ["fastml", "plan", "--model", SMALL, "--gpus", "1", "--full-precision", *sets, "-o", str(path)]


def run_one(name: str, steps: int, workdir: Path) -> dict:
    """Plans and trains one run in child processes; returns the plan's knobs and predictions beside what the run
    measured."""
    plan_path, log = workdir / f"{name}.plan.json", workdir / f"{name}.jsonl"
    subprocess.run(plan_command(name, plan_path), check=True, stdout=subprocess.DEVNULL)
    run = ["fastml", "run", str(plan_path), "--steps", str(steps), "--no-progress", "--log-json", str(log)]
    if BIG_RUNS.get(name, (False,))[0]:
        run += ["--gpu-mem", CAP]
    started = time.perf_counter()
    done = subprocess.run(run, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    plan = json.loads(plan_path.read_text())
    predicted = plan["predicted"]
    result = {"name": name, "git_commit": _commit(), "model": plan["model"]["name"], "knobs": plan["knobs"],
              "steps": steps,
              "wall_s": round(wall_s, 1), "exit_code": done.returncode,
              "predicted": {"step_time_s": predicted["step_time_s"], "tokens_per_s": predicted["tokens_per_s"],
                            "peak_gpu_memory_bytes": predicted["peak_memory_bytes"],
                            "gpu_memory_bytes": predicted["memory_bytes"],
                            "host_memory_bytes": sum(predicted["host_memory_bytes"].values()),
                            "host_memory_by_category": predicted["host_memory_bytes"]}}
    if done.returncode != 0:
        result["error"] = done.stderr.strip().splitlines()[-5:]
        return result
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steady = sorted(r["step_time_s"] for r in records[1:]) or [records[0]["step_time_s"]]
    step_time_s = steady[len(steady) // 2]
    last = records[-1]  # memory by category: the run's peaks, as measured up to its last step
    result["measured"] = {"step_time_s": step_time_s,
                          "tokens_per_s": plan["training"]["global_batch_tokens"] / step_time_s,
                          "peak_gpu_memory_bytes": last["peak_gpu_memory_bytes"],
                          "gpu_memory_bytes": last["memory_bytes"],
                          "host_memory_bytes": sum(v or 0 for v in last["host_memory_bytes"].values()),
                          "host_memory_by_category": last["host_memory_bytes"],
                          "losses": [r["loss"] for r in records]}
    result["stderr_tail"] = done.stderr.strip().splitlines()[-25:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join([*BIG_RUNS, *KNOB_RUNS]))
    parser.add_argument("--steps", type=int, default=20, help="steps of the 8B runs (default: 20)")
    parser.add_argument("--small-steps", type=int, default=8)
    args = parser.parse_args()
    filename = f"memory_cap-{gpu_tag()}.json"
    previous = json.loads((RESULTS / filename).read_text()) if (RESULTS / filename).exists() else {}
    runs = {r["name"]: r for r in previous.get("plans", [])}
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"memory-cap-{os.getpid()}"
    workdir.mkdir(parents=True)
    for name in args.runs.split(","):
        steps = args.steps if name in BIG_RUNS else args.small_steps
        print(f"{name}: planning and training {steps} steps", flush=True)
        runs[name] = run_one(name, steps, workdir)
        print(json.dumps({k: runs[name].get(k) for k in ("knobs", "predicted", "measured", "error")}), flush=True)
        path = write_result(filename, figures(runs))  # after every run: a run cut short keeps the others
    print(f"wrote {path}", file=sys.stderr)


def figures(runs: dict) -> dict:
    """The runs, and for each precision whose capped and uncapped runs both measured, their tokens/s and ratio."""
    result = {"plans": list(runs.values())}
    for precision, suffix in (("full", ""), ("lower", "-lower")):
        capped = runs.get(f"capped{suffix}", {}).get("measured")
        uncapped = runs.get(f"uncapped{suffix}", {}).get("measured")
        if capped and uncapped:
            result.update({f"capped_tokens_per_s_{precision}": capped["tokens_per_s"],
                           f"uncapped_tokens_per_s_{precision}": uncapped["tokens_per_s"],
                           f"capped_vs_uncapped_{precision}": capped["tokens_per_s"] / uncapped["tokens_per_s"],
                           f"capped_peak_gpu_memory_bytes_{precision}": capped["peak_gpu_memory_bytes"]})
    return result


if __name__ == "__main__":
    main()
