"""Re-predicts the rows of a plan_vs_measured result with the current profiles (after a profile changed), and
writes the new errors beside the old ones: benchmarks/results/plan_vs_measured-<gpu>-repredicted.json.

    python benchmarks/repredict.py benchmarks/results/plan_vs_measured-h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastml import hwprofiles
from fastml.config import from_dict
from fastml.plan import Knobs
from fastml.planner.hardware import load_machine
from fastml.planner.search import Problem, evaluate
from fastml.spec import PRESETS
from record import write_result

SEQ_LEN = 2048


def main(path: str) -> None:
    measured = json.loads(Path(path).read_text())
    machine = load_machine(hwprofiles.for_device_name(measured["machine"].split(",")[0]), 1)
    rows = []
    for row in measured["rows"]:
        knobs = from_dict(Knobs, row["knobs"], "knobs")
        tokens = knobs.micro_batch_size * knobs.grad_accum_steps * SEQ_LEN
        candidate = evaluate(Problem(PRESETS[row["shape"]], SEQ_LEN, tokens, machine), knobs)
        step, peak = candidate.simulation.step_time_s, candidate.memory.gpu_peak
        rows.append({"shape": row["shape"], "pins": row["pins"], "measured": row["measured"],
                     "predicted_before": row["predicted"], "predicted_now": {"step_time_s": step,
                                                                              "peak_memory_bytes": peak},
                     "step_time_error_before": row["step_time_error"],
                     "step_time_error_now": step / row["measured"]["step_time_s"] - 1,
                     "peak_memory_error_now": peak / row["measured"]["peak_memory_bytes"] - 1})
        print(f"{row['shape']:>16} {str(row['pins'] or 'planner')[:60]:>60}: step time "
              f"{row['step_time_error']:+.1%} -> {rows[-1]['step_time_error_now']:+.1%}, peak memory "
              f"{rows[-1]['peak_memory_error_now']:+.1%}")
    write_result(Path(path).stem + "-repredicted.json", {"measured_in": path, "rows": rows},
                 machine="CPU re-prediction of " + measured["machine"] + " measurements")

if __name__ == "__main__":
    main(sys.argv[1])
