"""Where a training step's GPU time goes: runs pinned plans on this GPU, traces one step with torch's profiler
(`fastml run --trace-step`, a Perfetto file kept beside the summary) and adds up the step's GPU kernels by kind: the
matmuls, fp8 casts, attention, the optimizer, copies and the rest, with the largest kernels by name. Writes
benchmarks/results/profile_step-<gpu>.json (the default model's) or profile_step-<gpu>-<model>.json; the traces stay
in --out.

    python benchmarks/profile_step.py --model llama-3.1-8b --case bf16 --case fp8 [--steps 4] [--out DIR]
    python benchmarks/profile_step.py --model tinyllama-1.1b --case bf16-mb16 --sequences 32
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from fastml.executor.train import train  # noqa: E402
from fastml.plan import describe_knobs, pinned  # noqa: E402
from fastml.planner.planner import make_plan  # noqa: E402
from record import gpu_tag, write_result  # noqa: E402

SEQ_LEN = 2048
DEFAULT_MODEL = "llama-3.1-8b"
CASES = {
    "bf16": dict(micro_batch_size=1, lm_head_chunks=4, compile=True),
    "fp8": dict(micro_batch_size=1, lm_head_chunks=4, compile=True, matmul_dtype="fp8"),
    # bf16 moments and masters: room for micro-batch 4 without recompute on an H200 (vs_hf.py's best 8B plans)
    "fp8-bf16-state": dict(micro_batch_size=4, lm_head_chunks=4, compile=True, matmul_dtype="fp8",
                           optimizer_dtype="bf16", master_dtype="bf16"),
    "bf16-bf16-state": dict(micro_batch_size=4, lm_head_chunks=4, compile=True, optimizer_dtype="bf16",
                            master_dtype="bf16"),
    # vs_hf.py's best bf16 plan for tinyllama-1.1b (32 sequences a step)
    "bf16-mb16": dict(micro_batch_size=16, compile=True),
}
KINDS = [  # first match wins: (kind, substrings of the kernel's name)
    ("fp8 cast", ("amax_kernel", "cast_kernel")),
    ("optimizer", ("adamw", "multi_tensor", "foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "splitk")),
    ("copy", ("memcpy", "memset", "copy")),
    ("fused elementwise", ("swiglu",)),  # executor/fused.py's Triton kernels
    ("compiled elementwise", ("triton",)),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def summarize(trace: dict) -> dict:
    """GPU time by kind and the 12 largest kernels, in seconds, from a trace in Chrome's format."""
    events = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_kind, by_name = Counter(), Counter()
    for e in events:
        seconds = e.get("dur", 0) / 1e6
        by_kind[kind_of(e["name"])] += seconds
        by_name[e["name"][:120]] += seconds
    start = min((e["ts"] for e in events), default=0)
    end = max((e["ts"] + e.get("dur", 0) for e in events), default=0)
    return {"gpu_busy_s": sum(by_kind.values()), "gpu_span_s": (end - start) / 1e6, "kernels": len(events),
            "by_kind_s": dict(by_kind.most_common()), "largest_kernels_s": dict(by_name.most_common(12))}


def profile(model: str, case: str, steps: int, sequences: int, out: Path) -> dict:
    # Full precision where a case does not lower it: a case that does not fit fails, rather than run in fp8.
    plan = make_plan(model=model, seq_len=SEQ_LEN, global_batch_tokens=sequences * SEQ_LEN, steps=steps, gpus=1,
                     lower_precision=False, overrides=pinned(**CASES[case])).plan
    run_dir = out / f"{model}-{case}"
    summary = train(plan, show_progress=False, run_dir=run_dir, trace_step=steps - 1)
    trace = json.loads((run_dir / "trace.json").read_text())
    return {"knobs": describe_knobs(plan.knobs), "step_time_s": summary["step_time_s"],
            "tokens_per_s": summary["tokens_per_s"], "trace": str(run_dir / "trace.json"), **summarize(trace)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--case", action="append", choices=sorted(CASES), required=True)
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the one before the last is traced")
    parser.add_argument("--sequences", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--out", type=Path, default=None, help="where the runs and traces go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="fastml-profile-"))
    results = {}
    for case in args.case:
        try:
            results[case] = profile(args.model, case, args.steps, args.sequences, out)
        except Exception as e:  # noqa: BLE001: one case's failure (out of memory) is its result
            results[case] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(case, json.dumps(results[case], indent=1), flush=True)
    name = "" if args.model == DEFAULT_MODEL else f"-{args.model}"
    write_result(f"profile_step-{gpu_tag()}{name}.json", {"model": args.model, "seq_len": SEQ_LEN, "cases": results})


if __name__ == "__main__":
    main()
