"""Measures one GPU's bf16 GEMM efficiency curve, HBM copy bandwidth and pinned host transfer rates: the
figures of a hwprofile. Writes benchmarks/results/gemm_curve-<gpu>.json.

    python benchmarks/gemm_curve.py --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from record import gpu_tag, write_result

SQUARE_SIZES = (256, 512, 1024, 2048, 4096, 8192)
# (M, N, K) of the matmuls of real shapes: tokens x out x in, for tinyllama-1.1b and llama-3.1-8b at 2 and 8
# sequences of 2048
MODEL_SHAPES = ((16384, 2560, 2048), (16384, 11264, 2048), (16384, 2048, 5632), (2048, 6144, 4096),
                (2048, 28672, 4096), (2048, 4096, 14336), (8192, 28672, 4096), (2048, 128256, 4096))


def time_s(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm_tflops(m: int, n: int, k: int) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return 2 * m * n * k / time_s(lambda: a @ b) / 1e12


def copy_rates() -> dict:
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    return {"hbm_copy_bytes_per_s (read+write)": 2 * n / time_s(lambda: dst.copy_(src)),
            "pinned_h2d_bytes_per_s": n / time_s(lambda: src.copy_(host, non_blocking=True), 5),
            "pinned_d2h_bytes_per_s": n / time_s(lambda: host.copy_(src, non_blocking=True), 5)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peak-tflops", type=float, required=True, help="dense bf16 peak of this GPU")
    args = parser.parse_args()
    square = {g: gemm_tflops(g, g, g) for g in SQUARE_SIZES}
    shapes = {f"{m}x{n}x{k}": gemm_tflops(m, n, k) for m, n, k in MODEL_SHAPES}
    rates = copy_rates()
    write_result(f"gemm_curve-{gpu_tag()}.json", {
        "peak_tflops": args.peak_tflops,
        "gemm_efficiency": [[g, round(t / args.peak_tflops, 4)] for g, t in square.items()],
        "square_tflops": square,
        "model_shape_tflops": shapes,
        "model_shape_efficiency_at_geomean": {
            f"{m}x{n}x{k}": [round((m * n * k) ** (1 / 3)), round(shapes[f"{m}x{n}x{k}"] / args.peak_tflops, 4)]
            for m, n, k in MODEL_SHAPES},
        **rates})
    for g, t in square.items():
        print(f"{g:>5}^3  {t:7.1f} TFLOP/s  {t / args.peak_tflops:.1%}")
    for s, t in shapes.items():
        print(f"{s:>20}  {t:7.1f} TFLOP/s")
    print(json.dumps(rates, indent=1))


if __name__ == "__main__":
    main()
