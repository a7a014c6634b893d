"""Where a training step's GPU time goes: runs pinned plans on this GPU, traces one step with torch's profiler
(`fastml run --trace-step`, a Perfetto file kept beside the summary) and adds up the step's GPU kernels by kind: the
matmuls, fp8 casts, attention, the optimizer, copies and the rest, with the largest kernels by name. Writes
benchmarks/results/profile_step-<gpu>.json (the default model's) or profile_step-<gpu>-<model>.json; the traces stay
in --out.

    python benchmarks/profile_step.py --model llama-3.1-8b --case bf16 --case fp8 [--steps 4] [--out DIR]
    python benchmarks/profile_step.py --model tinyllama-1.1b --case bf16-mb16 --sequences 32
    python benchmarks/profile_step.py --fidelity p-8b-s2048 --fidelity p-3b-s2048-12gib
    python benchmarks/profile_step.py --repredict results/profile_step-h200.json --hw PROFILE  # anywhere

Beside each case's kernel times, the planner's prices of the same step by kind, before calibration
(`predicted_vs_measured`: where the model is off, kind by kind); `--repredict` writes them into an earlier file.
`--fidelity NAME` profiles the plan a fidelity run measured (benchmarks/fidelity.py's results/fidelity-runs-<gpu>.jsonl,
written to profile_step-<gpu>-fidelity.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from fastml.executor.loop.train import train  # noqa: E402
from fastml.plan import describe_knobs, pinned  # noqa: E402
from fastml.planner.planner import make_plan  # noqa: E402
from record import _commit, gpu_tag, write_result  # noqa: E402

SEQ_LEN = 2048
DEFAULT_MODEL = "llama-3.1-8b"
CASES = {
    "bf16": dict(micro_batch_size=1, lm_head_chunks=4, compile=True),
    "fp8": dict(micro_batch_size=1, lm_head_chunks=4, compile=True, matmul_dtype="fp8"),
    # bf16 moments and masters (with their compensation): room for micro-batch 4 without recompute on an H200
    # (vs_hf.py's best 8B plans)
    "fp8-bf16-state": dict(micro_batch_size=4, lm_head_chunks=4, compile=True, matmul_dtype="fp8",
                           optimizer_dtype="bf16", master_dtype="bf16_kahan"),
    # the same with the weights cast to fp8 once a step: vs_hf.py's best fp8 plan
    "fp8-cached-bf16-state": dict(micro_batch_size=4, lm_head_chunks=4, compile=True, matmul_dtype="fp8",
                                  cache_fp8_weights=True, optimizer_dtype="bf16", master_dtype="bf16_kahan"),
    # the same with the backward GEMMs accumulating in the tensor cores' fast mode (knobs.fp8_backward_fast_accum)
    "fp8-cached-fast-accum": dict(micro_batch_size=4, lm_head_chunks=4, compile=True, matmul_dtype="fp8",
                                  cache_fp8_weights=True, optimizer_dtype="bf16", master_dtype="bf16_kahan",
                                  fp8_backward_fast_accum=True),
    "bf16-bf16-state": dict(micro_batch_size=4, lm_head_chunks=4, compile=True, optimizer_dtype="bf16",
                            master_dtype="bf16_kahan"),
    # vs_hf.py's best bf16 plan for tinyllama-1.1b (32 sequences a step)
    "bf16-mb16": dict(micro_batch_size=16, compile=True),
    "bf16-mb32": dict(micro_batch_size=32, compile=True),  # the same tokens in one micro-batch
}
KINDS = [  # first match wins: (kind, substrings of the kernel's name)
    ("fp8 cast", ("quantize_kernel", "amax_kernel", "cast_kernel")),  # the last two: traces before 2026-12
    ("optimizer", ("adamw", "multi_tensor", "foreach")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "splitk")),
    ("copy", ("memcpy", "memset", "copy")),
    ("loss", ("cross_entropy",)),  # executor/model/fused.py's, the LM head's loss
    ("fused elementwise", ("swiglu",)),  # executor/model/fused.py's other Triton kernels
    ("compiled elementwise", ("triton",)),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "other")


def summarize(trace: dict) -> dict:
    """GPU time by kind, the 12 largest kernels and the 4 largest of each kind, in seconds, from a trace in Chrome's
    format."""
    events = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_kind, by_name, in_kind = Counter(), Counter(), {}
    for e in events:
        seconds, kind, name = e.get("dur", 0) / 1e6, kind_of(e["name"]), e["name"][:120]
        by_kind[kind] += seconds
        by_name[name] += seconds
        in_kind.setdefault(kind, Counter())[name] += seconds
    start = min((e["ts"] for e in events), default=0)
    end = max((e["ts"] + e.get("dur", 0) for e in events), default=0)
    return {"gpu_busy_s": sum(by_kind.values()), "gpu_span_s": (end - start) / 1e6, "kernels": len(events),
            "by_kind_s": dict(by_kind.most_common()), "largest_kernels_s": dict(by_name.most_common(12)),
            "largest_of_kind_s": {kind: dict(names.most_common(4)) for kind, names in in_kind.items()}}


def case_plan(model: str, case: str, steps: int, sequences: int, hw: str | None = None):
    # Full precision where a case does not lower it: a case that does not fit fails, rather than run in fp8.
    return make_plan(model=model, seq_len=SEQ_LEN, global_batch_tokens=sequences * SEQ_LEN, steps=steps, gpus=1,
                     lower_precision=False, overrides=pinned(**CASES[case]), hw=hw).plan


def fidelity_plan(name: str, gpu: str | None = None):
    """The plan that benchmarks/fidelity.py's run `name` measured on this kind of GPU, or `gpu` (its last row of that
    name)."""
    from fastml.config import from_dict
    from fastml.plan import Plan

    runs = Path(__file__).parent / "results" / f"fidelity-runs-{gpu or gpu_tag()}.jsonl"
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    row = next((r for r in reversed(rows) if r["name"] == name and "record" in r), None)
    if row is None:
        raise SystemExit(f"{runs} holds no measured run named {name!r}")
    return from_dict(Plan, row["record"]["plan"], name)


def profile(plan, name: str, out: Path) -> dict:
    """Runs `plan` (its own steps) and traces the step before the last: the kernels by kind beside the planner's
    prices."""
    run_dir, steps = out / name, plan.training.steps
    summary = train(plan, show_progress=False, run_dir=run_dir, trace_step=steps - 1)
    trace = json.loads((run_dir / "trace.json").read_text())
    measured = summarize(trace)
    result = {"knobs": describe_knobs(plan.knobs), "step_time_s": summary["step_time_s"],
              "tokens_per_s": summary["tokens_per_s"], "trace": str(run_dir / "trace.json"), **measured}
    try:
        return result | beside_predicted(plan, measured["by_kind_s"])
    except Exception as e:  # noqa: BLE001: the measurement is kept whatever the prediction does
        return result | {"predicted_error": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------------- the planner's prices, by kind

COMPARED = ("matmul", "attention", "fp8 cast", "optimizer")
"""Kinds the planner prices as the trace counts them; the rest of the trace (compiled and fused elementwise
kernels, copies, other) is set against the rest of the prices (the blocks' elementwise work, the loss, the
gradients' accumulation)."""


def beside_predicted(plan, measured_by_kind: dict[str, float], hw: str | None = None) -> dict:
    """The GPU time the planner prices the plan's step at, by kind and before calibration (planned on this machine's
    profile, or `hw`), and each kind's error against the trace's (predicted / measured - 1)."""
    predicted = predicted_by_kind(plan, hw)
    rest = {"measured": sum(s for k, s in measured_by_kind.items() if k not in COMPARED),
            "predicted": sum(s for k, s in predicted.items() if k not in COMPARED)}
    pairs = {kind: {"measured": measured_by_kind.get(kind, 0.0), "predicted": predicted.get(kind, 0.0)}
             for kind in COMPARED} | {"the rest": rest}
    return {"predicted_by_kind_s": predicted,
            "predicted_vs_measured": {kind: pair | {"error": pair["predicted"] / pair["measured"] - 1}
                                      for kind, pair in pairs.items() if pair["measured"] > 0}}


def predicted_by_kind(plan, hw: str | None = None) -> dict[str, float]:
    """The planner's prices of the plan's step by kind, before calibration, on the profile it was planned on (or
    `hw`)."""
    from fastml.planner.costs import step_work
    from fastml.planner.planner import replan

    return step_work(plan.model, plan.training.seq_len, plan.knobs, replan(plan, hw)[1].machine)


def repredict(path: Path, hw: str) -> None:
    """Writes the planner's prices by kind beside each case of an earlier results file (planned again on `hw`, the
    profile of the machine that measured it, with the file's own command line)."""
    results = json.loads(path.read_text())
    words = shlex.split(results["command"])
    script = next(i for i, word in enumerate(words) if word.endswith("profile_step.py"))
    args = _parser().parse_args(words[script + 1:])
    predicted_by = {"command": " ".join(["python3", *sys.argv]), "git_commit": _commit(), "profile": hw}
    for case, result in results["cases"].items():
        if "by_kind_s" not in result:
            continue
        plan = fidelity_plan(case, results["machine"].split(",")[0].split()[-1].lower()) if args.fidelity else \
            case_plan(results["model"], case, args.steps, args.sequences, hw)
        if describe_knobs(plan.knobs) != result["knobs"]:
            raise SystemExit(f"{case}: planned as {describe_knobs(plan.knobs)!r} on {hw}, but the file ran "
                             f"{result['knobs']!r}")
        result |= beside_predicted(plan, result["by_kind_s"], hw) | {"predicted_by": predicted_by}
        print(case, json.dumps(result["predicted_vs_measured"], indent=1), flush=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--case", action="append", choices=sorted(CASES), default=[])
    parser.add_argument("--fidelity", action="append", default=[], metavar="NAME",
                        help="profile the plan of this fidelity run (results/fidelity-runs-<gpu>.jsonl)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the one before the last is traced")
    parser.add_argument("--sequences", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--out", type=Path, default=None, help="where the runs and traces go (default: a temp dir)")
    parser.add_argument("--repredict", type=Path, metavar="RESULTS",
                        help="no run: write the planner's prices by kind into this earlier results file (any machine)")
    parser.add_argument("--hw", help="with --repredict: the profile of the machine that measured it")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.repredict:
        if not args.hw:
            parser.error("--repredict needs --hw, the profile of the machine that measured the file")
        return repredict(args.repredict, args.hw)
    if bool(args.case) == bool(args.fidelity):
        parser.error("give --case (with --model) or --fidelity, at least once")
    out = args.out or Path(tempfile.mkdtemp(prefix="fastml-profile-"))
    plans = {case: lambda case=case: case_plan(args.model, case, args.steps, args.sequences) for case in args.case}
    plans |= {name: lambda name=name: fidelity_plan(name) for name in args.fidelity}
    results = {}
    for name, plan in plans.items():
        try:
            results[name] = profile(plan(), name, out)
        except Exception as e:  # noqa: BLE001: one case's failure (out of memory) is its result
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(name, json.dumps(results[name], indent=1), flush=True)
    if args.fidelity:
        write_result(f"profile_step-{gpu_tag()}-fidelity.json", {"cases": results})
        return
    name = "" if args.model == DEFAULT_MODEL else f"-{args.model}"
    write_result(f"profile_step-{gpu_tag()}{name}.json", {"model": args.model, "seq_len": SEQ_LEN, "cases": results})


if __name__ == "__main__":
    main()
