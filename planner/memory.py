"""Bytes of one training step, by category, on one GPU and in the host memory of one node.

Counts follow the exact tensors fastml's executor keeps (executor/model.py, executor/optim.py), for every knob of
the plan, including knobs the executor does not run yet, in the dtypes the knobs name. Sources:
- model states: mixed-precision Adam keeps bf16 weights (2 B) and gradients (2 B), fp32 master weights (4 B) and
  Adam m and v (4 B each) per parameter: 16 B, of which ZeRO stages 1/2/3 shard the last 12, then the gradients,
  then the weights over the data-parallel GPUs (Rajbhandari et al. 2020, "ZeRO", section 3.1 and figure 1); fp32
  parameters (CPU training) are their own masters: 4 + 4 + 8 = 16 B too, none of it master copies;
- activations: the tensors autograd saves per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation",
  section 4.1, recounted for our model: fused qkv, SwiGLU, grouped-query attention, a fused attention kernel that
  keeps only its output and log-sum-exp instead of the s x s score matrix). tests/test_planner_vs_model.py measures
  them with saved-tensor hooks: exact on CPU in fp32, and on an H200 in bf16 (2026-11-30) exact but for 16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fastml.plan import MEMORY_CATEGORIES, Knobs
from fastml.spec import ModelSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
FP32_BYTES = DTYPE_BYTES["fp32"]
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


def param_bytes(knobs: Knobs) -> int:
    """Bytes of one parameter in the model, and of its gradient."""
    return DTYPE_BYTES[knobs.param_dtype]


def activation_bytes(knobs: Knobs) -> int:
    """Bytes of one activation element: the model computes in its parameters' dtype (fp8 matmuls read bf16
    activations and write bf16 outputs)."""
    return DTYPE_BYTES[knobs.param_dtype]


def has_fp32_masters(knobs: Knobs) -> bool:
    """Whether the optimizer keeps fp32 copies of the parameters: only of low-precision ones (fp32 parameters are
    their own masters)."""
    return knobs.param_dtype != "fp32" and knobs.master_dtype == "fp32"


def saved_bytes_per_token(spec: ModelSpec, knobs: Knobs, device: str) -> dict[str, float]:
    """Bytes autograd keeps per token in one block between its forward and backward pass, by tensor (counted
    once per storage: a view keeps its whole base), for the knobs' recompute parts and dtypes, on `device`.

    Measured against the executor's model with saved-tensor hooks in tests/test_planner_vs_model.py."""
    if "block" in knobs.recompute:
        return {"block.input": spec.hidden_size * activation_bytes(knobs)}
    saved = {name: n * activation_bytes(knobs) for name, n in _saved_activations(spec, knobs.recompute).items()}
    if "attention" not in knobs.recompute:
        saved["sdpa.lse"] = spec.num_heads * FP32_BYTES  # the log-sum-exp of each head's softmax
    if "norm" not in knobs.recompute:  # a recomputed norm keeps its input only
        saved |= _norm_statistics(spec, device)
    if knobs.matmul_dtype == "fp8":  # not run yet: matmul inputs kept in fp8 for the backward pass
        for name in ("qkv.input", "gate_up.input", "down.input"):
            if name in saved:
                saved[name] *= DTYPE_BYTES["fp8"] / activation_bytes(knobs)
    return saved


def _saved_activations(spec: ModelSpec, recompute: tuple[str, ...]) -> dict[str, int]:
    """The activation-dtype tensors one block keeps, in elements per token."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    saved = {
        "attn_norm.input": h, "qkv.input": h,  # the norm's output is the matmul's input
        "qkv.output": q + 2 * kv,  # v is a view of it and SDPA keeps v, so the whole buffer stays
        "rope.output": q + kv,  # SDPA keeps its rotated q and k
        # SDPA returns its output as a transposed view of a (B, T, H, D) buffer, so the out projection's input
        # (its transpose, flattened) is the same storage: counted once.
        "attention.output": q,
        "ffn_norm.input": h, "gate_up.input": h,
        "gate_up.output": 2 * f,  # silu keeps the gate half, the product the up half
        "silu.output": f, "down.input": f,
    }
    if "attention" in recompute:  # keeps its inputs (q, k, v) and output, drops the rotated copies
        saved.pop("rope.output")
        if spec.qk_norm:
            saved["qk_norm.output"] = q + kv
    if "swiglu" in recompute:
        saved.pop("silu.output")
    if "ffn" in recompute:  # keeps its input only (= gate_up.input)
        for name in ("gate_up.output", "silu.output", "down.input"):
            saved.pop(name, None)
    # "qkv" keeps the projection's input, which the matmul keeps anyway: it saves nothing in this model.
    return saved


def _norm_statistics(spec: ModelSpec, device: str) -> dict[str, int]:
    """F.rms_norm keeps its input (counted with the activations) and the fp32 inverse RMS of each row. On CPU torch
    runs the composite rms_norm, whose multiplication by the weight also keeps the normalized input in fp32 for the
    weight's gradient; CUDA's fused kernel does not (both measured in tests/test_planner_vs_model.py). The qk-norms
    normalize each head of q and k; their inputs are views of the qkv buffer."""
    h, heads = spec.hidden_size, spec.num_heads + spec.num_kv_heads
    norms = {"attn_norm": (h, 1), "ffn_norm": (h, 1)}
    if spec.qk_norm:
        norms["qk_norm"] = (spec.q_size + spec.kv_size, heads)
    saved = {}
    for name, (width, rows) in norms.items():
        saved[f"{name}.rstd"] = rows * FP32_BYTES
        if device == "cpu":
            saved[f"{name}.normalized"] = width * FP32_BYTES
    return saved


def layer_activation_bytes(spec: ModelSpec, knobs: Knobs, tokens: int, device: str) -> int:
    """Bytes one block keeps for its backward pass, for `tokens` tokens (a micro-batch)."""
    return int(sum(saved_bytes_per_token(spec, knobs, device).values()) * tokens)


def loss_tensor_bytes(knobs: Knobs) -> dict[str, int]:
    """The (tokens x vocab) tensors of the executor's LM head and loss (executor/model.py `_lm_loss_sum`), in the
    order forward and backward make them, in bytes per logit: the matmul's logits in the activation dtype, their
    fp32 copy (`.float()`, none when they are fp32 already), cross-entropy's log-softmax (kept for the backward
    pass), then the gradients: of the log-probabilities (nll_loss backward), of the fp32 logits (log-softmax
    backward) and their cast back to the activation dtype for the matmul's backward. Checked op by op against the
    real loss in tests/test_planner_vs_model.py."""
    act = activation_bytes(knobs)
    upcast = act != FP32_BYTES
    tensors = {"logits": act, "logits.fp32": FP32_BYTES if upcast else 0, "log_probs": FP32_BYTES,
               "grad.log_probs": FP32_BYTES, "grad.logits.fp32": FP32_BYTES, "grad.logits": act if upcast else 0}
    return {name: num_bytes for name, num_bytes in tensors.items() if num_bytes}


# Of the tensors above, those alive at once at the loss's peak: log-softmax backward reads the kept log-probs and
# their gradient and writes the logits' gradient (the forward pass peaks lower: logits and their fp32 copy, or the
# fp32 copy and the log-probs).
LOSS_PEAK_TENSORS = ("log_probs", "grad.log_probs", "grad.logits.fp32")


def loss_workspace_bytes(spec: ModelSpec, knobs: Knobs, tokens: int) -> int:
    """Peak bytes of the LM head and cross-entropy of one slice of tokens (LOSS_PEAK_TENSORS); with chunks only
    one slice exists at a time."""
    per_logit = sum(loss_tensor_bytes(knobs)[name] for name in LOSS_PEAK_TENSORS)
    return per_logit * spec.vocab_size * -(-tokens // knobs.lm_head_chunks)


def model_state_bytes(num_params: int, knobs: Knobs, num_gpus: int) -> dict[str, float]:
    """Weights, master weights, gradients and optimizer states of one GPU, before any offload (ZeRO's model):
    weights and gradients in the parameters' dtype, fp32 masters only of low-precision parameters (bf16 masters are
    the weights themselves, stochastically rounded), Adam's m and v in the optimizer dtype."""
    def shard(flag: bool) -> int:
        return num_gpus if flag else 1
    master = FP32_BYTES if has_fp32_masters(knobs) else 0
    return {
        "weights": num_params * param_bytes(knobs) / shard(knobs.shard_weights),
        "gradients": num_params * param_bytes(knobs) / shard(knobs.shard_gradients),
        "master_weights": num_params * master / shard(knobs.shard_optimizer),
        "optimizer_states": num_params * 2 * DTYPE_BYTES[knobs.optimizer_dtype] / shard(knobs.shard_optimizer),
    }


def head_activation_bytes(spec: ModelSpec, knobs: Knobs, tokens: int, device: str) -> int:
    """What the final norm and the LM head keep for the backward pass: the norm's input, its output (the LM head's
    input) and its statistics, as for a block's norms (`saved_bytes_per_token`)."""
    per_token = 2 * spec.hidden_size * activation_bytes(knobs) + FP32_BYTES
    if device == "cpu":
        per_token += spec.hidden_size * FP32_BYTES
    return per_token * tokens


def memory(spec: ModelSpec, seq_len: int, knobs: Knobs, num_gpus: int, gpus_per_node: int,
           device: str) -> Memory:
    """Peak bytes on one GPU (or the CPU's memory for `device` "cpu"), and host bytes of one node, for training
    `spec` with `knobs`."""
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
    streamed_layer = layer_params * param_bytes(knobs)
    if knobs.offload_weights or knobs.shard_weights:
        gpu["weights"] += STREAM_BUFFER_LAYERS * streamed_layer
    if knobs.offload_gradients:
        gpu["gradients"] += STREAM_BUFFER_LAYERS * streamed_layer
    if knobs.cache_weights_on_host and knobs.shard_weights:
        host["weights"] += spec.num_params() * param_bytes(knobs)  # one full copy per node, shared by its GPUs

    tokens = knobs.micro_batch_size * seq_len
    layer_act = layer_activation_bytes(spec, knobs, tokens, device)
    offloaded_layers = round(knobs.offload_residuals * spec.num_layers)
    resident_layers = spec.num_layers - offloaded_layers + min(offloaded_layers, STREAM_BUFFER_LAYERS)
    # A recomputed layer rebuilds all its activations during its backward pass: one layer's worth at a time.
    rebuilt = layer_activation_bytes(spec, replace(knobs, recompute=()), tokens, device) if knobs.recompute else 0
    gpu["activations"] = resident_layers * layer_act + rebuilt + head_activation_bytes(spec, knobs, tokens, device)
    host["activations"] = offloaded_layers * layer_act * gpus_per_node

    backward_workspace = loss_workspace_bytes(spec, knobs, tokens)
    if knobs.matmul_dtype == "fp8":
        backward_workspace += spec.layer_matmul_params() * DTYPE_BYTES["fp8"]  # one layer's weights cast to fp8
    # The optimizer steps one parameter group at a time (executor/optim.py: a block, the embedding or the LM head),
    # making fp32 gradients for that group only, and only of low-precision parameters stepped on the GPU.
    largest_group = max(layer_params, spec.vocab_size * spec.hidden_size)
    gpu_steps = has_fp32_masters(knobs) and knobs.offload_optimizer < 1
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
