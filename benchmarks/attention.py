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

from torch.nn.attention import SDPBackend, sdpa_kernel
from record import gpu_tag, write_result

from fastml.hwprofiles.measure import _attention_pass, _cuda_seconds
from fastml.planner.costs import ATTENTION_BACKWARD_FACTOR
from fastml.spec import PRESETS

SHAPES = {"tinyllama-1.1b": 16, "llama-3.1-8b": 4}
"""Preset -> sequences per micro-batch (vs_hf.py's best bf16 plans), at 2,048 tokens."""
SEQ_LEN = 2048
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_attention(preset: str, batch: int, backend, repeats: int) -> float:
    """Median GPU seconds of one forward and backward pass, as `fastml profile` times attention."""
    spec = PRESETS[preset]
    run = _attention_pass(batch, SEQ_LEN, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        return _cuda_seconds(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    results = {}
    for preset, batch in SHAPES.items():
        spec = PRESETS[preset]
        # causal: half of forward's 4·s²·d a head; the backward pass does 2.5 times the forward's
        flops = (1 + ATTENTION_BACKWARD_FACTOR) * 2 * batch * SEQ_LEN**2 * spec.num_heads * spec.head_dim
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
