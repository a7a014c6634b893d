"""fastml's C++ CPU AdamW (`torch.ops.fastml.adamw_step_`) against what plain PyTorch offers for optimizer state in
host memory: `torch.optim.AdamW(fused=True)` on fp32 CPU tensors, then a separate copy of the weights into the bf16
tensor that goes back to the GPU. Same parameters, same threads (torch's intra-op threads). Writes
benchmarks/results/cpu_adam-<machine>.json.

    python benchmarks/cpu_adam.py [--params 100000000] [--repeats 5] [--threads N]

The op also steps bf16 moments, bf16 masters, and both (stochastic rounding), all with a bf16 gradient:
`op_bf16_moments`, `op_bf16_masters` and `op_bf16_moments_and_masters`, against `op_bf16_grad`'s fp32 state; and
bf16 moments beside bf16 masters with their compensation (master_dtype "bf16_kahan"): `op_bf16_kahan`.

The op reads a bf16 gradient, as it does in training (gradients leave the GPU in bf16); torch's reads an fp32 one,
which spares it a conversion it would need in training, so `speedup` is a conservative figure. The op with an fp32
gradient (`speedup_fp32_grad`) is the like-for-like comparison of the step alone. Bytes per second (read plus
written) are set against this host's memory bandwidth, measured here with a large tensor copy and with an in-place
multiply (the copy's writes also read each line first, uncounted, so a stream that mostly updates in place, like
the op, can pass 100% of it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from record import gpu_tag, write_result

from fastml.executor.memory import cpu_adam
from fastml.hwprofiles import cpu_key

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
BYTES_PER_PARAM = {"op_bf16_grad": 3 * 2 * 4 + 2 + 2, "op_fp32_grad": 3 * 2 * 4 + 4 + 2,
                   "op_bf16_moments": 2 * 4 + 2 * 2 * 2 + 2 + 2, "op_bf16_masters": 2 * 2 + 2 * 2 * 4 + 2,
                   "op_bf16_moments_and_masters": 3 * 2 * 2 + 2, "op_bf16_kahan": 4 * 2 * 2 + 2,
                   "torch_fused_plus_copy": 3 * 2 * 4 + 4 + 4 + 2}
"""Read and write master, m and v (fp32, or bf16 moments or all three bf16) and a bf16 master's compensation; read
the gradient; write the bf16 weight beside fp32 masters (torch: read the fp32 master again to copy it)."""


def op_step(num_params: int, grad_dtype: torch.dtype, moments: torch.dtype = torch.float32,
            masters: torch.dtype = torch.float32, compensated: bool = False):
    """One step of the op over fresh state, as a function that takes the next step each call. bf16 moments or
    masters are written with stochastic rounding (knobs.optimizer_dtype, knobs.master_dtype), or, `compensated`,
    bf16 masters rounded to nearest with their compensation (master_dtype "bf16_kahan")."""
    master = torch.randn(num_params).to(masters)
    exp_avg, exp_avg_sq = torch.zeros(num_params, dtype=moments), torch.zeros(num_params, dtype=moments)
    grad = (torch.randn(num_params) * 1e-2).to(grad_dtype)
    weight = torch.empty(num_params, dtype=torch.bfloat16) if masters == torch.float32 else None
    low = torch.zeros(num_params, dtype=torch.bfloat16) if compensated else None
    step = 0

    def one_step():
        nonlocal step
        step += 1
        cpu_adam.adamw_step_(master, exp_avg, exp_avg_sq, grad, weight, LR, *BETAS, EPS, WEIGHT_DECAY, step,
                             seed=7, master_low=low)

    return one_step


def torch_step(num_params: int):
    param = torch.nn.Parameter(torch.randn(num_params))
    param.grad = torch.randn(num_params) * 1e-2
    weight = torch.empty(num_params, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    def one_step():
        optimizer.step()
        weight.copy_(param.detach())

    return one_step


def interleaved_times(steps: dict, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each function, the functions taking turns, so that a change in the machine's load (other
    processes, clock speed) falls on all of them alike."""
    times = {name: [] for name in steps}
    for repeat in range(warmup + repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            if repeat >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def stream_bytes_per_s(num_elements: int, repeats: int) -> dict[str, float]:
    """Bytes read plus bytes written per second by two streams over a large fp32 tensor, the best of `repeats`: a
    copy into another tensor, whose writes also read each line first (write-allocate) uncounted, and an in-place
    multiply, which writes the lines it reads, as the op does for master, m and v."""
    src, dst = torch.randn(num_elements), torch.empty(num_elements)
    times = interleaved_times({"copy": lambda: dst.copy_(src), "in_place": lambda: src.mul_(1.0)}, 2, repeats)
    return {name: 2 * src.nbytes / min(seconds) for name, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_adam.load()  # a first build is not timed

    bf16 = torch.bfloat16
    steps = {"op_bf16_grad": op_step(args.params, bf16), "op_fp32_grad": op_step(args.params, torch.float32),
             "op_bf16_moments": op_step(args.params, bf16, moments=bf16),
             "op_bf16_masters": op_step(args.params, bf16, masters=bf16),
             "op_bf16_moments_and_masters": op_step(args.params, bf16, moments=bf16, masters=bf16),
             "op_bf16_kahan": op_step(args.params, bf16, moments=bf16, masters=bf16, compensated=True),
             "torch_fused_plus_copy": torch_step(args.params)}
    figures = {}
    for name, times in interleaved_times(steps, args.warmup, args.repeats).items():
        median_s = statistics.median(times)
        figures[name] = {"median_s": median_s, "times_s": times, "params_per_s": args.params / median_s}
        print(f"{name}: {args.params / median_s / 1e9:.2f} G params/s (median of {args.repeats})")
    del steps  # the copy below needs the memory
    stream_rates = stream_bytes_per_s(max(args.params, 64 * 2**20), args.repeats)
    for name, bytes_per_param in BYTES_PER_PARAM.items():
        bytes_per_s = figures[name]["params_per_s"] * bytes_per_param
        figures[name] |= {"bytes_per_param": bytes_per_param, "bytes_per_s": bytes_per_s,
                          "fraction_of_copy_bandwidth": bytes_per_s / stream_rates["copy"],
                          "fraction_of_in_place_bandwidth": bytes_per_s / stream_rates["in_place"]}
    torch_rate = figures["torch_fused_plus_copy"]["params_per_s"]
    speedup = figures["op_bf16_grad"]["params_per_s"] / torch_rate
    speedup_fp32 = figures["op_fp32_grad"]["params_per_s"] / torch_rate
    print(f"speedup {speedup:.2f}x (fp32 gradient: {speedup_fp32:.2f}x)")
    for name, rate in stream_rates.items():
        print(f"{name} stream {rate / 1e9:.1f} GB/s read + written; of that the op moves "
              f"{figures['op_bf16_grad'][f'fraction_of_{name}_bandwidth']:.0%}, torch "
              f"{figures['torch_fused_plus_copy'][f'fraction_of_{name}_bandwidth']:.0%}")
    tag = gpu_tag() if torch.cuda.is_available() else "cpu"
    path = write_result(f"cpu_adam-{tag}.json", {
        "cpu": cpu_key()["cpu"], "threads": args.threads, "params": args.params, "repeats": args.repeats,
        "speedup": speedup, "speedup_fp32_grad": speedup_fp32, "copy_bytes_per_s": stream_rates["copy"],
        "in_place_bytes_per_s": stream_rates["in_place"], **figures})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
