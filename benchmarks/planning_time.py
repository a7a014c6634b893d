"""How long `fastml plan` takes on this machine (the goal: 10 s for one node, 60 s for llama-3.1-70b on 128 nodes
of 8 h100-sxm, on 2 CPU cores). Writes benchmarks/results/planning_time.json.

    python benchmarks/planning_time.py
"""

from __future__ import annotations

import json
import time

from fastml.planner.planner import make_plan
from fastml.planner.request import DEFAULT_TRIALS
from record import write_result

CASES = [
    dict(model="llama-3.1-8b", hw="h200", gpus=1),
    dict(model="llama-2-7b", hw="rtx5060ti-16gb", seq_len=1024),
    dict(model="qwen2.5-32b", hw="rtx4090", gpus=4, host_mem="512GiB"),
    dict(model="qwen2.5-7b", hw="h100-sxm", gpus=8),
    dict(model="llama-3.1-70b", hw="h100-sxm", gpus=8, nodes=128),
]


def main() -> None:
    rows = []
    for case in CASES:
        start = time.perf_counter()
        planned = make_plan(**case)
        seconds = time.perf_counter() - start
        p = planned.plan.predicted
        rows.append({"case": case, "trials": DEFAULT_TRIALS, "planning_time_s": seconds,
                     "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "lower_precision": planned.lower_precision})
        print(f"{json.dumps(case):>90}: {seconds:5.1f} s, {p.tokens_per_s:,.0f} tok/s predicted", flush=True)
    write_result("planning_time.json", {"rows": rows})

if __name__ == "__main__":
    main()
