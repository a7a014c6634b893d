"""fastml's planner on LLMQ's own published cases (issue 26): for each machine, model and precision LLMQ reports
(benchmarks/data/llmq_published.json, from IST-DASLab/llmq at b77d969: seq 1,024, 524,288 tokens a step, bf16
weights and Adam state), the plan fastml makes for that machine's shipped profile and the tokens/s it predicts,
beside LLMQ's measured figure. Planning only, on any machine. Writes benchmarks/results/llmq_cases.json: a list
`cases` ({machine, profile, gpus, model, precision, llmq_tokens_per_s, predicted_tokens_per_s, ratio, knobs,
limit}, or the reason no plan fits), the geometric mean of the ratios, and the headline, Qwen2.5-32B on 4 x RTX
4090 in bf16 (issue 26's goals: a geometric mean >= 1.0, the 32B >= 2,200 tokens/s).

    python benchmarks/llmq_cases.py [--trials N]

A case's precision is its matmuls': "bf16" pins knobs.matmul_dtype bf16, "fp8" pins fp8; both may keep bf16
optimizer state and masters, as LLMQ does (--lower-precision).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from record import write_result

from fastml.config import UserError
from fastml.plan import describe_knobs
from fastml.planner.planner import NoFeasiblePlan, make_plan
from fastml.planner.request import DEFAULT_TRIALS

PUBLISHED = Path(__file__).resolve().parent / "data" / "llmq_published.json"
SEQ_LEN, GLOBAL_BATCH_TOKENS = 1024, 524_288
MACHINES = {"rtx4090x1": ("rtx4090", 1, None), "rtx4090x4": ("rtx4090", 4, "500GB"),
            "rtx5060ti16x1": ("rtx5060ti-16gb", 1, None), "h100x1": ("h100-sxm", 1, None),
            "h100x8": ("h100-sxm", 8, None)}
"""LLMQ's machine names -> (fastml's shipped profile, GPUs, host memory where LLMQ says it: its 4 x RTX 4090 box
has 500 GB, where its baseline ran out of memory; else the profile's)."""
HEADLINE = ("rtx4090x4", "qwen2.5-32b", "bf16")


def published_cases(data: dict) -> list[tuple[str, str, str, float]]:
    """(machine, model, precision, LLMQ's tokens/s) of every figure LLMQ measured in `data` (the published file),
    not its baselines or notes."""
    return [(machine, model, precision, float(value))
            for machine, models in data.items() if machine in MACHINES
            for model, figures in models.items()
            for precision, value in figures.items() if precision in ("bf16", "fp8")]


def planned(profile: str, gpus: int, host_mem: str | None, model: str, precision: str, trials: int) -> dict:
    try:
        p = make_plan(model=model, hw=profile, gpus=gpus, host_mem=host_mem, seq_len=SEQ_LEN,
                      global_batch_tokens=GLOBAL_BATCH_TOKENS, lower_precision=True, trials=trials,
                      overrides=[f"knobs.matmul_dtype={precision}"])
    except (NoFeasiblePlan, UserError) as e:
        return {"error": str(e).splitlines()[0]}
    return {"predicted_tokens_per_s": p.plan.predicted.tokens_per_s, "knobs": describe_knobs(p.plan.knobs),
            "limit": p.limit}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS)
    args = parser.parse_args()
    published, cases = json.loads(PUBLISHED.read_text()), []
    for machine, model, precision, llmq in published_cases(published):
        profile, gpus, host_mem = MACHINES[machine]
        case = {"machine": machine, "profile": profile, "gpus": gpus, "host_mem": host_mem, "model": model,
                "precision": precision, "llmq_tokens_per_s": llmq,
                **planned(profile, gpus, host_mem, model, precision, args.trials)}
        if "predicted_tokens_per_s" in case:
            case["ratio"] = case["predicted_tokens_per_s"] / llmq
        cases.append(case)
        print(f"{machine:14} {model:13} {precision:5} LLMQ {llmq:9,.0f}  fastml "
              f"{case.get('predicted_tokens_per_s', 0):9,.0f}  {case.get('ratio', 0):.2f}x  "
              f"{case.get('knobs') or case.get('error')}", flush=True)
    ratios = [c["ratio"] for c in cases if "ratio" in c]
    headline = next(c for c in cases if (c["machine"], c["model"], c["precision"]) == HEADLINE)
    summary = {"seq_len": SEQ_LEN, "global_batch_tokens": GLOBAL_BATCH_TOKENS, "trials": args.trials,
               "source": published["source"],
               "geometric_mean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
               "cases_planned": len(ratios), "cases": cases,
               "headline": {k: headline.get(k) for k in ("machine", "model", "precision", "llmq_tokens_per_s",
                                                          "predicted_tokens_per_s", "ratio", "knobs")}}
    path = write_result("llmq_cases.json", summary)
    print(f"geometric mean {summary['geometric_mean_ratio']:.2f}x over {len(ratios)} of {len(cases)} cases; "
          f"{HEADLINE[1]} on 4 x RTX 4090 {headline.get('predicted_tokens_per_s', 0):,.0f} tokens/s -> {path}")


if __name__ == "__main__":
    main()
