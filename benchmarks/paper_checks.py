"""The planner's predictions for published large-scale training runs, beside the published figures:
benchmarks/results/paper_checks.json (a list `checks`, each with its source, model, hardware, layout, the published
and the predicted figure, and the error). The sources and how their figures were read are in benchmarks/NOTES.md
(issue 28, part 0).

    python benchmarks/paper_checks.py

Each run is priced as the planner prices a plan pinned to the published layout (planner/search.py `evaluate`), on
the shipped profile of its GPU. What the sources leave open is filled in here and said in each check's `assumed`.
Megatron-LM's GPT models (learned positions, GELU MLP of 4h) go in as the SwiGLU models fastml knows with the same
FLOPs per token: an FFN of 8h/3 (rounded to a multiple of 128) and as many key-value heads as heads.
"""

from __future__ import annotations

from fastml.plan import Knobs
from fastml.planner.hardware import load_machine
from fastml.planner.parallel import simulate_any
from fastml.planner.search import Problem, evaluate
from fastml.spec import PRESETS, ModelSpec
from record import write_result

KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' "
               "(arXiv 2205.05198), Tables 3 and 5: sequence parallelism with selective recompute")


def gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    ffn = round(8 * hidden / 3 / 128) * 128
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, ffn_hidden_size=ffn, vocab_size=51200)


# (model, GPUs, pipeline stages, chunks a rank, sequences a step, published seconds a step)
MEGATRON_RUNS = [
    (gpt("gpt-22b", 48, 6144, 64), 8, 1, 1, 4, 1.10),
    (gpt("gpt-175b", 96, 12288, 96), 64, 8, 3, 64, 13.75),
    (gpt("gpt-530b", 105, 20480, 128), 280, 35, 3, 280, 37.83),
    (gpt("gpt-1t", 128, 25600, 160), 512, 64, 1, 512, 71.49),
]


def megatron_checks() -> list[dict]:
    checks = []
    for spec, gpus, pipeline, virtual, sequences, published_s in MEGATRON_RUNS:
        machine = load_machine("a100-80gb", 8, gpus // 8)
        micro = 4 if pipeline == 1 else 1
        knobs = Knobs(micro_batch_size=micro, grad_accum_steps=sequences // micro, recompute=("attention",),
                      tensor_parallel=8, sequence_parallel=True, pipeline_parallel=pipeline,
                      pipeline_schedule="interleaved_1f1b" if virtual > 1 else "1f1b", virtual_stages=virtual)
        checks.append(check(KORTHIKANTI, spec, machine, knobs, 2048, sequences * 2048,
                            published={"step_time_s": published_s},
                            assumed="the GPT model as an equal-FLOP SwiGLU model; micro-batch 4 for the 22B and 1 "
                                    "for the others (Table 5); the shipped a100-80gb profile (8 x 200 Gb/s "
                                    "InfiniBand per node, as on Selene)"))
    return checks


def fast_llm_check() -> dict:
    spec = PRESETS["mistral-7b"]
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=1, shard_optimizer=True, shard_gradients=True)
    machine = load_machine("h100-sxm", 8, 4)
    row = check("Fast-LLM README.md (ServiceNow/Fast-LLM): Mistral-7B on 4 nodes of 8 H100s, "
                "examples/mistral.yaml", spec, machine, knobs, 8192, 32 * 8192,
                published={"tokens_per_s_per_gpu": 9800},
                assumed="ZeRO-2, data parallel only, 8,192-token micro-batches, 262,144 tokens a step (the "
                        "example's); its sliding window of 4,096 tokens priced as full attention; the shipped "
                        "h100-sxm profile's network (the README does not state it)")
    return row


def llama3_check() -> dict:
    spec = ModelSpec(name="llama-3.1-405b", num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8,
                     head_dim=128, ffn_hidden_size=53248, vocab_size=128256, rope_theta=500000.0)
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=32, shard_optimizer=True, shard_gradients=True,
                  tensor_parallel=8, sequence_parallel=True, pipeline_parallel=16)
    machine = load_machine("h100-sxm", 8, 1024)
    return check("Llama 3 Herd of Models (arXiv 2407.21783), section 3.3.2, Table 4: 8,192 GPUs", spec, machine,
                 knobs, 8192, 8192 * 32 * 64, published={"mfu": 0.43},
                 assumed="sequence parallelism with tensor parallelism; no recompute; 1F1B with one chunk a rank (the "
                         "paper's interleaving and micro-batch are not given); "
                         "FSDP without resharding priced as ZeRO-2; MFU as fastml counts model FLOPs (the paper's "
                         "convention is not stated); the shipped h100-sxm profile's network (the paper's RoCE "
                         "runs 400 Gb/s a GPU)")


def check(source: str, spec: ModelSpec, machine, knobs: Knobs, seq_len: int, global_batch_tokens: int,
          published: dict, assumed: str) -> dict:
    candidate = evaluate(Problem(spec, seq_len, global_batch_tokens, machine), knobs)
    # priced whether it fits or not: a run the memory model thinks too big is a finding of its own
    step_s = simulate_any(spec, seq_len, knobs, machine).step_time_s
    tokens_per_gpu = global_batch_tokens / step_s / machine.num_gpus
    peak = machine.gpu.peak_flops_for(knobs.matmul_dtype)
    predicted = {"step_time_s": step_s, "tokens_per_s_per_gpu": tokens_per_gpu,
                 "mfu": spec.flops_per_token(seq_len) * tokens_per_gpu / peak}
    figure = next(iter(published))
    # a step time's error read as throughput's: published time over predicted, minus 1
    error = published[figure] / predicted[figure] - 1 if figure == "step_time_s" else \
        predicted[figure] / published[figure] - 1
    layout = {"gpus": machine.num_gpus, "tensor_parallel": knobs.tensor_parallel,
              "sequence_parallel": knobs.sequence_parallel, "pipeline_parallel": knobs.pipeline_parallel,
              "pipeline_schedule": knobs.pipeline_schedule, "virtual_stages": knobs.virtual_stages,
              "data_parallel": machine.num_gpus // (knobs.tensor_parallel * knobs.pipeline_parallel),
              "micro_batch_size": knobs.micro_batch_size, "grad_accum_steps": knobs.grad_accum_steps}
    fits = "" if candidate.feasible else " (does not fit in memory)"
    print(f"{spec.name:>16} on {machine.num_gpus:>5} x {machine.profile}: {figure} published {published[figure]:.4g}, "
          f"predicted {predicted[figure]:.4g} ({error:+.1%} throughput){fits}")
    return {"source": source, "model": spec.name, "hardware": machine.profile, "layout": layout,
            "seq_len": seq_len, "global_batch_tokens": global_batch_tokens, "published": published,
            "predicted": predicted, "fits_in_memory": candidate.feasible,
            "peak_memory_gib": candidate.memory.gpu_peak / 2**30,
            "usable_memory_gib": Problem(spec, seq_len, global_batch_tokens, machine).gpu_budget() / 2**30,
            "throughput_error": error, "assumed": assumed}


def main() -> None:
    checks = megatron_checks() + [fast_llm_check(), llama3_check()]
    errors = [abs(c["throughput_error"]) for c in checks]
    path = write_result("paper_checks.json", {
        "checks": checks, "mean_abs_throughput_error": sum(errors) / len(errors),
        "note": "throughput_error: predicted over published throughput, minus 1 (a step time's as its inverse)"})
    print(f"mean |error| {sum(errors) / len(errors):.1%}; wrote {path}")


if __name__ == "__main__":
    main()
