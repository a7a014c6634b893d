"""Bytes of one training step, by category, on one GPU and in the host memory of one node.

Counts follow the exact tensors fastml's executor keeps (executor/model/transformer.py, executor/memory/optim.py), for every knob of
the plan, including knobs the executor does not run yet, in the dtypes the knobs name. Sources:
- model states: mixed-precision Adam keeps bf16 weights (2 B) and gradients (2 B), fp32 master weights (4 B) and
  Adam m and v (4 B each) per parameter: 16 B, of which ZeRO stages 1/2/3 shard the last 12, then the gradients,
  then the weights over the data-parallel GPUs (Rajbhandari et al. 2020, "ZeRO", section 3.1 and figure 1); fp32
  parameters (CPU training) are their own masters: 4 + 4 + 8 = 16 B too, none of it master copies;
- offload: each parameter group (the embedding, each block, the final norm with the LM head) keeps each of its
  tensors on the GPU or the host as fastml.plan.offloaded_groups says, and what streams between them is on the GPU
  for the block that computes and the one fetched beside it (`Placement`, `_phases`); the executor's offload holds
  exactly these;
- activations: the tensors autograd saves per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation",
  section 4.1, recounted for our model: fused qkv, SwiGLU, grouped-query attention, a fused attention kernel that
  keeps only its output and log-sum-exp instead of the s x s score matrix). tests/test_planner_vs_model.py measures
  them with saved-tensor hooks: exact on CPU in fp32, and on an H200 in bf16 (2026-11-30) exact but for 16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fastml.plan import (CPU_STEP_CHUNK, MEMCPY_ROW_BYTES, MEMCPY_SLOTS, MEMORY_CATEGORIES, REDUCTIONS_IN_FLIGHT,
                         STAGING_SLOTS, Knobs, block_group, fp8_cached_blocks, master_streamed_groups,
                         offloaded_groups, shared_weight_groups, weights_sharded)
from fastml.hwprofiles.schema import Calibration
from fastml.spec import ModelSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
FP32_BYTES = DTYPE_BYTES["fp32"]
# Host memory of one training process besides the tensors counted here (CUDA context, torch, data loader).
PROCESS_HOST_BYTES = 2 * 2**30
CPU_PROCESS_HOST_BYTES = 2**29
"""The same for a process training on a CPU (no CUDA context): `fastml run` of the default tiny plan on a 2-core AMD
EPYC with torch 2.13 (2026-12-02) peaked at 0.93 GiB resident (one process) and 0.95 GiB (each of two), beside 0.43
and 0.45 GiB of the tensors counted here; torch and fastml imported hold 0.3 GiB of it."""
# Blocks whose weights, gradients or inputs travel between host and GPU are on the GPU two at a time: the one that
# computes, and the next one, fetched meanwhile (executor/memory/placement.py).
STREAM_BUFFER_LAYERS = 2


@dataclass(frozen=True)
class Memory:
    gpu: dict[str, int]
    """One GPU by category, in the terms the run measures them (executor/loop/meter.py `gpu_memory`), so that the
    closing table compares like with like: the model states with every gradient made, the activations a micro-batch's
    forward pass leaves (the head weight's gradient, which the loss makes there, with them), and workspace the rest of
    the peak (the collectives' buffers with it: the meter lists none). Not all of those are alive at once (a first
    micro-batch's backward pass frees activations as it makes gradients): where they add up to more than the peak,
    workspace is 0."""
    host: dict[str, int]
    """One node's host memory, by category."""
    gpu_peak: int
    """One GPU's peak: the bytes of the phase of the step where they add up to most (`_phases`)."""
    peak_phase: dict[str, int]
    """That phase's bytes by category: what is alive at the peak."""

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


def compensation_bytes(knobs: Knobs) -> int:
    """Bytes a parameter of master_dtype "bf16_kahan" keeps beside Adam's m and v: its bf16 compensation."""
    return DTYPE_BYTES["bf16"] if knobs.master_dtype == "bf16_kahan" else 0


def has_fp32_masters(knobs: Knobs) -> bool:
    """Whether the optimizer keeps fp32 copies of the parameters: only of low-precision ones (fp32 parameters are
    their own masters)."""
    return knobs.param_dtype != "fp32" and knobs.master_dtype == "fp32"


def saved_bytes_per_token(spec: ModelSpec, knobs: Knobs, device: str) -> dict[str, float]:
    """Bytes autograd keeps per token in one block between its forward and backward pass, by tensor (counted
    once per storage: a view keeps its whole base), for the knobs' recompute parts and dtypes, on `device`.

    Measured against the executor's model with saved-tensor hooks in tests/test_planner_vs_model.py."""
    if "block" in knobs.recompute:
        return {"block.input": block_input_bytes(spec, knobs, 1)}
    saved = {name: n * activation_bytes(knobs) for name, n in _saved_activations(spec, knobs.recompute).items()}
    if "attention" not in knobs.recompute:
        saved["sdpa.lse"] = spec.num_heads * FP32_BYTES  # the log-sum-exp of each head's softmax
    if "norm" not in knobs.recompute:  # a recomputed norm keeps its input only
        saved |= _norm_statistics(spec, device)
    if knobs.matmul_dtype == "fp8":
        saved |= _fp8_saved(spec, knobs, saved)
    if knobs.sequence_parallel:  # each tensor-parallel GPU keeps its slice of the sequence of what is hidden wide
        saved |= {name: saved[name] / knobs.tensor_parallel for name in SEQUENCE_PARALLEL_SAVED if name in saved}
    return saved


SEQUENCE_PARALLEL_SAVED = ("attn_norm.input", "attn_norm.rstd", "attn_norm.normalized", "qkv.input", "ffn_norm.input",
                           "ffn_norm.rstd", "ffn_norm.normalized", "gate_up.input")
"""What sequence parallelism splits among the tensor-parallel GPUs: the norms' tensors and the column-parallel
matmuls' inputs, which it gathers again for the backward pass (Korthikanti et al. 2022, section 4.2.2)."""


def _fp8_saved(spec: ModelSpec, knobs: Knobs, saved: dict[str, float]) -> dict[str, float]:
    """What fp8 linears change (executor/model/fp8.py): each keeps the fp8 transpose of its input (1 byte an element) for
    its weight gradient instead of the bf16 input; a checkpointed linear's input the checkpoint keeps, in bf16. The out
    projection's input is SDPA's output, which SDPA keeps too unless attention is recomputed."""
    fp8, checkpointed = DTYPE_BYTES["fp8"] / activation_bytes(knobs), {"qkv": "qkv", "gate_up": "ffn"}
    changed = {name: saved[name] * fp8 for name in ("qkv.input", "gate_up.input", "down.input")
               if name in saved and checkpointed.get(name.split(".")[0]) not in knobs.recompute}
    if "attention" in knobs.recompute:
        changed["attention.output"] = saved["attention.output"] * fp8
    else:
        changed["out.input"] = spec.q_size * DTYPE_BYTES["fp8"]
    return changed


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
        "gate_up.output": 2 * f,  # the fused SwiGLU keeps its input (fused.py; in fp8, FP8FeedForwardFunction)
        "down.input": f,
    }
    if "attention" in recompute:  # keeps its inputs (q, k, v) and output, drops the rotated copies
        saved.pop("rope.output")
        if spec.qk_norm:
            saved["qk_norm.output"] = q + kv
    if "ffn" in recompute:  # keeps its input only (= gate_up.input)
        for name in ("gate_up.output", "down.input"):
            saved.pop(name)
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


def weight_gradient_inputs_bytes(spec: ModelSpec, knobs: Knobs, tokens: int) -> int:
    """Bytes one block keeps from a backward pass that makes its input's gradient alone to the pass that makes its
    weights' (a zero-bubble pipeline schedule: executor/model/deferred.py): each linear's input and its output's
    gradient, for `tokens` tokens. The rest of its activations are freed by then."""
    elements = sum(inputs + outputs for outputs, inputs in spec.block_linear_shapes().values())
    return elements * tokens * activation_bytes(knobs)


def loss_logit_bytes(knobs: Knobs, device: str) -> int:
    """Bytes a logit of the LM head takes in the loss (executor/model/loss.py), one slice of the tokens at a time:
    the matmul's logits in the activation dtype, which the loss's kernel overwrites with their gradient, and where
    they are narrower than float32, the float32 copy that the CPU's reference (fused.py) and, under tensor
    parallelism, the vocabulary-parallel cross-entropy (parallel/tensor.py) work in. Checked against the real loss's
    tensors in tests/test_planner_vs_model.py."""
    act = activation_bytes(knobs)
    in_float32 = device == "cpu" or knobs.tensor_parallel > 1
    return act + (FP32_BYTES if in_float32 and act < FP32_BYTES else 0)


def head_weight_gradient_bytes(spec: ModelSpec, knobs: Knobs) -> int:
    """Bytes of the LM head weight's gradient, which the loss makes in its forward pass (executor/model/loss.py)."""
    return spec.vocab_size * spec.hidden_size * param_bytes(knobs)


def loss_workspace_bytes(spec: ModelSpec, knobs: Knobs, tokens: int, device: str = "cuda") -> int:
    """Peak bytes of the LM head and cross-entropy of one micro-batch beside what the model counts elsewhere, in its
    forward pass, where it makes its gradients (executor/model/loss.py): one slice's logits, the head weight's
    gradient and the hidden states' (beside the hidden states, which the head's activations count: their gradient
    takes their place once the loss is made). Measured against the real loss on a GPU in
    tests/test_planner_vs_model.py. In a step's first micro-batch the weight's gradient becomes the head's gradient;
    from the second it is added into that (`_phases` counts the head's gradients at the loss accordingly)."""
    chunk = loss_logit_bytes(knobs, device) * spec.vocab_size * -(-tokens // knobs.lm_head_chunks)
    return chunk + head_weight_gradient_bytes(spec, knobs) + tokens * spec.hidden_size * activation_bytes(knobs)


def block_backward_workspace_bytes(spec: ModelSpec, knobs: Knobs, tokens: int) -> int:
    """What a block's backward pass makes beside what it keeps, for `tokens` tokens: the gradient it receives, and
    the larger of the SwiGLU input's gradient (two FFN widths a token, made while the FFN's saved tensors are still
    alive) and, at the pass's end, the layer's weight gradients beside its input's gradient made out of place
    (the residual's and the attention's summed). Measured on an H200 (2026-12-03), one block of qwen2.5-1.5b,
    llama-3.2-1b and llama-3.1-8b at 8-32k tokens, eager and compiled: 0.4-1.1 GiB, within 0.08 GiB of this, where
    a whole layer's activations (1.1-2.3 GiB), the estimate before, was up to twice too much."""
    act = activation_bytes(knobs)
    swiglu_input_gradient = 2 * spec.ffn_hidden_size * act * tokens
    at_the_end = spec.layer_params() * param_bytes(knobs) + 2 * spec.hidden_size * act * tokens
    return spec.hidden_size * act * tokens + max(swiglu_input_gradient, at_the_end)


def model_state_bytes(num_params: int, knobs: Knobs, num_gpus: int,
                      shard_weights: bool | None = None) -> dict[str, float]:
    """Weights, master weights, gradients and optimizer states of one GPU, before any offload (ZeRO's model):
    weights and gradients in the parameters' dtype, fp32 masters only of low-precision parameters (bf16 masters are
    the weights themselves, stochastically rounded or with a compensation kept with m and v), Adam's m and v in the
    optimizer dtype. `shard_weights` says
    whether these parameters' weights are sharded (default: knobs.shard_weights; fastml.plan.weights_sharded says
    which groups ZeRO-3 shards)."""
    def shard(flag: bool) -> int:
        return num_gpus if flag else 1
    master = FP32_BYTES if has_fp32_masters(knobs) else 0
    return {
        "weights": num_params * param_bytes(knobs) / shard(knobs.shard_weights if shard_weights is None
                                                           else shard_weights),
        "gradients": num_params * param_bytes(knobs) / shard(knobs.shard_gradients),
        "master_weights": num_params * master / shard(knobs.shard_optimizer),
        "optimizer_states": num_params * (2 * DTYPE_BYTES[knobs.optimizer_dtype] + compensation_bytes(knobs))
                            / shard(knobs.shard_optimizer),
    }


def head_activation_bytes(spec: ModelSpec, knobs: Knobs, tokens: int, device: str) -> int:
    """What the final norm and the LM head keep for the backward pass: the norm's input and its statistics, as for a
    block's norms (`saved_bytes_per_token`), and the gradient of its output (the LM head's input), which the loss
    makes in its forward pass (executor/model/loss.py)."""
    per_token = 2 * spec.hidden_size * activation_bytes(knobs) + FP32_BYTES
    if device == "cpu":
        per_token += spec.hidden_size * FP32_BYTES
    return per_token * tokens


def block_input_bytes(spec: ModelSpec, knobs: Knobs, tokens: int) -> int:
    """A block's input, the residual stream: what block recompute keeps, and what offload_residuals moves to the
    host (every recompute choice keeps it, as the first norm's input)."""
    whole = spec.hidden_size * activation_bytes(knobs) * tokens
    return whole // knobs.tensor_parallel if knobs.sequence_parallel else whole


def group_params(spec: ModelSpec) -> dict[str, int]:
    """Parameters of each parameter group (`fastml.plan.layer_of`), in model order: the embedding, the
    blocks, and the final norm with the LM head (the norm alone when the head is the tied embedding)."""
    embedding, block = spec.vocab_size * spec.hidden_size, spec.layer_params()
    groups = {"embed": embedding} | {block_group(i): block for i in range(spec.num_layers)}
    groups["head"] = spec.hidden_size + (0 if spec.tied_embeddings else embedding)
    return groups


@dataclass(frozen=True)
class Placement:
    """Which parameter groups keep what in host memory (fastml.plan.offloaded_groups), and so where each group's
    optimizer step runs and what crosses PCIe for it: the executor's offload."""

    knobs: Knobs
    streamed_weights: frozenset[str]
    host_gradients: frozenset[str]
    host_masters: frozenset[str]
    """Only of low-precision parameters: fp32 ones are their own masters, and bf16 masters are the weights."""
    cpu_steps: frozenset[str]
    """The groups whose Adam m and v live on the host: the CPU steps them."""
    host_inputs: frozenset[str]
    """The blocks whose input activations go to the host between forward and backward."""
    master_streamed: frozenset[str] = frozenset()
    """The streamed blocks whose host copy is the fp32 master (knobs.stream_masters): no bf16 copy beside it."""

    def master_on_host(self, group: str) -> bool:
        """Whether the weights the optimizer updates live on the host: the fp32 masters, or without them the
        weights themselves where they are streamed."""
        if has_fp32_masters(self.knobs):
            return group in self.host_masters
        return group in self.streamed_weights

    def gpu_step_workspace(self, group: str) -> int:
        """Per parameter, the temporary GPU buffers of a GPU step of `group`: its gradient in fp32 (the copy of a
        low-precision gradient, or the one fetched from the host) and its master where that lives on the host."""
        fp32_gradient = has_fp32_masters(self.knobs) or group in self.host_gradients
        return FP32_BYTES * fp32_gradient + (master_bytes(self.knobs) if self.master_on_host(group) else 0)

    def gpu_step_transfers(self, group: str) -> tuple[int, int]:
        """Per parameter, the bytes a GPU step of `group` fetches from the host (its gradient and master where they
        live there) and sends back after it (the updated master, and the rounded weights where they are streamed:
        the host holds their only copy)."""
        k = self.knobs
        master = master_bytes(k) if self.master_on_host(group) else 0
        gradient = param_bytes(k) if group in self.host_gradients else 0
        rounded = param_bytes(k) if has_fp32_masters(k) and group in self.streamed_weights else 0
        return gradient + master, master + rounded

    def cpu_step_transfers(self, group: str) -> tuple[int, int]:
        """Per parameter, the bytes a CPU step of `group` needs from the GPU (its gradient and master where they are
        there) and sends back to it (the master, and the new weights to their GPU copy: none where the weights are
        streamed, as the CPU writes the host copy itself)."""
        k = self.knobs
        master = 0 if self.master_on_host(group) else master_bytes(k)
        gradient = 0 if group in self.host_gradients else param_bytes(k)
        weights = param_bytes(k) if has_fp32_masters(k) and group not in self.streamed_weights else 0
        return gradient + master, master + weights

    def cpu_staged_bytes(self, group: str) -> int:
        """Per parameter, the pinned staging a CPU step of `group` passes its transfers through: what comes down
        and what goes back, a master that makes the round trip counted once (it is updated in place)."""
        down, up = self.cpu_step_transfers(group)
        return down + up - (0 if self.master_on_host(group) else master_bytes(self.knobs))


def placement(spec: ModelSpec, knobs: Knobs) -> Placement:
    def groups(name: str) -> frozenset[str]:
        return offloaded_groups(knobs, name, spec.num_layers)
    return Placement(knobs=knobs, streamed_weights=groups("offload_weights"),
                     host_gradients=groups("offload_gradients"),
                     host_masters=groups("offload_master") if has_fp32_masters(knobs) else frozenset(),
                     cpu_steps=groups("offload_optimizer"), host_inputs=groups("offload_residuals"),
                     master_streamed=master_streamed_groups(knobs, spec.num_layers))


def master_bytes(knobs: Knobs) -> int:
    """Bytes of the weight the optimizer updates, per parameter: the fp32 master, or the parameter itself."""
    return FP32_BYTES if has_fp32_masters(knobs) else param_bytes(knobs)


def memory(spec: ModelSpec, seq_len: int, knobs: Knobs, num_gpus: int, gpus_per_node: int,
           device: str, calibration: Calibration = Calibration()) -> Memory:
    """Peak bytes on one GPU (or the CPU's memory for `device` "cpu"), and host bytes of one node, for training
    `spec` with `knobs`: each parameter group's tensors where `Placement` puts them, as the executor holds them, at
    the phase of the step where they add up to most (`_phases`); then as the machine's `calibration` corrects the
    model (what a compiled block keeps, the allocator's fragmentation). The GPU's bytes by category are then set out
    as the run's meter measures them (`Memory.gpu`): the model states it lists (a sharded model's shards, not the
    whole groups gathered or reduced for a moment, nor the collectives' buffers, which it does not list), a forward
    pass's activations, and the rest of the peak as workspace. With ZeRO-3 the meter's forward pass also holds the
    gathered head's weights, which this counts as workspace."""
    place = placement(spec, knobs)
    gpu, host = model_states(spec, knobs, place, num_gpus)
    if knobs.matmul_dtype == "fp8":
        # Cached blocks keep their weights in fp8 and transposed (executor/model/fp8.py).
        cached = len(fp8_cached_blocks(knobs, spec.num_layers, num_gpus))
        gpu["weights"] += cached * spec.layer_matmul_params() * 2 * DTYPE_BYTES["fp8"]
    listed = dict(gpu)  # what the run's meter lists (executor/loop/meter.py): not the buffers of a moment below
    groups = group_params(spec)
    sharded = knobs.shard_weights and num_gpus > 1
    if sharded:  # the head's gathered weights live from the last block until their gradients are made
        gpu["weights"] += max(groups["embed"], groups["head"]) * param_bytes(knobs)
    if num_gpus > 1 and knobs.shard_gradients:  # a group's full gradients, from its backward pass to its reduction
        gpu["gradients"] += max(groups.values()) * param_bytes(knobs)
    elif num_gpus > 1 and knobs.shard_optimizer:  # ZeRO-1: offloaded blocks' reduced shards stay on the GPU
        gpu["gradients"] += len(place.host_gradients) * spec.layer_params() * param_bytes(knobs) / num_gpus
    tokens = knobs.micro_batch_size * seq_len
    host["activations"] = len(place.host_inputs) * block_input_bytes(spec, knobs, tokens)
    on_cpu = device == "cpu"
    host["workspace"] = (CPU_PROCESS_HOST_BYTES if on_cpu else PROCESS_HOST_BYTES) + \
        _cpu_staging_bytes(spec, knobs, place, num_gpus)
    if num_gpus > 1:
        # Each reduction in flight holds a group's gradients as one flat vector (executor/parallel/shard.py).
        gpu["comm_buffers"] = REDUCTIONS_IN_FLIGHT * max(groups.values()) * param_bytes(knobs)
        if knobs.comm == "memcpy":  # a rank's row of each slot of shared memory (executor/parallel/hostcomm.py)
            host["comm_buffers"] = MEMCPY_SLOTS * _memcpy_row_bytes(max(groups.values()) * param_bytes(knobs), device)
            if not on_cpu:  # a round's cells fetched to the GPU to add (a CPU adds them where they are)
                gpu["comm_buffers"] += MEMCPY_ROW_BYTES
        if knobs.cache_weights_on_host and sharded:  # each rank's copy of the gathered weights of every block
            host["weights"] += (spec.num_layers - len(place.streamed_weights)) * spec.layer_params() * \
                param_bytes(knobs)  # but streamed ones
    shared = shared_host_weight_params(spec, knobs, num_gpus) * param_bytes(knobs)  # one copy a node, not a rank
    host["weights"] -= shared
    host = {k: v * gpus_per_node for k, v in host.items()}  # each GPU's process has its own host tensors
    host["weights"] += shared
    phases = _phases(spec, knobs, place, gpu, _gradients_made(spec, knobs, place, num_gpus), tokens, device, num_gpus)
    compiled = calibration.compiled_activations if knobs.compile else 1.0
    for phase in phases:
        phase["activations"] *= compiled
    peak = max(phases, key=lambda phase: sum(phase.values()))
    peak["workspace"] += calibration.fragmentation * sum(peak.values())
    peak_bytes = sum(peak.values())
    as_measured = listed | {"activations": compiled * forward_kept_bytes(spec, knobs, tokens, device) +
                            head_weight_gradient_bytes(spec, knobs)}
    as_measured["workspace"] = max(0.0, peak_bytes - sum(v for k, v in as_measured.items() if k != "workspace"))
    return Memory(gpu={k: int(v) for k, v in as_measured.items()}, host={k: int(v) for k, v in host.items()},
                  gpu_peak=int(peak_bytes), peak_phase={k: int(v) for k, v in peak.items()})


def _phases(spec: ModelSpec, knobs: Knobs, place: Placement, states: dict[str, float], made: dict[str, float],
            tokens: int, device: str, num_gpus: int) -> list[dict[str, float]]:
    """The GPU's bytes by category where a step can peak: at the loss, in each block's backward pass, in the
    embedding's, and in the optimizer step. `states`: the model states on the GPU with every gradient made; `made`:
    each group's gradients on the GPU, which a step's first micro-batch makes as its backward pass goes (later
    micro-batches add into them).

    The executor's schedule (executor/memory/placement.py): backward reaches block i with its weights, input and
    (accumulating) gradient sums fetched, and fetches block i-1's meanwhile, while the inputs of the blocks below that
    stay on the GPU are kept and the gradients of the groups above are made. The blocks offloaded are the first ones
    (fastml.plan.offloaded_groups): the blocks at the top keep their inputs, and backward starts there with no block's
    gradients made. Counting every tensor at once instead, the planner predicted the capped 3B and 8B runs of
    benchmarks/fidelity.py 25% and 32% larger than they peaked (benchmarks/NOTES.md)."""
    layers = spec.num_layers
    layer = spec.layer_params() * param_bytes(knobs)  # a block's weights, or its gradients
    block_input = block_input_bytes(spec, knobs, tokens)
    saved = layer_activation_bytes(spec, knobs, tokens, device)
    rebuilt = rebuilt_activation_bytes(spec, knobs, tokens, device)
    accumulating = knobs.grad_accum_steps > 1
    sharded = knobs.shard_weights and num_gpus > 1  # gathered: every block's weights come whole to the GPU
    # A streamed master's fetch lands in fp32 and is rounded on the copy stream (offload.py). The allocator counts it
    # only while the fetch is queued (it is released then, kept from reuse until the copy is done, as is whatever
    # else is copied away: gradients and inputs on their way to the host): at the start of a block's backward pass,
    # before the block rebuilds its activations.
    staging = spec.layer_params() * FP32_BYTES

    def fetched(blocks: list[int], on: frozenset[str]) -> int:
        """How many of `blocks` are offloaded `on` the host, and so fetched to the GPU now."""
        return sum(block_group(b) in on for b in blocks if b >= 0)

    def weights(blocks: list[int]) -> float:
        buffers = STREAM_BUFFER_LAYERS if sharded else fetched(blocks, place.streamed_weights)
        return states["weights"] + buffers * layer

    def gradients(blocks: list[int], unmade: float) -> float:
        """With the sums of `blocks` fetched (accumulating), or without the `unmade` bytes of gradients."""
        if accumulating:
            return states["gradients"] + fetched(blocks, place.host_gradients) * layer
        return states["gradients"] - unmade

    # At the loss: every block's activations but the inputs gone to the host, and the head's; nothing streamed is
    # fetched yet (but a sharded head's weights, and the blocks' buffers of a sharded model); the head's gradient is
    # made in the loss's workspace.
    phases = [states | {
        "weights": weights([]), "gradients": gradients([], sum(made.values())),
        "activations": forward_kept_bytes(spec, knobs, tokens, device),
        "workspace": loss_workspace_bytes(spec, knobs, tokens, device)}]
    backward = block_backward_workspace_bytes(spec, knobs, tokens)
    if knobs.matmul_dtype == "fp8" and len(fp8_cached_blocks(knobs, layers, num_gpus)) < layers:
        backward += spec.layer_matmul_params() * DTYPE_BYTES["fp8"]  # an uncached layer's weights, cast as it computes
    # The embedding's gradients come last. Tied, autograd keeps the head's part of them (the loss made it) until the
    # embedding's part is made, and only then adds both into the weight's gradient: beside it, from a step's second
    # micro-batch.
    unmade = 0 if spec.tied_embeddings else made.get("embed", 0)
    head_weight_gradient = head_weight_gradient_bytes(spec, knobs)
    waiting = head_weight_gradient if spec.tied_embeddings and accumulating else 0
    gone = 0  # the inputs of the blocks below i - 1 that are on the host
    for i in range(layers):
        near = list(range(i, i - STREAM_BUFFER_LAYERS, -1))  # this block and the one fetched beside it
        if i >= STREAM_BUFFER_LAYERS:
            gone += block_group(i - STREAM_BUFFER_LAYERS) in place.host_inputs
        unmade += made.get(block_group(i), 0)
        phases.append(states | {
            "weights": weights(near), "gradients": gradients(near, unmade) + waiting,
            "activations": (i + 1) * saved - gone * block_input + rebuilt,
            # the block's own gradients are made in its workspace (block_backward_workspace_bytes)
            "workspace": max(backward, staging * fetched(near[1:], place.master_streamed) - rebuilt)})
    # The embedding's backward pass makes its part of its gradients (from the first block's input gradient) beside
    # the rest (and tied, the head's part); added into the sum (accumulating) or the head's part, it goes.
    parts = 1 + spec.tied_embeddings if accumulating else int(spec.tied_embeddings)
    phases.append(states | {"gradients": states["gradients"] + parts * head_weight_gradient, "activations": 0,
                            "workspace": block_input})
    phases.append(states | {"activations": 0, "workspace": _gpu_optimizer_workspace(spec, place)})
    return phases


def forward_kept_bytes(spec: ModelSpec, knobs: Knobs, tokens: int, device: str) -> int:
    """What a micro-batch's forward pass keeps on the GPU when the loss is made: each block's saved tensors but the
    inputs gone to the host, and the head's (head_activation_bytes)."""
    offloaded = offloaded_groups(knobs, "offload_residuals", spec.num_layers)
    kept = spec.num_layers * layer_activation_bytes(spec, knobs, tokens, device)
    kept -= len(offloaded) * block_input_bytes(spec, knobs, tokens)
    return kept + head_activation_bytes(spec, knobs, tokens, device)


def _gradients_made(spec: ModelSpec, knobs: Knobs, place: Placement, num_gpus: int) -> dict[str, float]:
    """Per parameter group, the gradient bytes on the GPU that its backward pass makes (a group whose gradients go to
    the host makes them in the backward pass's workspace: block_backward_workspace_bytes)."""
    return {group: model_state_bytes(num_params, knobs, num_gpus)["gradients"]
            for group, num_params in group_params(spec).items() if group not in place.host_gradients}


def _memcpy_row_bytes(largest_group_bytes: float, device: str) -> float:
    """The resident bytes of a rank's row of a slot of the memcpy collectives: pinned whole for a GPU's copy engines;
    on a CPU (not pinned) only the pages a round writes, at most a group's bytes."""
    return MEMCPY_ROW_BYTES if device != "cpu" else min(MEMCPY_ROW_BYTES, largest_group_bytes)


# The knob that moves each model-state category of a parameter group to the host.
_OFFLOADED_BY = {"weights": "streamed_weights", "gradients": "host_gradients", "master_weights": "host_masters",
                 "optimizer_states": "cpu_steps"}


def model_states(spec: ModelSpec, knobs: Knobs, place: Placement,
                 num_gpus: int) -> tuple[dict[str, float], dict[str, float]]:
    """Weights, master weights, gradients and optimizer states of one GPU and of its process on the host, group by
    group (ZeRO's counts, `model_state_bytes`, per group). Host copies are pinned where a GPU copy reads or writes
    them and pageable where only the CPU does (masters and Adam states of CPU-stepped groups): the same bytes."""
    gpu = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    host = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    for group, num_params in group_params(spec).items():
        states = model_state_bytes(num_params, knobs, num_gpus, weights_sharded(knobs, group))
        if group in place.master_streamed:  # one host copy, the fp32 master, which the parameters point at: weights
            states = {**states, "weights": states["master_weights"], "master_weights": 0}
        for category, num_bytes in states.items():
            on_host = group in getattr(place, _OFFLOADED_BY[category])
            (host if on_host else gpu)[category] += num_bytes
    return gpu, host


def shared_host_weight_params(spec: ModelSpec, knobs: Knobs, num_gpus: int) -> int:
    """The weights that live in host memory once a node, shared by its ranks (knobs.share_host_weights): the
    streamed blocks'."""
    if not (knobs.share_host_weights and num_gpus > 1):
        return 0
    return len(shared_weight_groups(knobs, spec.num_layers)) * spec.layer_params()


def rebuilt_activation_bytes(spec: ModelSpec, knobs: Knobs, tokens: int, device: str) -> int:
    """A recomputed layer rebuilds all its activations during its backward pass: one layer's worth at a time."""
    return layer_activation_bytes(spec, replace(knobs, recompute=()), tokens, device) if knobs.recompute else 0


def _gpu_optimizer_workspace(spec: ModelSpec, place: Placement) -> int:
    """The GPU's optimizer steps one parameter group at a time (executor/memory/optim.py), with temporary buffers for that
    group only (`Placement.gpu_step_workspace`): the largest sets the workspace."""
    sizes = group_params(spec)
    return max((sizes[g] * place.gpu_step_workspace(g) for g in sizes if g not in place.cpu_steps), default=0)


def _cpu_staging_bytes(spec: ModelSpec, knobs: Knobs, place: Placement, num_gpus: int) -> int:
    """Host memory through which the CPU-stepped groups' transfers pass: STAGING_SLOTS pinned buffers of at most
    CPU_STEP_CHUNK elements per dtype (executor/memory/optim.py), sized here by the largest group rather than the largest
    parameter (an upper bound for small models, exact where a parameter exceeds a slice)."""
    shard = num_gpus if knobs.shard_optimizer else 1
    sizes = group_params(spec)
    return STAGING_SLOTS * max((min(sizes[g] // shard, CPU_STEP_CHUNK) * place.cpu_staged_bytes(g)
                                for g in place.cpu_steps), default=0)
