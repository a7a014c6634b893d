"""Every kernel fastml writes, against the roofline measured in the same run (llm.c's dev/cuda discipline): the
bytes a memory-bound kernel must move at least, or the FLOPs a compute-bound one must do, over its median time,
as a fraction of what this machine does at best. Writes benchmarks/results/kernels-<gpu>.json with `roofline` and
a list `kernels` of {name, bound, seconds, rate, fraction_of_roofline, ...}.

    python benchmarks/kernels.py [--repeats 20]

The rooflines, measured by `fastml profile`'s own functions (hwprofiles/measure.py): HBM, a device-to-device copy
of 2 GiB (its bytes read and written over its time); bf16 compute, an 8192³ GEMM; host memory, the faster of a 1 GiB
copy and an in-place add of two 1 GiB float32 tensors (a copy's destination is also read into the CPU's caches
before it is written, which the count of its bytes leaves out; AdamW, like the add, writes mostly what it has read).
The kernels, at the shapes of Llama-3.1-8B's micro-batch of 4 x 2,048 tokens:
- csrc/adamw_cuda.cu, `adamw_step_` on the GPU, in the two dtype combinations the executor steps with it (those with
  bf16 state; all-fp32 state steps with torch's fused AdamW): bf16 weights and bf16 moments, and fp32 masters with
  bf16 moments writing the bf16 weight in the same pass; and, the file's last row, bf16 weights with their
  compensation (master_dtype "bf16_kahan") and bf16 moments;
- csrc/fp8_cuda.cu, `quantize_fp8`: the absolute-maximum pass and the cast pass together, rowwise and with the
  transpose, an activation (8,192 x 4,096) and the MLP's weight (14,336 x 4,096); and the cast pass alone, with the
  maxima the SwiGLU kernels took, of SwiGLU's output (8,192 x 14,336) and of gate_up's output gradient (8,192 x
  28,672), as fp8's feed-forward layer casts them;
- executor/model/fused.py, the Triton SwiGLU forward and backward, plain and taking their outputs' maxima, and the
  cross-entropy over one slice of the LM head's logits (2,048 tokens, a quarter of the micro-batch, as
  lm_head_chunks 4 makes them; the 8B's vocabulary of 128,256): it reads a row twice (its log-sum-exp, then the
  softmax) and writes the gradient once, 6 bytes a logit counted, since a row of 256 KB fits no multiprocessor's
  shared memory;
- csrc/cpu_adam.cpp, `adamw_step_` on the CPU (fp32 state, bf16 gradient and weight), against host memory;
- attention (executor/model/transformer.py calls torch's SDPA, the one compute-bound kernel fastml does not leave to
  cuBLAS), against the bf16 matmul, its FLOPs counted as FlashAttention counts them: causal, the backward pass 2.5
  times the forward (its recompute of QKᵀ included; without it, 2 times, and the fraction would be 6/7 of this).
Every GPU time is the GPU's own: each call is queued behind a sleep on the GPU before the clock starts (as
`fastml profile` times, `_cuda_seconds`). A tensor the GPU reads twice in one call (the two passes of
`quantize_fp8`) may be read from L2 the second time, as in training; between calls the kernels read different
tensors, larger together than L2.
csrc/hostcomm.cpp holds no kernel to time: its barrier waits on the other ranks.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from record import gpu_tag, write_result

from fastml.executor import native
from fastml.executor.memory import cpu_adam
from fastml.executor.model import fp8, fused
from fastml.hwprofiles.measure import (_attention_pass, _cuda_seconds, _gemm_flops, _hbm_bytes_per_s,
                                       _host_copy_bytes_per_s, _wall_s)
from fastml.planner.costs import ATTENTION_BACKWARD_FACTOR
from fastml.spec import PRESETS

SPEC = PRESETS["llama-3.1-8b"]
TOKENS = 4 * 2048
ADAM_ELEMENTS = 2**28
"""Elements of one AdamW call: 268M (the 8B's MLP matrices hold 59M), so that the launch is noise."""
CPU_ADAM_ELEMENTS = 2**26


def cpu_seconds(run, repeats: int) -> float:
    """Median wall seconds of `run` after one warm-up call."""
    run()
    return statistics.median(_wall_s(run) for _ in range(repeats))


def rooflines(repeats: int) -> dict:
    """As `fastml profile` measures HBM, the bf16 GEMM and a host copy (hwprofiles/measure.py), and the host's
    in-place add beside its copy."""
    a, b = torch.randn(2**28), torch.randn(2**28)
    add = 3 * a.nbytes / cpu_seconds(lambda: a.add_(b), repeats)
    return {"hbm_bytes_per_s": _hbm_bytes_per_s(2**31), "bf16_flop_per_s": _gemm_flops(8192, 8192, 8192),
            "host_bytes_per_s": max(_host_copy_bytes_per_s(2**30), add)}


def row(name: str, bound: str, seconds: float, work: float, roofline: float, **details) -> dict:
    unit = "bytes_per_s" if bound == "memory" else "flop_per_s"
    result = {"name": name, "bound": bound, "seconds": seconds, unit: work / seconds,
              "fraction_of_roofline": work / seconds / roofline, **details}
    print(f"{name:58s} {bound:7s} {result['fraction_of_roofline']:6.3f} of roofline  {seconds * 1e3:8.3f} ms",
          flush=True)
    return result


ADAM_KINDS = {
    # name: (master, moments, gradient, weight written beside an fp32 master, a compensation of bf16 masters)
    "bf16 weights, bf16 moments": (torch.bfloat16, torch.bfloat16, torch.bfloat16, None, False),
    "fp32 masters, bf16 moments, bf16 weight out": (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                                                    False),
    "fp32 masters, fp32 moments, bf16 weight out": (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16,
                                                    False),
    "bf16 weights with a compensation, bf16 moments": (torch.bfloat16, torch.bfloat16, torch.bfloat16, None, True),
}
STEPPED_BY_THE_OP = {"cuda": list(ADAM_KINDS)[:2], "cpu": list(ADAM_KINDS)[1:3]}
"""The kinds each device's op steps in training, timed in this order: the GPU's, bf16 state (all-fp32 state steps with
torch's fused AdamW there); the CPU's, offloaded fp32 masters with either moments. The compensated kind (master_dtype
"bf16_kahan", the planner's bf16 masters, on the GPU) is timed after every other kernel, so that the rows before it
keep their places in the file."""


def adamw_rows(device: str, elements: int, roofline: float, repeats: int, timer, kinds=None) -> list[dict]:
    rows = []
    for kind in STEPPED_BY_THE_OP[device] if kinds is None else kinds:
        master_dtype, state_dtype, grad_dtype, out_dtype, compensated = ADAM_KINDS[kind]
        master = torch.randn(elements, device=device).to(master_dtype)
        m = (torch.randn(elements, device=device) * 1e-3).to(state_dtype)
        v = (torch.rand(elements, device=device) * 1e-6).to(state_dtype)
        grad = (torch.randn(elements, device=device) * 1e-3).to(grad_dtype)
        out = torch.empty(elements, device=device, dtype=out_dtype) if out_dtype is not None else None
        low = torch.zeros(elements, device=device, dtype=torch.bfloat16) if compensated else None
        tensors = [master, m, v, grad] + [t for t in (out, low) if t is not None]
        # master, m, v, the compensation and the gradient are read; all but the gradient written
        moved = sum(t.numel() * t.element_size() for t in tensors) + sum(
            t.numel() * t.element_size() for t in (master, m, v, low) if t is not None)

        def step():
            cpu_adam.adamw_step_(master, m, v, grad, out, 1e-4, 0.9, 0.95, 1e-8, 0.1, 10, seed=1, master_low=low)

        where = "csrc/adamw_cuda.cu" if device == "cuda" else "csrc/cpu_adam.cpp"
        rows.append(row(f"adamw_step_ {device} ({kind})", "memory", timer(step, repeats), moved, roofline,
                        source=where, elements=elements, bytes=moved))
        del master, m, v, grad, out, low, tensors
    return rows


def quantize_rows(roofline: float, repeats: int) -> list[dict]:
    rows = []
    shapes = {"activation": (TOKENS, SPEC.hidden_size), "mlp weight": (SPEC.ffn_hidden_size, SPEC.hidden_size)}
    for what, shape in shapes.items():
        inputs = itertools.cycle([torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)])
        for layouts, transposed in (("rowwise", False), ("rowwise and transposed", True)):
            # the maximum pass reads x; the cast pass reads it again and writes one byte an element per layout
            moved = shape[0] * shape[1] * (2 + 2 + (2 if transposed else 1))
            seconds = _cuda_seconds(lambda: fp8.quantize(next(inputs), fp8.E4M3, True, transposed), repeats)
            rows.append(row(f"quantize_fp8 {what} {shape[0]}x{shape[1]} ({layouts})", "memory", seconds, moved,
                            roofline, source="csrc/fp8_cuda.cu", bytes=moved))
    # SwiGLU's output and gate_up's output gradient, cast with the maxima SwiGLU's kernels took: one read
    f = SPEC.ffn_hidden_size
    for what, dtype, make in (("swiglu output", fp8.E4M3, lambda h: fused.swiglu_amax(h)),
                              ("gate_up gradient", fp8.E5M2,
                               lambda h: fused.swiglu_backward_amax(h[:, :f].contiguous(), h))):
        made = [make(torch.randn(TOKENS, 2 * f, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
        x, inputs = made[0][0], itertools.cycle(made)
        moved = x.numel() * (2 + 2)
        seconds = _cuda_seconds(lambda: fp8.quantize(*_with_maxima(next(inputs), dtype)), repeats)
        rows.append(row(f"quantize_fp8 {what} {x.shape[0]}x{x.shape[1]} (rowwise and transposed, SwiGLU's maxima)",
                        "memory", seconds, moved, roofline, source="csrc/fp8_cuda.cu", bytes=moved))
        del made, inputs, x
    return rows


def _with_maxima(made: tuple, dtype: torch.dtype) -> tuple:
    x, maxima = made
    return x, dtype, True, True, maxima


def swiglu_rows(roofline: float, repeats: int) -> list[dict]:
    f = SPEC.ffn_hidden_size
    gate_up = torch.randn(TOKENS, 2 * f, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(TOKENS, f, device="cuda", dtype=torch.bfloat16)
    rows = []
    for suffix, forward_op, backward_op in (("", fused.swiglu, fused.swiglu_backward),
                                            (" with its maxima", fused.swiglu_amax, fused.swiglu_backward_amax)):
        forward = _cuda_seconds(lambda: forward_op(gate_up), repeats)
        backward = _cuda_seconds(lambda: backward_op(grad, gate_up), repeats)
        # forward reads gate and up and writes the product; backward reads those three and writes two gradients (the
        # maxima, one float a program of 1,024 elements, are not counted)
        rows += [row(f"swiglu forward{suffix}", "memory", forward, 3 * TOKENS * f * 2, roofline,
                     source="executor/model/fused.py", bytes=3 * TOKENS * f * 2),
                 row(f"swiglu backward{suffix}", "memory", backward, 5 * TOKENS * f * 2, roofline,
                     source="executor/model/fused.py", bytes=5 * TOKENS * f * 2)]
    return rows


def cross_entropy_row(roofline: float, repeats: int) -> dict:
    rows, vocab = TOKENS // 4, SPEC.vocab_size
    inputs = itertools.cycle([torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) for _ in range(4)])
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    moved = 3 * rows * vocab * 2
    seconds = _cuda_seconds(lambda: fused.cross_entropy_(next(inputs), targets), repeats)
    return row(f"cross_entropy_ {rows}x{vocab} (loss and gradient in place)", "memory", seconds, moved, roofline,
               source="executor/model/fused.py", bytes=moved)


def attention_row(roofline: float, repeats: int) -> dict:
    batch, seq = TOKENS // 2048, 2048
    run = _attention_pass(batch, seq, SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_dim)
    flops = (1 + ATTENTION_BACKWARD_FACTOR) * 2 * batch * seq**2 * SPEC.num_heads * SPEC.head_dim
    return row("attention forward and backward (SDPA, causal, GQA)", "compute", _cuda_seconds(run, repeats), flops,
               roofline, source="executor/model/transformer.py", flops=flops)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    native.load_cuda()
    roof = rooflines(args.repeats)
    print(roof, flush=True)
    kernels = [*adamw_rows("cuda", ADAM_ELEMENTS, roof["hbm_bytes_per_s"], args.repeats, _cuda_seconds),
               *quantize_rows(roof["hbm_bytes_per_s"], args.repeats),
               *swiglu_rows(roof["hbm_bytes_per_s"], args.repeats),
               cross_entropy_row(roof["hbm_bytes_per_s"], args.repeats),
               attention_row(roof["bf16_flop_per_s"], args.repeats),
               *adamw_rows("cpu", CPU_ADAM_ELEMENTS, roof["host_bytes_per_s"], max(3, args.repeats // 4), cpu_seconds),
               *adamw_rows("cuda", ADAM_ELEMENTS, roof["hbm_bytes_per_s"], args.repeats, _cuda_seconds,
                           kinds=["bf16 weights with a compensation, bf16 moments"])]
    print(f"wrote {write_result(f'kernels-{gpu_tag()}.json', {'roofline': roof, 'kernels': kernels})}")


if __name__ == "__main__":
    main()
