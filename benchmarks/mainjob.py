"""The main job as a new user meets it: `fastml plan -o plan.json && fastml run plan.json` on a fresh machine (an
empty fastml cache, so the first plan measures this machine as it would there, no flags), the prediction beside the
measurement. Issue 23's goal: the predicted step time within 15% of the measured one, on a CPU and on a GPU.
Each of --repeats fresh machines in a row plans and runs; the one whose prediction over measurement is the median is
written, the others beside it (`repeats`), to benchmarks/results/mainjob-<gpu or cpu>.json.

    python benchmarks/mainjob.py [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import gpu_tag, write_result

SKIPPED_STEPS = 5
"""The first steps warm up (allocator, compilation, first launches): the median of the others is the figure."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3,
                        help="fresh machines in a row (the host's speed wanders between them); the median is the figure")
    args = parser.parse_args()
    repeats = [fresh_machine(args.steps) for _ in range(args.repeats)]
    for figures in repeats:
        print(json.dumps(figures, indent=1))
    median = sorted(repeats, key=lambda f: f["predicted_over_measured"])[len(repeats) // 2]
    write_result(f"mainjob-{gpu_tag()}.json", median | {"repeats": [
        {key: f[key] for key in ("plan_command_s", "knobs", "predicted_step_time_s", "measured_step_time_s",
                                 "predicted_over_measured")} for f in repeats]})


def fresh_machine(steps: int) -> dict:
    """The main job with an empty fastml cache: what a new user's first plan predicts and its run measures."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "FASTML_CACHE": str(work / "cache")}
        fastml = [sys.executable, "-m", "fastml"]
        start = time.perf_counter()
        planned = subprocess.run([*fastml, "plan", "-o", "plan.json"], cwd=work, env=env, capture_output=True,
                                 text=True, check=True)
        plan_s = time.perf_counter() - start
        subprocess.run([*fastml, "run", "plan.json", "--steps", str(steps), "--no-progress", "--log-json",
                        "log.jsonl"], cwd=work, env=env, capture_output=True, check=True)
        plan = json.loads((work / "plan.json").read_text())
        records = [json.loads(line) for line in (work / "log.jsonl").read_text().splitlines()]
    measured = statistics.median(r["step_time_s"] for r in records[SKIPPED_STEPS:])
    predicted = plan["predicted"]["step_time_s"]
    return {"plan_command_s": round(plan_s, 1), "plan_said": planned.stderr.strip().splitlines()[:3],
            "profile": plan["hardware"]["profile"], "knobs": plan["knobs"], "steps": len(records),
            "predicted_step_time_s": predicted, "measured_step_time_s": measured,
            "predicted_over_measured": predicted / measured, "predicted_time_s": plan["predicted"]["time_s"]}

if __name__ == "__main__":
    main()
