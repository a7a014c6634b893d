"""The main job on a CPU, end to end through the `fastml` command: `fastml plan -o p.json` (which measures this CPU
on its first run) and `fastml run p.json --steps 30 --log-json`, for the default tiny model and a few other small
settings; the predicted step time beside the measured steady one (median of the steps after the first). Other
processes may share the CPU: the load average before and after each run is recorded. Writes
benchmarks/results/cpu_plan_vs_measured.json.

    python benchmarks/cpu_plan_vs_measured.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import write_result

from fastml import hwprofiles

# name -> extra `fastml plan` arguments
CASES = {
    "default (tiny, seq 256, 16 sequences)": [],
    "seq 512": ["--seq", "512"],
    "micro-batch 4 pinned (4 accumulation steps)": ["--set", "knobs.micro_batch_size=4"],
    "2 processes (--device cpu --gpus 2)": ["--device", "cpu", "--gpus", "2"],
}


def fastml(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "fastml", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"fastml {' '.join(args)} failed:\n{result.stderr}")
    return result


def run_case(name: str, plan_args: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        fastml("plan", "-o", "p.json", *plan_args, cwd=cwd)
        plan = json.loads((cwd / "p.json").read_text())
        load_before = os.getloadavg()
        fastml("run", "p.json", "--steps", str(steps), "--log-json", "log.jsonl", "--no-progress",
               "--summary-json", "summary.json", cwd=cwd)
        load_after = os.getloadavg()
        step_times = [json.loads(line)["step_time_s"] for line in (cwd / "log.jsonl").read_text().splitlines()]
        summary = json.loads((cwd / "summary.json").read_text())
    predicted = plan["predicted"]["step_time_s"]
    measured = statistics.median(step_times[1:])
    memory = {"predicted_process_bytes": plan["predicted"]["peak_memory_bytes"] +
              sum(plan["predicted"]["host_memory_bytes"].values()) // plan["hardware"]["gpus_per_node"],
              "measured_peak_rss_bytes": summary["peak_host_memory_bytes"]}
    row = {"case": name, "plan_args": plan_args, "knobs": plan["knobs"], "predicted_step_time_s": predicted,
           "predicted_time_s": plan["predicted"]["time_s"], "measured_step_time_s": measured,
           "measured_fastest_step_s": min(step_times[1:]), "ratio_predicted_over_measured": predicted / measured,
           "host_memory_of_a_process": memory,
           "load_average_1_5_15_min": {"before_run": load_before, "after_run": load_after}}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rows = [run_case(name, plan_args, args.steps) for name, plan_args in CASES.items()]
    cpu = hwprofiles.this_cpu()
    write_result("cpu_plan_vs_measured.json", {
        "cpu_profile": {"key": cpu.key, "date": cpu.date, "peak_fp32_flops_per_s": cpu.peak_fp32_flops_per_s,
                        "memory_bytes_per_s": cpu.memory_bytes_per_s, "cache": str(hwprofiles.cpu_cache_path())},
        "goal": "ratio_predicted_over_measured within 0.5-2", "rows": rows})
    for r in rows:
        print(f"{r['case']:45s} predicted {r['predicted_step_time_s']:.3f} s  measured "
              f"{r['measured_step_time_s']:.3f} s  ratio {r['ratio_predicted_over_measured']:.2f}")


if __name__ == "__main__":
    main()
