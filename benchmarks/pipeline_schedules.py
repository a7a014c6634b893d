"""The planner's step for one layout under each pipeline schedule, side by side: benchmarks/results/
pipeline_schedules.json (per schedule: predicted step time, the busiest pipeline rank's bubble, tokens/s a GPU and
peak GPU memory). A prediction, not a measurement: pipelines have not run on GPUs here (issue 27).

    python benchmarks/pipeline_schedules.py

Llama-3.1-70B on 16 nodes of 8 H100s (the shipped profile), tensor 4 x pipeline 4 x data 8, a million tokens a step
of 8,192-token sequences: 16 micro-batches of one sequence per pipeline. The same knobs for every schedule, without
compile (zero bubble cannot go with it), once without recompute and once recomputing every block (where zero bubble
keeps, for each micro-batch awaiting its weights' pass, every linear's input and output gradient all the same).
"""

from __future__ import annotations

from fastml.plan import Knobs
from fastml.planner.hardware import load_machine
from fastml.planner.parallel import layout_step
from fastml.planner.search import Problem, evaluate
from fastml.spec import PRESETS
from record import write_result

SEQ_LEN, GLOBAL_BATCH_TOKENS = 8192, 2**20
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2)]


def predicted(problem: Problem, knobs: Knobs) -> dict:
    candidate = evaluate(problem, knobs)
    step = layout_step(problem.spec, SEQ_LEN, knobs, problem.machine)
    sim = candidate.simulation
    return {"schedule": knobs.pipeline_schedule, "virtual_stages": knobs.virtual_stages,
            "recompute": list(knobs.recompute), "fits_in_memory": candidate.feasible,
            "peak_memory_gib": candidate.memory.gpu_peak / 2**30,
            "step_s": sim.step_time_s if sim else None, "bubble_s": step.bubble_s,
            "tokens_per_s_per_gpu": GLOBAL_BATCH_TOKENS / sim.step_time_s / problem.machine.num_gpus if sim else None}


def main() -> None:
    spec, machine = PRESETS["llama-3.1-70b"], load_machine("h100-sxm", 8, 16)
    problem = Problem(spec, SEQ_LEN, GLOBAL_BATCH_TOKENS, machine)
    rows = []
    for recompute in ((), ("block",)):
        for schedule, virtual in SCHEDULES:
            knobs = Knobs(micro_batch_size=1, grad_accum_steps=16, tensor_parallel=4, sequence_parallel=True,
                          pipeline_parallel=4, pipeline_schedule=schedule, virtual_stages=virtual,
                          shard_optimizer=True, shard_gradients=True, recompute=recompute)
            rows.append(predicted(problem, knobs))
            r = rows[-1]
            print(f"recompute {','.join(recompute) or '-':>5}  {schedule:>16} x{virtual}: "
                  f"bubble {r['bubble_s']:.3f} s, step {r['step_s'] or float('nan'):.3f} s, "
                  f"{r['peak_memory_gib']:.1f} GiB"
                  f"{'' if r['fits_in_memory'] else ' (does not fit)'}")
    path = write_result("pipeline_schedules.json", {
        "model": spec.name, "hardware": f"{machine.num_gpus} x {machine.profile}", "seq_len": SEQ_LEN,
        "global_batch_tokens": GLOBAL_BATCH_TOKENS,
        "layout": {"tensor_parallel": 4, "sequence_parallel": True, "pipeline_parallel": 4, "data_parallel": 8},
        "predicted": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
