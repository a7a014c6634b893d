"""fastml's fused kernels (executor/model/fused.py) against what torch.compile makes of the same arithmetic, forward and
backward, at the presets' shapes (vs_hf.py's best bf16 micro-batches at 2,048 tokens): seconds, the bytes each pass
must move at least and the bandwidth that makes, and the largest difference from the reference. Writes
benchmarks/results/fused_kernels-<gpu>.json.

    python benchmarks/fused_kernels.py [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from record import gpu_tag, write_result

from fastml.executor.model import fused
from fastml.hwprofiles.measure import _cuda_seconds
from fastml.spec import PRESETS

SHAPES = {"tinyllama-1.1b": 16, "llama-3.1-8b": 4}
"""Preset -> sequences per micro-batch, at 2,048 tokens."""
SEQ_LEN = 2048


def compiled_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """The model's SwiGLU before the fused op: what torch.compile fused into its own kernels."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def time_swiglu(function, gate_up: torch.Tensor, grad: torch.Tensor, repeats: int) -> dict:
    x = gate_up.detach().requires_grad_()
    forward = _cuda_seconds(lambda: function(x), repeats)
    out = function(x)
    backward = _cuda_seconds(lambda: torch.autograd.grad(out, x, grad, retain_graph=True), repeats)
    return {"forward_s": forward, "backward_s": backward}


def swiglu_row(preset: str, sequences: int, repeats: int) -> dict:
    spec = PRESETS[preset]
    tokens, f = sequences * SEQ_LEN, spec.ffn_hidden_size
    gate_up = torch.randn(tokens, 2 * f, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, f, device="cuda", dtype=torch.bfloat16)
    # forward reads gate and up and writes the product; backward reads those three and writes two gradients
    least_bytes = {"forward_s": 3 * tokens * f * 2, "backward_s": 5 * tokens * f * 2}
    row = {"tokens": tokens, "ffn_hidden_size": f, "layers": spec.num_layers}
    torch._dynamo.reset()
    for name, function in (("compiled", torch.compile(compiled_swiglu)), ("fused", fused.swiglu)):
        times = time_swiglu(function, gate_up, grad, repeats)
        row[name] = {**times, **{k.replace("_s", "_tb_per_s"): least_bytes[k] / s / 1e12 for k, s in times.items()}}
        print(preset, name, row[name], flush=True)
    # a micro-batch's passes over all blocks, fused against compiled
    per_pass = {k: row["compiled"][k] - row["fused"][k] for k in least_bytes}
    row["saved_per_micro_batch_s"] = spec.num_layers * sum(per_pass.values())
    x = gate_up.detach().requires_grad_()
    out = fused.swiglu(x)
    (grad_fused,) = torch.autograd.grad(out, x, grad)
    row["max_abs_error"] = {"forward": (out - fused.swiglu_reference(gate_up)).abs().max().item(),
                            "backward": (grad_fused - fused.swiglu_backward_reference(grad, gate_up)).abs().max().item()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    results = {"swiglu": {preset: swiglu_row(preset, sequences, args.repeats) for preset, sequences in SHAPES.items()}}
    print(f"wrote {write_result(f'fused_kernels-{gpu_tag()}.json', results)}")


if __name__ == "__main__":
    main()
