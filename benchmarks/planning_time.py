"""How long `fastml plan` takes here, end to end (process start to plan written), and how good its choice is.

Issue 23's goals, on the 2-core machine: 3 s for `--hw h200 --model llama-3.1-8b` (one node), 20 s for
`--hw h100-sxm --gpus 8 --nodes 128 --model llama-3.1-70b` (1,024 GPUs). Each command runs RUNS times (a shared
machine's speed varies from run to run; the median is the figure). The choice is scored against a search of
REFERENCE_TRIALS trials: the default search's fastest plan over the reference's fastest (predicted tokens/s), which
should be at least 0.99. Writes benchmarks/results/planning_time.json.

    python benchmarks/planning_time.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from record import write_result

from fastml import hwprofiles
from fastml.planner.planner import make_plan
from fastml.planner.request import DEFAULT_TRIALS

CASES = [
    ({"hw": "h200", "model": "llama-3.1-8b"}, 3.0),
    ({"hw": "h100-sxm", "gpus": 8, "nodes": 128, "model": "llama-3.1-70b"}, 20.0),
]
RUNS = 5
REFERENCE_TRIALS = 1000


def main() -> None:
    rows = []
    for case, goal_s in CASES:
        args = [a for name, value in case.items() for a in (f"--{name}", str(value))]
        runs_s = [_timed_plan(args) for _ in range(RUNS)]
        fastest = _fastest(make_plan(**case))
        reference = _fastest(make_plan(**case, trials=REFERENCE_TRIALS))
        rows.append({"command": "fastml plan " + " ".join(args), "runs_s": runs_s,
                     "median_s": statistics.median(runs_s), "goal_s": goal_s, "trials": DEFAULT_TRIALS,
                     "fastest_tokens_per_s": fastest, "reference_trials": REFERENCE_TRIALS,
                     "reference_tokens_per_s": reference, "choice_vs_reference": fastest / reference})
        print(f"{rows[-1]['command']}: median {rows[-1]['median_s']:.2f} s (goal {goal_s} s) of "
              f"{', '.join(f'{s:.2f}' for s in runs_s)}; fastest plan {fastest / reference:.4f} of the "
              f"{REFERENCE_TRIALS}-trial search's", flush=True)
    write_result("planning_time.json", {"cases": rows, "cpu": hwprofiles.cpu_model(),
                                        "cpus": len(os.sched_getaffinity(0)), "load_average": os.getloadavg()})


def _timed_plan(args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fastml", "plan", *args, "-o", os.path.join(tmp, "plan.json")],
                       check=True, capture_output=True)
        return time.perf_counter() - start


def _fastest(planned) -> float:
    """The fastest predicted tokens/s of the plans a search returns (its choice may be a leaner one within 2%)."""
    return max(p.predicted.tokens_per_s for p in [planned.plan, *planned.runners_up])


if __name__ == "__main__":
    main()
