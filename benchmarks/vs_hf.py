"""fastml against plain HF transformers on one GPU, side by side in one process.

The baseline is what a user of plain PyTorch writes: `LlamaForCausalLM` (SDPA, bf16 parameters), optionally
gradient checkpointing, `torch.optim.AdamW(fused=True)`. Both train the same shape on the same tokens with the same
tokens per optimizer step; fastml runs one or more plans (pinned knobs). Writes benchmarks/results/vs_hf-*.json.

With --fp8, fastml's fp8 plans run too, and benchmarks/results/fp8-<gpu>.json compares the best of them with the
best bf16 plan; with --loss-runs N, it also holds the final losses of N-step runs of the tinyllama shape on the shipped
corpus in bf16, fp8 and with bf16 optimizer state, and HF's loss curve beside fastml's over LOSS_CURVE_STEPS steps.

    python benchmarks/vs_hf.py --shape tinyllama-1.1b --shape llama-3.1-8b [--fp8] [--loss-runs 500]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from fastml import hwprofiles  # noqa: E402
from fastml.executor.storage.hf import fastml_to_hf  # noqa: E402
from fastml.executor.storage.data import open_training_data  # noqa: E402
from fastml.executor.model.transformer import build_model, materialize  # noqa: E402
from fastml.executor.memory.optim import lr_at  # noqa: E402
from fastml.executor.loop.train import train  # noqa: E402
from fastml.plan import describe_knobs, pinned  # noqa: E402
from fastml.planner.planner import make_plan  # noqa: E402
from fastml.spec import PRESETS, hf_config  # noqa: E402
from record import RESULTS, gpu_tag, write_result  # noqa: E402

SEQ_LEN = 2048
# shape -> (sequences per optimizer step, HF baseline settings, fastml knobs to try: `pinned` sets the rest)
SHAPES = {
    "tinyllama-1.1b": (32, [dict(micro_batch_size=8, checkpointing=False), dict(micro_batch_size=16,
                                                                                checkpointing=False)], [
        dict(micro_batch_size=8),
        dict(micro_batch_size=8, compile=True),
        dict(micro_batch_size=16, compile=True),
    ]),
    "llama-3.1-8b": (16, [dict(micro_batch_size=4, checkpointing=True), dict(micro_batch_size=2, checkpointing=True)], [
        dict(micro_batch_size=1, lm_head_chunks=4, compile=True),
        dict(micro_batch_size=4, recompute=("block",), lm_head_chunks=8, compile=True),
        # bf16 weights and Adam state, as HF's baseline keeps them (the masters with their compensation, as the
        # planner chooses bf16 masters): room for micro-batch 4
        dict(micro_batch_size=4, lm_head_chunks=4, compile=True, optimizer_dtype="bf16", master_dtype="bf16_kahan"),
    ]),
}
# shape -> fastml's fp8 plans (--fp8); the bf16 plans above are what they are compared with
FP8_KNOBS = {
    "tinyllama-1.1b": [dict(micro_batch_size=8, compile=True, matmul_dtype="fp8"),
                       dict(micro_batch_size=16, compile=True, matmul_dtype="fp8"),
                       dict(micro_batch_size=16, compile=True, matmul_dtype="fp8", cache_fp8_weights=True)],
    # the weights cast to fp8 once a step (cast in every micro-batch instead, 4% slower at 48b5a35: NOTES.md), with
    # the backward GEMMs accumulating in fp32 or in the tensor cores' fast mode: side by side
    "llama-3.1-8b": [dict(micro_batch_size=4, lm_head_chunks=4, compile=True, matmul_dtype="fp8",
                          optimizer_dtype="bf16", master_dtype="bf16_kahan", cache_fp8_weights=True),
                     dict(micro_batch_size=4, lm_head_chunks=4, compile=True, matmul_dtype="fp8",
                          optimizer_dtype="bf16", master_dtype="bf16_kahan", cache_fp8_weights=True,
                          fp8_backward_fast_accum=True)],
}
LOSS_SHAPE, LOSS_SEQ_LEN, LOSS_SEQUENCES = "tinyllama-1.1b", 512, 8
"""The loss runs: 4,096 tokens a step, so that hundreds of steps take a minute."""
LOSS_TRAINING = ["training.lr=3e-4", "training.warmup_steps=50"]
LOSS_VARIANTS = {"bf16": dict(micro_batch_size=8, compile=True),
                 "fp8": dict(micro_batch_size=8, compile=True, matmul_dtype="fp8"),
                 "bf16_states": dict(micro_batch_size=8, compile=True, optimizer_dtype="bf16", master_dtype="bf16")}
LOSS_CURVE_STEPS = 200
FINAL_WINDOW = 20
"""A run's final loss is the mean of its last FINAL_WINDOW steps' losses: one step's loss is one batch's."""


def run_hf(shape: str, sequences: int, micro_batch_size: int, checkpointing: bool, steps: int,
           seq_len: int = SEQ_LEN, training: tuple[str, ...] = (), fp32_masters: bool = False) -> dict:
    """The baseline, starting from the very weights fastml starts from and stepping with the same schedule and
    AdamW settings, so that the two loss curves can be compared as well as the speeds. With `fp32_masters` its
    parameters and Adam state are fp32 and its forward pass runs under bf16 autocast (fastml's fp32 masters, in
    transformers' way, though autocast keeps the residual stream and the norms in fp32 where fastml keeps them in
    bf16), instead of all in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    plan = _plan(shape, sequences, steps, seq_len=seq_len, training=training)
    config = LlamaConfig(**hf_config(plan.model, max_seq_len=seq_len))
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                              dtype=torch.float32 if fp32_masters else torch.bfloat16)
    model.load_state_dict(_fastml_initial_weights(plan), strict=True)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    t = plan.training
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
    batches = open_training_data(t.data, seq_len, plan.model.vocab_size).batches(micro_batch_size, seed=t.seed)
    accum = sequences // micro_batch_size
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        start = time.perf_counter()
        loss_sum = torch.zeros((), device="cuda")
        for _ in range(accum):
            inputs, targets = (x.cuda().contiguous() for x in next(batches))
            # shift_labels: the targets are already the next tokens, as fastml's are
            with torch.autocast("cuda", torch.bfloat16, enabled=fp32_masters):
                loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
            (loss / accum).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum.item() / accum)
        times.append(time.perf_counter() - start)
    result = _figures(plan.model, sequences, statistics.median(times[1:]), torch.cuda.max_memory_allocated(),
                      seq_len)
    result.update(micro_batch_size=micro_batch_size, gradient_checkpointing=checkpointing, losses=losses)
    del model, optimizer, params
    _free()
    return result


def _fastml_initial_weights(plan) -> dict:
    """fastml's initial weights for `plan` (seeded, on the GPU), under HF's names."""
    model = materialize(build_model(plan.model), "cuda", torch.bfloat16, seed=plan.training.seed)
    return fastml_to_hf(plan.model, model.state_dict())


def _plan(shape: str, sequences: int, steps: int, seq_len: int = SEQ_LEN, training: tuple[str, ...] = (), **knobs):
    """The plan with exactly these knobs: every searched knob not named is pinned to its default (`pinned`), the
    precision knobs to full precision where not named."""
    full_precision = {"matmul_dtype": "bf16", "optimizer_dtype": "fp32", "master_dtype": "fp32"}
    return make_plan(model=shape, seq_len=seq_len, global_batch_tokens=sequences * seq_len, steps=steps, gpus=1,
                     overrides=pinned(**(full_precision | knobs)) + list(training)).plan


def run_fastml(shape: str, sequences: int, knobs: dict, steps: int, seq_len: int = SEQ_LEN,
               training: tuple[str, ...] = ()) -> dict:
    log = Path(f"/tmp/fastml-bench-{os.getpid()}.jsonl")
    plan = _plan(shape, sequences, steps, seq_len=seq_len, training=training, **knobs)
    summary = train(plan, log_json=log, show_progress=False)
    result = _figures(PRESETS[shape], sequences, summary["step_time_s"], summary["peak_gpu_memory_bytes"], seq_len)
    result.update(knobs=describe_knobs(plan.knobs), val_loss=summary.get("val_loss"),
                  losses=[json.loads(line)["loss"] for line in log.read_text().splitlines()])
    _free()
    return result


def _figures(spec, sequences: int, step_time_s: float, peak_bytes: int, seq_len: int = SEQ_LEN) -> dict:
    """Steady-state figures: step time is the median over the steps after the first. MFU is against the dense bf16
    peak for every run, fp8 ones too, so that the figures compare."""
    tokens_per_s = sequences * seq_len / step_time_s
    peak = hwprofiles.peak_flops(_profile(), "bf16")
    return {"step_time_s": step_time_s, "tokens_per_s": tokens_per_s,
            "mfu": spec.flops_per_token(seq_len) * tokens_per_s / peak, "peak_memory_bytes": peak_bytes}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _try(label: str, fn, *args) -> dict:
    print(f"--- {label}", flush=True)
    try:
        result = fn(*args)
    except torch.cuda.OutOfMemoryError as e:
        _free()
        result = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    print(json.dumps(result), flush=True)
    return result


def bench(shape: str, steps: int, fp8: bool = False) -> dict:
    sequences, hf_settings, fastml_knobs = SHAPES[shape]
    # fastml first: its 8B plans fill the GPU to within 6 GiB (133.6 GiB measured alone), and after the HF runs
    # in the same process they ran out of memory at 138.9 GiB (NOTES.md, 2026-11-30). The HF settings use far less.
    ours = [_try(f"fastml {shape} {knobs}", run_fastml, shape, sequences, knobs, steps) for knobs in fastml_knobs]
    ours_fp8 = [_try(f"fastml {shape} {knobs}", run_fastml, shape, sequences, knobs, steps)
                for knobs in FP8_KNOBS[shape]] if fp8 else []
    hf = [_try(f"hf {shape} {s}", run_hf, shape, sequences, s["micro_batch_size"], s["checkpointing"], steps)
          for s in hf_settings]
    best_hf = max((r for r in hf if "error" not in r), key=lambda r: r["tokens_per_s"])
    best = max((r for r in ours if "error" not in r), key=lambda r: r["tokens_per_s"])
    for r in ours + ours_fp8:
        if "error" not in r:  # same weights, data and schedule: the curves differ only by rounding
            r["max_abs_loss_diff_vs_hf"] = max(abs(a - b) for a, b in zip(r["losses"], best_hf["losses"]))
    return {"shape": shape, "seq_len": SEQ_LEN, "tokens_per_step": sequences * SEQ_LEN, "hf": hf, "fastml": ours,
            **({"fastml_fp8": ours_fp8} if fp8 else {}),
            "speedup_best_vs_best_hf": best["tokens_per_s"] / best_hf["tokens_per_s"],
            "mfu_peak": f"{_profile()} dense bf16 {hwprofiles.peak_flops(_profile(), 'bf16') / 1e12:g} TFLOP/s"}


def _profile() -> str:
    """This GPU's shipped profile, whose dense peak MFU is measured against."""
    profile = hwprofiles.for_device_name(torch.cuda.get_device_name())
    if profile is None:
        raise SystemExit(f"no shipped profile for {torch.cuda.get_device_name()}: MFU would have no peak")
    return profile


def _best(runs: list[dict]) -> dict | None:
    ran = [r for r in runs if "error" not in r]
    return max(ran, key=lambda r: r["tokens_per_s"]) if ran else None


def fp8_summary(results: dict[str, dict]) -> dict:
    """The best fp8 plan against the best bf16 plan of each shape run now, or else of its vs_hf-*.json from an
    earlier --fp8 run (one device call may not hold them all); the top-level figures are llama-3.1-8b's."""
    for shape in sorted(set(SHAPES) - set(results)):
        path = RESULTS / f"vs_hf-{shape}.json"
        if path.is_file() and "fastml_fp8" in json.loads(path.read_text()):
            results = {**results, shape: json.loads(path.read_text())}
    shapes = {}
    for shape, result in results.items():
        bf16, fp8 = _best(result["fastml"]), _best(result["fastml_fp8"])
        if bf16 is None or fp8 is None:
            continue
        shapes[shape] = {"bf16_tokens_per_s": bf16["tokens_per_s"], "bf16_knobs": bf16["knobs"],
                         "fp8_tokens_per_s": fp8["tokens_per_s"], "fp8_knobs": fp8["knobs"],
                         "fp8_vs_bf16": fp8["tokens_per_s"] / bf16["tokens_per_s"]}
    main_shape = "llama-3.1-8b" if "llama-3.1-8b" in shapes else next(iter(shapes), None)
    top = {k: v for k, v in shapes.get(main_shape, {}).items() if k in ("bf16_tokens_per_s", "fp8_tokens_per_s",
                                                                        "fp8_vs_bf16")}
    return {"shape": main_shape, **top, "shapes": shapes}


def loss_runs(steps: int) -> dict:
    """The tinyllama shape for `steps` steps on the shipped corpus from the same weights, in bf16 with fp32 optimizer
    state, in fp8 and with bf16 optimizer state (stochastic rounding), and HF's baseline over the same steps."""
    runs = {name: _try(f"fastml loss run {name}", run_fastml, LOSS_SHAPE, LOSS_SEQUENCES, knobs, steps, LOSS_SEQ_LEN,
                       LOSS_TRAINING) for name, knobs in LOSS_VARIANTS.items()}
    hf = _try("hf loss run", run_hf, LOSS_SHAPE, LOSS_SEQUENCES, LOSS_SEQUENCES, False, steps, LOSS_SEQ_LEN,
              LOSS_TRAINING)
    runs = {name: r for name, r in runs.items() if "error" not in r}
    final = {name: statistics.fmean(r["losses"][-FINAL_WINDOW:]) for name, r in runs.items()}
    reference = final.get("bf16")
    result = {"shape": LOSS_SHAPE, "seq_len": LOSS_SEQ_LEN, "tokens_per_step": LOSS_SEQUENCES * LOSS_SEQ_LEN,
              "steps": steps, "training": LOSS_TRAINING, "final_window": FINAL_WINDOW, "final_loss": final,
              "last_step_loss": {name: r["losses"][-1] for name, r in runs.items()},
              "relative_to_bf16": {name: value / reference - 1 for name, value in final.items()} if reference else {},
              "runs": runs, "hf": hf}
    if reference and "error" not in hf:
        # HF keeps bf16 weights and Adam state (round to nearest), fastml fp32 masters: the curves part by rounding
        # alone. Its scale: how far fastml's own bf16-state run lies from its fp32-state one.
        curve = lambda losses: _smoothed(losses[:LOSS_CURVE_STEPS])  # noqa: E731
        result["curve_vs_hf"] = {
            "steps": LOSS_CURVE_STEPS, "smoothing_steps": 10,
            "mean_abs_diff_fastml_bf16_vs_hf": _mean_abs_diff(curve(runs["bf16"]["losses"]), curve(hf["losses"])),
            "mean_abs_diff_fastml_bf16_vs_bf16_states": _mean_abs_diff(curve(runs["bf16"]["losses"]),
                                                                       curve(runs["bf16_states"]["losses"]))
            if "bf16_states" in runs else None}
    return result


def _smoothed(losses: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a, b))


def _earlier_loss_runs() -> dict:
    """The loss runs of the results file this call replaces, and what made them: a call without --loss-runs keeps
    them."""
    path = RESULTS / f"fp8-{gpu_tag()}.json"
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    if "loss_runs" not in earlier:
        return {}
    made_by = earlier.get("loss_runs_made_by") or {key: earlier.get(key) for key in ("command", "git_commit", "date")}
    return {"loss_runs": earlier["loss_runs"], "loss_runs_made_by": made_by}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), default=[])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run; the first is warm-up")
    parser.add_argument("--fp8", action="store_true", help="fastml's fp8 plans too, and results/fp8-<gpu>.json")
    parser.add_argument("--loss-runs", type=int, default=0, metavar="STEPS",
                        help="the loss runs of this many steps into results/fp8-<gpu>.json (needs --fp8)")
    args = parser.parse_args()
    if args.loss_runs and not args.fp8:
        parser.error("--loss-runs writes into the fp8 results: give --fp8 too")
    results = {}
    for shape in args.shape:
        results[shape] = result = bench(shape, args.steps, args.fp8)
        path = write_result(f"vs_hf-{shape}.json", result)
        print(f"{shape}: fastml best / HF best = {result['speedup_best_vs_best_hf']:.2f}x -> {path}", flush=True)
    if args.fp8:
        summary = fp8_summary(results)
        if args.loss_runs:
            summary["loss_runs"] = loss_runs(args.loss_runs)
        else:
            summary |= _earlier_loss_runs()
        path = write_result(f"fp8-{gpu_tag()}.json", summary)
        print(f"fp8 / bf16 = {summary.get('fp8_vs_bf16')} -> {path}", flush=True)


if __name__ == "__main__":
    main()
