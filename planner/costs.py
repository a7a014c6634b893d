"""Durations of the operations of a training step on one GPU: compute as a roofline over the profile's measured
GEMM efficiency curve and memory bandwidth, transfers and collectives as bytes over the profile's rates.

Sources: FLOPs of a matmul, 2mnk, and of causal attention, 2·s²·d per head forward with backward 2.5 times
the forward (Dao 2023, "FlashAttention-2", section 4.1: backward does 5 matmuls against forward's 2); collectives
as ring algorithms, time = α + bytes·(n-1)/n / bus bandwidth for reduce-scatter and all-gather and twice that for
all-reduce (NCCL's bus-bandwidth convention, nccl-tests doc/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastml.plan import Knobs
from fastml.planner.hardware import Machine
from fastml.planner.memory import BF16_BYTES, layer_activation_bytes
from fastml.spec import ModelSpec

ATTENTION_BACKWARD_FACTOR = 2.5
# AdamW per parameter (executor/optim.py): read the bf16 gradient (2) and, with fp32 masters, write and read it in
# fp32 (8), read and write the master (8) and write the bf16 weight (2); with bf16 masters (the weights themselves)
# read and write the weight (4). Then read and write m and v: 16 bytes in fp32, 8 in bf16.
MASTER_STEP_BYTES = {"fp32": 2 + 8 + 8 + 2, "bf16": 2 + 4}
STATE_STEP_BYTES = {"fp32": 16, "bf16": 8}


@dataclass(frozen=True)
class Costs:
    """Seconds of each operation kind for one micro-batch (per layer where it says so) on one GPU."""

    layer_forward: float
    layer_backward: float
    layer_recompute: float
    head_forward_backward: float
    grad_accumulate: float
    """Adding a micro-batch's bf16 gradients to the accumulated ones (all micro-batches after the first)."""
    gpu_optimizer: float
    """The optimizer step of the parameters that stay on the GPU, and gradient clipping."""
    cpu_optimizer_layer: float
    """CPU Adam over one layer's offloaded optimizer share."""
    layer_weights_h2d: float
    layer_master_transfer: float
    """One layer's fp32 master weights (or Adam states) crossing PCIe one way, for an optimizer step that runs
    where they are not."""
    layer_grads_d2h: float
    layer_activations_transfer: float
    layer_weight_gather: float
    layer_grad_reduce: float
    """Per layer: reduce-scatter (sharded gradients, every micro-batch) or all-reduce (last micro-batch only)."""
    step_weight_gather: float
    """All-gather of the updated weights after a sharded optimizer step (ZeRO 1/2 without weight sharding)."""


def costs(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Costs:
    gpu = machine.gpu
    t = knobs.micro_batch_size * seq_len
    dtype = knobs.matmul_dtype

    def gemms(*shapes) -> float:
        return sum(gpu.gemm_seconds(t, n, k, dtype) for n, k in shapes)

    def hbm(num_bytes: float) -> float:
        return num_bytes / gpu.hbm_bytes_per_s

    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    qkv, out, gate_up, down = (q + 2 * kv, h), (h, q), (2 * f, h), (h, f)
    attention = _attention_forward_s(spec, knobs.micro_batch_size, seq_len, machine, dtype)
    elementwise = hbm(_elementwise_elements(spec, knobs.compile) * t * BF16_BYTES)
    forward = gemms(qkv, out, gate_up, down) + attention + elementwise
    backward = 2 * gemms(qkv, out, gate_up, down) + ATTENTION_BACKWARD_FACTOR * attention + 2 * elementwise
    recompute = _recompute_s(knobs.recompute, forward, gemms(gate_up, down), gemms(qkv), attention, elementwise)
    head = 3 * gemms((spec.vocab_size, h)) + (gemms((spec.vocab_size, h)) if knobs.lm_head_chunks > 1 else 0)
    head += hbm(20 * t * spec.vocab_size)  # bf16 and fp32 logits, log-softmax, their gradients

    p = spec.num_params()
    layer_params = spec.layer_params()
    layer_bytes = layer_params * BF16_BYTES
    on_gpu = 1 - knobs.offload_optimizer
    shard = machine.num_gpus if knobs.shard_optimizer else 1
    step_bytes = MASTER_STEP_BYTES[knobs.master_dtype] + STATE_STEP_BYTES[knobs.optimizer_dtype]
    optimizer = hbm(p * on_gpu / shard * step_bytes + p * BF16_BYTES)
    layer_act = layer_activation_bytes(spec, knobs.recompute, t, BF16_BYTES, dtype)
    return Costs(
        layer_forward=forward, layer_backward=backward, layer_recompute=recompute, head_forward_backward=head,
        grad_accumulate=hbm(2 * p * BF16_BYTES / (machine.num_gpus if knobs.shard_gradients else 1)),
        gpu_optimizer=optimizer,
        cpu_optimizer_layer=layer_params / shard / machine.node.cpu_adam_params_per_s,
        layer_weights_h2d=layer_bytes / machine.h2d_bytes_per_s(),
        layer_master_transfer=layer_params * 4 / shard / machine.h2d_bytes_per_s(),
        layer_grads_d2h=layer_bytes / machine.d2h_bytes_per_s(),
        layer_activations_transfer=layer_act / machine.d2h_bytes_per_s(),
        layer_weight_gather=collective_s("all_gather", layer_bytes, machine, knobs.comm),
        layer_grad_reduce=collective_s("reduce_scatter" if knobs.shard_gradients else "all_reduce", layer_bytes,
                                       machine, knobs.comm),
        step_weight_gather=collective_s("all_gather", p * BF16_BYTES, machine, knobs.comm),
    )


def collective_s(kind: str, num_bytes: float, machine: Machine, comm: str) -> float:
    """A collective over all GPUs of `num_bytes` (the full, unsharded size)."""
    n = machine.num_gpus
    if n == 1:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather
    moved = passes * num_bytes * (n - 1) / n
    if comm == "memcpy":
        # Host-routed: each GPU's share goes down to pinned host memory and back up on the copy engines, the two
        # directions overlapping, and the host adds the pieces of a reduction.
        host_reduce = moved / machine.node.host_copy_bytes_per_s if kind != "all_gather" else 0.0
        return machine.collective_latency_s + max(moved / machine.d2h_bytes_per_s(),
                                                  moved / machine.h2d_bytes_per_s(), host_reduce)
    bandwidth = machine.bus_bytes_per_s[kind]
    if machine.num_nodes > 1:  # a ring across nodes runs at the slower of the links it crosses
        bandwidth = min(bandwidth, machine.node.nic_bytes_per_s / machine.gpus_per_node)
    return machine.collective_latency_s * (2 if machine.num_nodes > 1 else 1) + moved / bandwidth


def _attention_forward_s(spec: ModelSpec, micro_batch_size: int, seq_len: int, machine: Machine,
                         dtype: str) -> float:
    flops = 2.0 * micro_batch_size * seq_len * seq_len * spec.q_size  # causal: half of 4·s²·d per head
    # Flash attention runs all heads and sequences at once: as efficient as one GEMM of (tokens x heads) rows,
    # seq_len columns and head_dim depth.
    size = (micro_batch_size * seq_len * spec.num_heads * seq_len * spec.head_dim) ** (1 / 3)
    return flops / (machine.gpu.peak_flops_for(dtype) * machine.gpu.gemm_efficiency_at(size))


def _elementwise_elements(spec: ModelSpec, compiled: bool) -> float:
    """Elements read and written per token by one block's forward pass outside its matmuls and attention:
    norms, rotary embedding, SwiGLU, residual adds and the head-merging copy. Compilation fuses chains of them
    into single passes."""
    h, qk, q, f = spec.hidden_size, spec.q_size + spec.kv_size, spec.q_size, spec.ffn_hidden_size
    if compiled:
        return 4 * h + 2 * qk + 2 * q + 3 * f
    return 10 * h + 8 * qk + 2 * q + 5 * f


def _recompute_s(parts: tuple[str, ...], forward: float, ffn: float, qkv: float, attention: float,
                 elementwise: float) -> float:
    if "block" in parts:
        return forward
    share = {"norm": 0.15, "swiglu": 0.3, "attention": 0.3}  # rough shares of the elementwise traffic
    seconds = sum(elementwise * share[p] for p in parts if p in share)
    if "ffn" in parts:
        seconds += ffn + (0 if "swiglu" in parts else elementwise * share["swiglu"])
    if "attention" in parts:
        seconds += attention
    if "qkv" in parts:
        seconds += qkv
    return seconds

