"""Does fastml train as HF transformers does, and do its lower precisions train as its bf16 does? Writes
benchmarks/results/loss_parity-<gpu>.json, one part a call (each fits the device's ten minutes):

    python benchmarks/loss_parity.py --part parity      # fastml's bf16 curves beside HF's, two shapes, 300 steps
    python benchmarks/loss_parity.py --part parity --shapes llama-3.1-8b   # one shape again, keeping the other's
    python benchmarks/loss_parity.py --part hf-masters --shapes llama-3.1-8b   # HF with fp32 masters beside them
    python benchmarks/loss_parity.py --part precision   # fp8 and bf16 optimizer state beside bf16, 500 steps
    python benchmarks/loss_parity.py --part precision --variants bf16,bf16_kahan_states   # only these again

The whole precision part takes about 12 minutes on an H200 (18 runs of 35-55 s): in calls of ten minutes, run it in
two at the same commit, `--variants bf16,fp8,fp8_fast_accum` and `--variants bf16_states,bf16_kahan_states,bf16_eager`
(a call keeps the file's runs of the other variants, and needs one of each).

The parity part starts HF's LlamaForCausalLM from fastml's initial weights and feeds it the same tokens with the same
schedule (vs_hf.run_hf): for TinyLlama and for Llama-3.1-8B's shape cut to PARITY_LAYERS layers, fastml's bf16 run
beside HF's for each of SEEDS, at lr 3e-4 with warm-up (each shape about 4 minutes on an H200). Rounding alone parts
the two curves of a seed (different kernels, HF's bf16 weights and Adam state against fastml's fp32 masters); whether
that is within bf16's noise is judged against the seeds: how far the seeds' smoothed curves lie apart, and how far
their final losses spread. One more fastml run of seed 0 keeps bf16 weights and state as HF does (but rounded
stochastically, where HF's AdamW rounds to nearest), and `--part hf-masters` runs HF with fp32 masters: the two tell a
difference of precision from one of arithmetic. (The training loop's arithmetic itself is HF's with torch's AdamW to
fp32's rounding: tests/test_hf.py, on the CPU.)

The precision part trains TinyLlama for 500 steps in bf16, with fp8 matmuls (their backward GEMMs accumulating in fp32
or in the tensor cores' fast mode) and with bf16 optimizer state (bf16 masters with stochastic rounding, or with a
compensation), and in bf16 again with its blocks not compiled (the noise floor:
the same arithmetic in other kernels), each over SEEDS seeds: each variant's final loss against bf16's of
the same seed, and the spread of those ratios over the seeds. `--variants` runs some of them again, keeping the
file's runs of the others (`variant_runs` says which commit ran each).
A final loss is a noisy reading (one step's loss is one batch's, and varies by about a tenth of it), so the part also
compares each variant with bf16 step by step on the same batches over the last PAIRED_WINDOW steps (the mean of the
ratios less one), the variants' mean final loss over the seeds with bf16's, and each run's validation loss after its
last step (the shipped corpus's held-out split, the same sequences for every run) with bf16's of its seed.

A run's final loss is the mean of its last FINAL_WINDOW steps' losses (one step's loss is one batch's); curves are
compared smoothed over SMOOTHING steps, after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics

from record import RESULTS, _commit, gpu_tag, write_result
from vs_hf import run_fastml, run_hf

SEQ_LEN, SEQUENCES = 512, 8
"""4,096 tokens a step, so that hundreds of steps take a minute."""
WARMUP_STEPS = 30
TRAINING = ("training.lr=3e-4", f"training.warmup_steps={WARMUP_STEPS}")
PARITY_LAYERS = 4
PARITY_SHAPES = {"tinyllama-1.1b": (), "llama-3.1-8b": (f"model.num_layers={PARITY_LAYERS}",)}
PARITY_STEPS, PRECISION_STEPS = 300, 500
SEEDS = (0, 1, 2)
PRECISION_VARIANTS = {"bf16": {}, "fp8": {"matmul_dtype": "fp8"},
                      "fp8_fast_accum": {"matmul_dtype": "fp8", "fp8_backward_fast_accum": True},
                      "bf16_states": {"optimizer_dtype": "bf16", "master_dtype": "bf16"},
                      "bf16_kahan_states": {"optimizer_dtype": "bf16", "master_dtype": "bf16_kahan"},
                      "bf16_eager": {"compile": False}}
"""fp8_fast_accum: fp8 with its backward GEMMs accumulating in the tensor cores' fast mode too. bf16_eager is bf16's
arithmetic in other kernels (its blocks not compiled): how far bf16's own rounding moves the
curves from the same weights and batches, the floor the other variants' differences are read against."""
KNOBS = {"micro_batch_size": SEQUENCES, "compile": True}
FINAL_WINDOW, SMOOTHING, PAIRED_WINDOW = 20, 10, 100


def smoothed(losses: list[float]) -> list[float]:
    return [statistics.fmean(losses[max(0, i - SMOOTHING + 1):i + 1]) for i in range(len(losses))]


def final(losses: list[float]) -> float:
    return statistics.fmean(losses[-FINAL_WINDOW:])


def paired_relative(losses: list[float], reference: list[float]) -> float:
    """How far `losses` lie above `reference` over their last PAIRED_WINDOW steps, step by step on the same batches:
    the mean of the ratios, less one."""
    assert len(losses) == len(reference), "runs of different lengths"
    return statistics.fmean(a / b for a, b in zip(losses[-PAIRED_WINDOW:], reference[-PAIRED_WINDOW:])) - 1


def mean_gap(a: list[float], b: list[float], skip: int) -> float:
    """Mean absolute difference of two smoothed curves after the first `skip` steps."""
    return statistics.fmean(abs(x - y) for x, y in list(zip(smoothed(a), smoothed(b)))[skip:])


def training(seed: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (*TRAINING, f"training.seed={seed}", *extra)


def parity(shape: str, extra: tuple[str, ...], commit: str) -> dict:
    """fastml's bf16 runs and HF's, each over SEEDS (a seed picks the initial weights and the batches' order; the two
    start from the same weights and read the same batches), and one fastml run of seed 0 with bf16 weights and Adam
    state (stochastic rounding, no compensation). Within noise: fastml's curve lies no farther from HF's of its seed
    than the seeds' curves of either lie from each other, and the mean final losses differ by no more than either's
    seeds spread."""
    ours = {seed: run_fastml(shape, SEQUENCES, KNOBS, PARITY_STEPS, SEQ_LEN, training(seed, extra))["losses"]
            for seed in SEEDS}
    hf = {seed: run_hf(shape, SEQUENCES, SEQUENCES, False, PARITY_STEPS, SEQ_LEN, training(seed, extra))["losses"]
          for seed in SEEDS}
    bf16_states = run_fastml(shape, SEQUENCES, KNOBS | PRECISION_VARIANTS["bf16_states"], PARITY_STEPS, SEQ_LEN,
                              training(SEEDS[0], extra))["losses"]
    systems = {"fastml": ours, "hf": hf}
    gaps = {str(s): mean_gap(ours[s], hf[s], WARMUP_STEPS) for s in SEEDS}
    seed_gaps = {name: [mean_gap(runs[a], runs[b], WARMUP_STEPS) for i, a in enumerate(SEEDS) for b in SEEDS[i + 1:]]
                 for name, runs in systems.items()}
    finals = {name: {str(s): final(runs[s]) for s in SEEDS} for name, runs in systems.items()}
    spread = {name: max(f.values()) - min(f.values()) for name, f in finals.items()}
    mean_final = {name: statistics.fmean(f.values()) for name, f in finals.items()}
    gap = statistics.fmean(gaps.values())
    return {"model": shape, "overrides": list(extra), "steps": PARITY_STEPS, "git_commit": commit,
            "mean_gap_vs_hf": gap, "gaps_vs_hf": gaps, "seed_mean_gaps": seed_gaps,
            "paired_relative_to_hf": {str(s): paired_relative(ours[s], hf[s]) for s in SEEDS},
            "bf16_states_paired_relative_to_hf": paired_relative(bf16_states, hf[SEEDS[0]]),
            "bf16_states_gap_vs_hf": mean_gap(bf16_states, hf[SEEDS[0]], WARMUP_STEPS),
            "final_loss": finals, "mean_final_loss": mean_final, "seed_final_spread": spread,
            "within_noise": gap <= max(max(g) for g in seed_gaps.values())
                            and abs(mean_final["fastml"] - mean_final["hf"]) <= max(spread.values()),
            "losses": {**{f"{name}_seed{s}": runs[s] for name, runs in systems.items() for s in SEEDS},
                       "fastml_bf16_states_seed0": bf16_states}}


def hf_masters(entry: dict, commit: str) -> dict:
    """HF again over SEEDS for the parity part's `entry`, with fp32 parameters and Adam state under bf16 autocast:
    whether a gap between fastml's curves and HF's bf16 ones is one of precision (HF's bf16 weights drop updates
    smaller than half their last bit, where fastml's fp32 masters keep them)."""
    shape, extra = entry["model"], tuple(entry["overrides"])
    runs = {seed: run_hf(shape, SEQUENCES, SEQUENCES, False, PARITY_STEPS, SEQ_LEN, training(seed, extra),
                         fp32_masters=True)["losses"] for seed in SEEDS}
    ours, hf = ({seed: entry["losses"][f"{name}_seed{seed}"] for seed in SEEDS} for name in ("fastml", "hf"))
    return {"git_commit": commit, "final_loss": {str(s): final(runs[s]) for s in SEEDS},
            "mean_final_loss": statistics.fmean(final(runs[s]) for s in SEEDS),
            "fastml_paired_relative": {str(s): paired_relative(ours[s], runs[s]) for s in SEEDS},
            "hf_bf16_paired_relative": {str(s): paired_relative(hf[s], runs[s]) for s in SEEDS},
            "losses": {str(s): runs[s] for s in SEEDS}}


def precision(variants: list[str], earlier: dict, earlier_commit: str | None, commit: str) -> dict:
    """The part, from new runs of `variants` (at `commit`) and the `earlier` part's runs of the others (made with the
    same settings, which `main` checks, at the commits its `variant_runs` names, or else at `earlier_commit`)."""
    earlier_runs, earlier_val = earlier.get("losses", {}), earlier.get("val_loss", {})
    kept = {name: {int(s): {"losses": losses, "val_loss": earlier_val.get(name, {}).get(s)}
                   for s, losses in by_seed.items()}
            for name, by_seed in earlier_runs.items() if name in PRECISION_VARIANTS and name not in variants}
    if kept and earlier.get("steps") != PRECISION_STEPS:
        raise SystemExit(f"the results file's runs are {earlier.get('steps')} steps long, not {PRECISION_STEPS}: "
                         "run every variant")
    missing = set(PRECISION_VARIANTS) - set(kept) - set(variants)
    if missing:
        raise SystemExit(f"no earlier runs of {', '.join(sorted(missing))} in the results file: run them too")
    made = {name: earlier.get("variant_runs", {}).get(name, earlier_commit) for name in kept}
    made_now = {name: {seed: run_fastml("tinyllama-1.1b", SEQUENCES, KNOBS | PRECISION_VARIANTS[name],
                                        PRECISION_STEPS, SEQ_LEN, training(seed)) for seed in SEEDS}
                for name in variants}
    both = kept | made_now
    runs = {name: {seed: both[name][seed]["losses"] for seed in SEEDS} for name in PRECISION_VARIANTS}
    val = {name: {seed: both[name][seed]["val_loss"] for seed in SEEDS} for name in PRECISION_VARIANTS}
    made |= dict.fromkeys(variants, commit)
    bf16 = {seed: final(runs["bf16"][seed]) for seed in SEEDS}
    relative = {name: {str(seed): final(runs[name][seed]) / bf16[seed] - 1 for seed in SEEDS}
                for name in PRECISION_VARIANTS if name != "bf16"}
    paired = {name: {str(seed): paired_relative(runs[name][seed], runs["bf16"][seed]) for seed in SEEDS}
              for name in relative}
    mean_final = {name: statistics.fmean(final(runs[name][seed]) for seed in SEEDS) for name in runs}
    # runs kept from a file written before validation losses were recorded have none
    val_relative = {name: {str(seed): val[name][seed] / val["bf16"][seed] - 1
                           for seed in SEEDS if val[name][seed] is not None and val["bf16"][seed] is not None}
                    for name in relative}
    return {"model": "tinyllama-1.1b", "steps": PRECISION_STEPS, "variant_runs": made,
            "paired_relative_to_bf16": paired,
            "mean_final_relative_to_bf16": {name: mean_final[name] / mean_final["bf16"] - 1 for name in relative},
            "final_loss": {name: {str(s): final(losses) for s, losses in by_seed.items()}
                           for name, by_seed in runs.items()},
            "relative_to_bf16": relative,
            "worst_relative_to_bf16": {name: max(by_seed.values(), key=abs) for name, by_seed in relative.items()},
            "seed_spread_bf16": max(bf16.values()) - min(bf16.values()),
            "val_loss": {name: {str(s): v for s, v in by_seed.items()} for name, by_seed in val.items()},
            "val_relative_to_bf16": val_relative,
            "worst_val_relative_to_bf16": {name: max(by_seed.values(), key=abs) if by_seed else None
                                           for name, by_seed in val_relative.items()},
            "losses": {name: {str(s): losses for s, losses in by_seed.items()} for name, by_seed in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("parity", "hf-masters", "precision"), required=True)
    parser.add_argument("--variants", default=",".join(PRECISION_VARIANTS),
                        help="the precision part's variants to run (the others' runs are kept from the file)")
    parser.add_argument("--shapes", default=",".join(PARITY_SHAPES),
                        help="the parity part's shapes to run (the others' entries are kept from the file)")
    args = parser.parse_args()
    variants, shapes = args.variants.split(","), args.shapes.split(",")
    if set(shapes) - set(PARITY_SHAPES):
        parser.error(f"unknown shapes {', '.join(sorted(set(shapes) - set(PARITY_SHAPES)))}; "
                     f"choose from {', '.join(PARITY_SHAPES)}")
    unknown = set(variants) - set(PRECISION_VARIANTS)
    if unknown:
        parser.error(f"unknown variants {', '.join(sorted(unknown))}; choose from {', '.join(PRECISION_VARIANTS)}")
    path = RESULTS / f"loss_parity-{gpu_tag()}.json"
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    parts = {key: earlier[key] for key in ("parity", "precision") if key in earlier}
    settings = {"seq_len": SEQ_LEN, "tokens_per_step": SEQ_LEN * SEQUENCES, "training": list(TRAINING),
                "knobs": KNOBS, "seeds": list(SEEDS), "final_window": FINAL_WINDOW, "smoothing_steps": SMOOTHING,
                "paired_window": PAIRED_WINDOW}
    changed = [key for key, value in settings.items() if key in earlier and earlier[key] != value]
    if args.part == "precision" and set(variants) != set(PRECISION_VARIANTS) and changed:
        parser.error(f"the results file's runs were made with other settings ({', '.join(changed)}): run every variant")
    if args.part == "parity" and set(shapes) != set(PARITY_SHAPES) and changed:
        parser.error(f"the results file's runs were made with other settings ({', '.join(changed)}): run every shape")
    if args.part == "parity":
        done = {entry["model"]: entry for entry in parts.get("parity", [])}
        done |= {shape: parity(shape, PARITY_SHAPES[shape], _commit()) for shape in shapes}
        parts["parity"] = [done[shape] for shape in PARITY_SHAPES if shape in done]
    elif args.part == "hf-masters":
        entries = {entry["model"]: entry for entry in parts.get("parity", []) if "hf_seed0" in entry["losses"]}
        if set(shapes) - set(entries):
            parser.error(f"no parity runs of {', '.join(sorted(set(shapes) - set(entries)))} with HF over every seed "
                         "in the results file: run `--part parity` for them first")
        for shape in shapes:
            entries[shape]["hf_fp32_masters"] = hf_masters(entries[shape], _commit())
    else:
        earlier_commit = earlier.get("made_by", {}).get("precision", {}).get("git_commit")
        parts["precision"] = precision(variants, parts.get("precision", {}), earlier_commit, _commit())
    made_by = dict(earlier.get("made_by", {}))
    written = write_result(path.name, {**settings, **parts, "made_by": made_by})
    record = json.loads(written.read_text())
    made_by[args.part] = {key: record[key] for key in ("command", "git_commit", "machine", "date")}
    record["made_by"] = made_by
    written.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
