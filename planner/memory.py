"""Bytes of one training step, by category, on one GPU and in the host memory of one node.

Counts follow the exact tensors fastml's executor keeps (executor/model.py, executor/optim.py), for every knob of
the plan, including knobs the executor does not run yet. Sources:
- model states: mixed-precision Adam keeps bf16 weights (2 B) and gradients (2 B), fp32 master weights (4 B) and
  Adam m and v (4 B each) per parameter: 16 B, of which ZeRO stages 1/2/3 shard the last 12, then the gradients,
  then the weights over the data-parallel GPUs (Rajbhandari et al. 2020, "ZeRO", section 3.1 and figure 1);
- activations: the tensors autograd saves per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation",
  section 4.1, recounted for our model: fused qkv, SwiGLU, grouped-query attention, flash attention that keeps
  only its output and log-sum-exp instead of the s x s score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastml.plan import MEMORY_CATEGORIES, Knobs
from fastml.spec import ModelSpec

BF16_BYTES = 2
FP32_BYTES = 4
# Host memory of one training process besides the tensors counted here (CUDA context, torch, data loader).
PROCESS_HOST_BYTES = 2 * 2**30
# Layers whose weights, gradients or activations travel between host and GPU are double-buffered on the GPU.
STREAM_BUFFER_LAYERS = 2


@dataclass(frozen=True)
class Memory:
    gpu: dict[str, int]
    """One GPU at its peak, by category."""
    host: dict[str, int]
    """One node's host memory, by category."""

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def saved_elements_per_token(spec: ModelSpec, recompute: tuple[str, ...]) -> dict[str, float]:
    """Elements autograd keeps per token in one block between its forward and backward pass, by tensor.

    Activation-sized tensors count in elements of the activation dtype; the fp32 statistics (norm rstd, attention
    log-sum-exp) are given in activation-dtype elements too (x2 for bf16, so they are exact for bf16)."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    if "block" in recompute:
        return {"block.input": h}
    rstd = 2.0  # one fp32 per token = two bf16 elements
    saved = {
        "attn_norm.input": h, "attn_norm.rstd": rstd, "qkv.input": h,
        "qkv.output": q + 2 * kv,  # v is a view of it and SDPA keeps v, so the whole buffer stays
        "rope.output": q + kv, "sdpa.output": q, "sdpa.lse": rstd * spec.num_heads, "out.input": q,
        "ffn_norm.input": h, "ffn_norm.rstd": rstd, "gate_up.input": h,
        "gate_up.output": 2 * f,  # silu keeps the gate half, the product the up half
        "silu.output": f, "down.input": f,
    }
    if spec.qk_norm:
        saved["qk_norm.rstd"] = rstd * (spec.num_heads + spec.num_kv_heads)
    if "norm" in recompute:  # a recomputed norm keeps its input; its output is kept by the next matmul anyway
        for name in ("attn_norm.rstd", "ffn_norm.rstd", "qk_norm.rstd"):
            saved.pop(name, None)
    if "attention" in recompute:  # keeps its inputs (q, k, v) and drops the rotated copies and SDPA's state
        for name in ("rope.output", "sdpa.output", "sdpa.lse"):
            saved.pop(name)
        if spec.qk_norm:
            saved["qk_norm.output"] = q + kv
    if "swiglu" in recompute:
        saved.pop("silu.output")
    if "ffn" in recompute:  # keeps its input only (= gate_up.input)
        for name in ("gate_up.output", "silu.output", "down.input"):
            saved.pop(name, None)
    # "qkv" keeps the projection's input, which the matmul keeps anyway: it saves nothing in this model.
    return saved


def layer_activation_bytes(spec: ModelSpec, recompute: tuple[str, ...], tokens: int, act_bytes: int,
                           matmul_dtype: str = "bf16") -> int:
    saved = saved_elements_per_token(spec, recompute)
    if matmul_dtype == "fp8":  # matmul inputs are kept in fp8 for the backward pass: half the bytes
        for name in ("qkv.input", "out.input", "gate_up.input", "down.input"):
            if name in saved:
                saved[name] /= 2
    return int(sum(saved.values()) * tokens * act_bytes)


def loss_workspace_bytes(spec: ModelSpec, tokens: int, num_chunks: int) -> int:
    """The LM head and cross-entropy of one slice of tokens: fp32 logits, fp32 log-probabilities and their
    gradients coexist for a moment in the backward pass (12 B per logit); with chunks only one slice exists."""
    return 3 * FP32_BYTES * spec.vocab_size * -(-tokens // num_chunks)


def model_state_bytes(num_params: int, knobs: Knobs, num_gpus: int) -> dict[str, float]:
    """Weights, master weights, gradients and optimizer states of one GPU, before any offload (ZeRO's model)."""
    def shard(flag: bool) -> int:
        return num_gpus if flag else 1
    master = FP32_BYTES if knobs.master_dtype == "fp32" else 0  # bf16 master: the weights themselves, rounded
    states = 2 * (FP32_BYTES if knobs.optimizer_dtype == "fp32" else BF16_BYTES)
    return {
        "weights": num_params * BF16_BYTES / shard(knobs.shard_weights),
        "gradients": num_params * BF16_BYTES / shard(knobs.shard_gradients),
        "master_weights": num_params * master / shard(knobs.shard_optimizer),
        "optimizer_states": num_params * states / shard(knobs.shard_optimizer),
    }


def memory(spec: ModelSpec, seq_len: int, knobs: Knobs, num_gpus: int, gpus_per_node: int,
           act_bytes: int = BF16_BYTES) -> Memory:
    """Peak bytes on one GPU, and host bytes of one node, for training `spec` with `knobs`."""
    layer_params = spec.layer_params()
    states = model_state_bytes(spec.num_params(), knobs, num_gpus)
    offloaded = {"weights": knobs.offload_weights, "gradients": knobs.offload_gradients,
                 "master_weights": knobs.offload_master, "optimizer_states": knobs.offload_optimizer}
    gpu = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    host = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    for category, total in states.items():
        on_host = total * offloaded[category]
        gpu[category] = total - on_host
        host[category] = on_host * gpus_per_node
    streamed_layer = layer_params * BF16_BYTES
    if knobs.offload_weights or knobs.shard_weights:
        gpu["weights"] += STREAM_BUFFER_LAYERS * streamed_layer
    if knobs.offload_gradients:
        gpu["gradients"] += STREAM_BUFFER_LAYERS * streamed_layer
    if knobs.cache_weights_on_host and knobs.shard_weights:
        host["weights"] += spec.num_params() * BF16_BYTES  # one full copy per node, shared by its GPUs

    tokens = knobs.micro_batch_size * seq_len
    layer_act = layer_activation_bytes(spec, knobs.recompute, tokens, act_bytes, knobs.matmul_dtype)
    offloaded_layers = round(knobs.offload_residuals * spec.num_layers)
    resident_layers = spec.num_layers - offloaded_layers + min(offloaded_layers, STREAM_BUFFER_LAYERS)
    # A recomputed layer rebuilds all its activations during its backward pass: one layer's worth at a time.
    rebuilt = layer_activation_bytes(spec, (), tokens, act_bytes, knobs.matmul_dtype) if knobs.recompute else 0
    head_input = tokens * spec.hidden_size * act_bytes * 2  # final norm input and LM-head input
    gpu["activations"] = resident_layers * layer_act + rebuilt + head_input
    host["activations"] = offloaded_layers * layer_act * gpus_per_node

    backward_workspace = loss_workspace_bytes(spec, tokens, knobs.lm_head_chunks)
    if knobs.matmul_dtype == "fp8":
        backward_workspace += spec.layer_matmul_params()  # one layer's weights cast to fp8
    # The optimizer steps one parameter group at a time (executor/optim.py: a block, the embedding or the LM head),
    # making fp32 gradients for that group only.
    largest_group = max(layer_params, spec.vocab_size * spec.hidden_size)
    gpu_steps = knobs.master_dtype == "fp32" and knobs.offload_optimizer < 1  # else no fp32 gradients on the GPU
    optimizer_workspace = FP32_BYTES * largest_group if gpu_steps else 0
    # The optimizer runs after the backward pass has freed the activations: the larger phase sets the peak.
    if optimizer_workspace > gpu["activations"] + backward_workspace:
        gpu["activations"], backward_workspace = 0.0, optimizer_workspace
    gpu["workspace"] = backward_workspace
    host["workspace"] = PROCESS_HOST_BYTES * gpus_per_node
    if num_gpus > 1:
        gpu["comm_buffers"] = STREAM_BUFFER_LAYERS * streamed_layer
        if knobs.comm == "memcpy":  # pinned host staging for the host-routed collectives
            host["comm_buffers"] = STREAM_BUFFER_LAYERS * streamed_layer * gpus_per_node
    return Memory(gpu={k: int(v) for k, v in gpu.items()}, host={k: int(v) for k, v in host.items()})
