"""What `fastml plan` chooses for the layouts issue 28 names: benchmarks/results/layout_choices.json (per request:
the chosen knobs, its predicted tokens/s, step time and peak GPU memory, and the planner's note on why the layout or
data parallelism won). A prediction, not a measurement: layouts have not run on GPUs here (issue 27).

    python benchmarks/layout_choices.py

The requests: Llama-3.1-70B on 16 nodes of 8 H100s and Qwen2.5-72B on 4 nodes, a million tokens a step, and
Llama-3.1-8B on one node (the shipped h100-sxm profile, the default search); then Qwen2.5-72B again with
`--set knobs.pipeline_parallel=2`, a check on the default search.
"""

from __future__ import annotations

from fastml.planner.planner import make_plan
from record import write_result

REQUESTS = [
    {"model": "llama-3.1-70b", "hw": "h100-sxm", "gpus": 8, "nodes": 16, "global_batch_tokens": 2**20},
    {"model": "qwen2.5-72b", "hw": "h100-sxm", "gpus": 8, "nodes": 4, "global_batch_tokens": 2**20},
    {"model": "llama-3.1-8b", "hw": "h100-sxm", "gpus": 8},
    # a check on the default search: the search of one pipeline size should find nothing faster than it chose
    {"model": "qwen2.5-72b", "hw": "h100-sxm", "gpus": 8, "nodes": 4, "global_batch_tokens": 2**20,
     "overrides": ("knobs.pipeline_parallel=2",)},
]
LAYOUT = ("tensor_parallel", "sequence_parallel", "pipeline_parallel", "pipeline_schedule", "virtual_stages")


def chosen(request: dict) -> dict:
    planned = make_plan(**request)
    plan = planned.plan
    knobs = plan.knobs
    layout = knobs.tensor_parallel * knobs.pipeline_parallel > 1
    return {"request": request, "layout": {name: getattr(knobs, name) for name in LAYOUT},
            "kind": ("3D" if knobs.tensor_parallel > 1 and knobs.pipeline_parallel > 1 else "2D") if layout
            else "data parallel",
            "micro_batch_size": knobs.micro_batch_size, "grad_accum_steps": knobs.grad_accum_steps,
            "zero": [name for name in ("shard_optimizer", "shard_gradients", "shard_weights") if getattr(knobs, name)],
            "recompute": list(knobs.recompute), "tokens_per_s": plan.predicted.tokens_per_s,
            "step_time_s": plan.predicted.step_time_s, "peak_gpu_memory_gib": plan.predicted.peak_memory_bytes / 2**30,
            "notes": [n for n in planned.notes if n.startswith(("layout", "data parallel alone"))]}


def main() -> None:
    rows = []
    for request in REQUESTS:
        rows.append(chosen(request))
        row = rows[-1]
        print(f"{request['model']} on {request['gpus'] * request.get('nodes', 1)} GPUs {request.get('overrides', '')}: "
              f"{row['kind']} {row['layout']}, {row['tokens_per_s']:,.0f} tokens/s", flush=True)
    write_result("layout_choices.json", {"choices": rows})


if __name__ == "__main__":
    main()
