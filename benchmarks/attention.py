"""Which of torch's attention kernels is fastest at the presets' shapes: causal scaled-dot-product attention,
forward and backward, through each SDPA backend torch has on this GPU (cuDNN's, FlashAttention-2's, the
memory-efficient one), in the layout and with the grouped-query heads the executor uses (executor/model/transformer.py:
(B, T, H, D) tensors transposed to (B, H, T, D) views); `default` is SDPA's own choice. A backend that refuses the
inputs records torch's error. Writes benchmarks/results/attention-<gpu>.json.

    python benchmarks/attention.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from record import gpu_tag, write_result

from fastml.spec import PRESETS

SHAPES = {"tinyllama-1.1b": 16, "llama-3.1-8b": 4}
"""Preset -> sequences per micro-batch (vs_hf.py's best bf16 plans), at 2,048 tokens."""
SEQ_LEN = 2048
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_attention(preset: str, batch: int, backend, repeats: int) -> float:
    """Median seconds of one forward and backward pass."""
    spec = PRESETS[preset]

    def heads(count: int) -> torch.Tensor:
        return torch.randn(batch, SEQ_LEN, count, spec.head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)

    q, k, v = heads(spec.num_heads), heads(spec.num_kv_heads), heads(spec.num_kv_heads)
    grad = torch.randn(batch, spec.num_heads, SEQ_LEN, spec.head_dim, device="cuda", dtype=torch.bfloat16)

    def run():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=spec.num_heads != spec.num_kv_heads)
        torch.autograd.grad(out, (q, k, v), grad)  # the gradients alone, not added to any .grad

    times = []
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        for i in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    results = {}
    for preset, batch in SHAPES.items():
        spec = PRESETS[preset]
        # causal: half of forward's 4·s²·d a head; the backward pass does 2.5 times the forward's
        flops = 3.5 * 2 * batch * SEQ_LEN**2 * spec.num_heads * spec.head_dim
        row = {"batch": batch, "seq_len": SEQ_LEN, "heads": spec.num_heads, "kv_heads": spec.num_kv_heads,
               "head_dim": spec.head_dim}
        for name, backend in BACKENDS.items():
            try:
                seconds = time_attention(preset, batch, backend, args.repeats)
                row[name] = {"seconds": seconds, "tflops": flops / seconds / 1e12}
            except RuntimeError as e:  # a backend that cannot take these inputs says why
                row[name] = {"error": str(e).splitlines()[0][:200]}
            print(preset, name, row[name], flush=True)
        results[preset] = row
    print(f"wrote {write_result(f'attention-{gpu_tag()}.json', {'shapes': results})}")


if __name__ == "__main__":
    main()
