"""Durations of the operations of a training step on one GPU: compute as a roofline over the profile's measured
GEMM efficiency curve and memory bandwidth, transfers and collectives as bytes over the profile's rates.

Sources: FLOPs of a matmul, 2mnk, over the block's linear shapes in fastml/spec.py, and of causal attention,
2·s²·d per head forward with backward 2.5 times the forward (Dao 2023, "FlashAttention-2", section 4.1: backward
does 5 matmuls against forward's 2); both counted by torch.utils.flop_counter on the executor's model in
tests/test_planner_vs_model.py. Bytes in the dtypes the knobs name (memory.py). Collectives as ring algorithms,
time = α + bytes·(n-1)/n / bus bandwidth for reduce-scatter and all-gather and twice that for all-reduce (NCCL's
bus-bandwidth convention, nccl-tests doc/PERFORMANCE.md), the bus bandwidth bounded by the link between GPUs
(NVLink, PCIe peer to peer, or host memory without P2P); the memcpy collectives as the bytes their copies move over
each direction of PCIe (`_memcpy`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fastml.config import fail
from fastml.plan import MEMCPY_ROW_BYTES, OFFLOAD_FRACTIONS, Knobs, fp8_cached_blocks
from fastml.hwprofiles.schema import (ATTENTION_BACKWARD_FACTOR, ELEMENTWISE_PASSES, FP8_AMAX_BYTES, FP8_CAST_BYTES,
                                      Calibration)
from fastml.planner.hardware import Machine
from fastml.planner.memory import (DTYPE_BYTES, FP32_BYTES, activation_bytes, block_input_bytes, compensation_bytes,
                                   group_params, has_fp32_masters, loss_logit_bytes, param_bytes,
                                   shared_host_weight_params)
from fastml.spec import ModelSpec

@dataclass(frozen=True)
class Costs:
    """Seconds of each operation kind for one micro-batch (per layer where it says so) on one GPU."""

    layer_forward: float
    layer_backward: float
    layer_recompute: float
    """A block's passes over one micro-batch, without the casts of its weights to fp8 (below)."""
    layer_weight_cast_forward: float
    layer_weight_cast_backward: float
    """fp8 matmuls: casting a block's weights as its forward pass (and its recompute) and its backward pass use
    them, where they are not cached; 0 otherwise."""
    layer_weight_cache: float
    """fp8 matmuls with knobs.cache_fp8_weights: casting a cached block's weights, once per optimizer step."""
    head_forward_backward: float
    grad_accumulate: float
    """Adding a micro-batch's gradients to the accumulated ones (all micro-batches after the first), on the GPU
    for every block, offloaded gradients included (they come back to be added to)."""
    grad_clip: float
    """Gradient clipping's read of every gradient for the global norm, before any optimizer step."""
    gpu_adam_per_param: float
    """The GPU optimizer step of one parameter (a GPU steps its share of each group where the optimizer is
    sharded)."""
    cpu_adam_per_param: float
    """The CPU's AdamW of one parameter (csrc/, at the profile's measured rate)."""
    h2d_per_byte: float
    d2h_per_byte: float
    """One byte crossing PCIe, on one GPU's share of the node's PCIe root."""
    layer_weights_h2d: float
    layer_masters_h2d: float
    """A block's fp32 masters up from the host, in place of its weights (knobs.stream_masters); their rounding on
    the GPU is not counted: about a thousandth of the copy's time."""
    layer_grads_h2d: float
    """A block's accumulated gradients back to the GPU, to add the next micro-batch's to."""
    layer_grads_d2h: float
    layer_input_d2h: float
    """A block's input activation (`memory.block_input_bytes`) to the host after its forward pass, and back
    before its backward pass."""
    layer_input_h2d: float
    layer_weight_gather: Collective
    layer_grad_reduce: Collective
    """Per layer: reduce-scatter (a sharded optimizer: every micro-batch with sharded gradients, else the last) or
    all-reduce (the last micro-batch)."""
    step_weight_gather: Collective
    """All-gather of the updated weights after a sharded optimizer step (ZeRO 1/2 without weight sharding)."""
    embed_gather: Collective
    head_gather: Collective
    """ZeRO-3: the embedding's weights before each forward pass, the final norm's and head's before the head."""
    embed_grad_reduce: Collective
    head_grad_reduce: Collective
    """The embedding's and head's gradients reduced, as a block's are (`layer_grad_reduce`)."""
    shard_h2d: float
    """A streamed block's weight shard to the GPU, before it is gathered (ZeRO-3 with streamed weights)."""
    layer_weight_gradient_share: float = 0.0
    """Of a block's backward pass, the part that makes its weights' gradients (one of a linear's two GEMMs), which
    a zero-bubble pipeline schedule runs as a pass of its own (fastml.layout.splits_backward): a share of the GPU's
    modelled work, applied to the whole pass (the host's time for it and the calibration included)."""
    step_host_s: float = 0.0
    """The host's time each step adds besides its passes: the loop's, and the optimizer's per block
    (`HostOverhead`), wherever its states are (the CPU's steps are the host's work too)."""


@dataclass(frozen=True)
class Collective:
    """A collective's time on the resources it occupies: NCCL's stream (`comm_s`), or the memcpy collectives'
    copies down and up (`d2h_s`, `h2d_s`: the copy engines, which offload's copies use too)."""

    comm_s: float = 0.0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    both_ways: bool = False
    """The copies down and up run at once for the whole time (NCCL through host memory), not one after the other."""

    @property
    def seconds(self) -> float:
        return self.comm_s + (max(self.d2h_s, self.h2d_s) if self.both_ways else self.d2h_s + self.h2d_s)


def cpu_adam_rate(machine: Machine) -> float:
    """Parameters per second one rank's CPU AdamW steps: the node's rate (measured by `fastml profile` over all its
    cores) shared by the ranks of the node, which step at once, each on its share of the cores (cpu_count // ranks
    threads: executor/loop/device.py, rank_cpu_threads).
    One rate for every state dtype: bf16 moments stepped alone ran 10-16% faster than fp32 state on the H200 host,
    but not in training (benchmarks/NOTES.md)."""
    return machine.node.cpu_adam_params_per_s / machine.gpus_per_node


def layer_gemms(spec: ModelSpec, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(m, n, k) of each forward matmul of one block over `tokens` tokens: the block's linear layers of
    `ModelSpec.block_linear_shapes`. The backward pass does two of each size (input and weight gradients)."""
    return {name: (tokens, n, k) for name, (n, k) in spec.block_linear_shapes().items()}


def fp8_cast_bytes(spec: ModelSpec, tokens: int) -> tuple[float, float]:
    """Bytes one block's fp8 casts of activations move over `tokens` tokens, forward and backward: forward each
    linear's input (row-major and transposed, `fp8_input_cast_bytes`), backward each output gradient (both), but
    for gate_up's, whose absolute maximum SwiGLU's backward kernel takes (no read for it)."""
    shapes = spec.block_linear_shapes()
    output_grads = tokens * (sum(n for n, _ in shapes.values()) * (FP8_CAST_BYTES + 1) -
                             shapes["gate_up"][0] * FP8_AMAX_BYTES)
    return sum(fp8_input_cast_bytes(spec, tokens).values()), output_grads


def fp8_input_cast_bytes(spec: ModelSpec, tokens: int) -> dict[str, float]:
    """Bytes the fp8 cast of each linear's input moves, both layouts: down's input is SwiGLU's output, whose absolute
    maximum SwiGLU's kernel takes as it writes it, so the cast reads it once (executor/model/fp8.py,
    FP8FeedForwardFunction)."""
    shapes = spec.block_linear_shapes()
    cast = {name: tokens * k * (FP8_CAST_BYTES + 1) for name, (_, k) in shapes.items()}
    cast["down"] -= tokens * shapes["down"][1] * FP8_AMAX_BYTES
    return cast


def fp8_weight_cast_bytes(spec: ModelSpec) -> tuple[float, float, float]:
    """Bytes one block's fp8 casts of its weights move: in a forward pass (row-major) and a backward pass
    (transposed) where they are cast as they are used, or once a step, both layouts at once, where they are cached
    (knobs.cache_fp8_weights)."""
    params = spec.layer_matmul_params()
    return params * FP8_CAST_BYTES, params * FP8_CAST_BYTES, params * (FP8_CAST_BYTES + 1)


RECOMPUTED_LINEARS = {"ffn": ("gate_up", "down"), "qkv": ("qkv",)}
"""The linear layers each recompute part runs again (executor/model/apply.py `recompute_targets`); "block" runs all."""


def recomputed_weight_share(spec: ModelSpec, parts: tuple[str, ...]) -> float:
    """The share of a block's linear-layer weights that recomputing `parts` multiplies by again."""
    shapes = spec.block_linear_shapes()
    again = set(shapes) if "block" in parts else {name for part in parts for name in RECOMPUTED_LINEARS.get(part, ())}
    return sum(n * k for name, (n, k) in shapes.items() if name in again) / sum(n * k for n, k in shapes.values())


def gemm_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def layer_flops(spec: ModelSpec, micro_batch_size: int, seq_len: int) -> dict[str, float]:
    """FLOPs of one block over one micro-batch, by pass and kind, as `costs` charges them (recompute aside)."""
    gemm = sum(gemm_flops(*shape) for shape in layer_gemms(spec, micro_batch_size * seq_len).values())
    attention = micro_batch_size * seq_len * spec.attention_forward_flops_per_token(seq_len)
    return {"forward.gemm": gemm, "forward.attention": attention,
            "backward.gemm": 2 * gemm, "backward.attention": ATTENTION_BACKWARD_FACTOR * attention}


HEAD_GEMM_PASSES = 3
"""LM-head matmuls of the forward's size: the logits, the hidden states' and the weight's gradients (all three in
the forward pass, executor/model/loss.py)."""


def head_flops(spec: ModelSpec, tokens: int) -> float:
    return HEAD_GEMM_PASSES * gemm_flops(tokens, *spec.lm_head_shape())


def optimizer_step_bytes(knobs: Knobs) -> int:
    """Bytes AdamW reads and writes per parameter (executor/memory/optim.py). With fp32 masters: read the gradient (torch's
    fused AdamW: write and read its fp32 copy first; fastml's op, stepping bf16 moments, reads it as it is), read and
    write the master, write the rounded weight; else the parameter is its own master: read the gradient, read and
    write the weight (and its compensation). Then read and write m and v."""
    weight = param_bytes(knobs)
    if has_fp32_masters(knobs):
        grad_copy = 0 if knobs.uses_fastml_adamw else 2 * FP32_BYTES
        moved = weight + grad_copy + 2 * FP32_BYTES + weight
    else:
        moved = weight + 2 * weight + 2 * compensation_bytes(knobs)
    return moved + 2 * 2 * DTYPE_BYTES[knobs.optimizer_dtype]


def costs(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Costs:
    """The durations: the GPU's work times the machine's calibration (`calibrated`), each pass at least the host's
    time for it (`with_host_time`)."""
    return with_host_time(calibrated(_modelled_costs(spec, seq_len, knobs, machine), knobs, machine.calibration),
                          spec, knobs, machine)


FORWARD_OPS = 50
BACKWARD_OPS = 74
"""The aten ops a block's forward and backward pass dispatch on a GPU without recompute (bf16, eager), counted by
benchmarks/host_overhead.py (results/host_overhead-h200.json, `pass_ops`): the host's time of a block pass is split
between its forward and backward in this ratio."""
RECOMPUTE_OPS = {"attention": 27, "ffn": 17, "block": 79}
"""The aten ops recompute adds to a block's backward pass, by part of knobs.recompute (counted there too; attention
and ffn together add their sum, 44). "norm" and "qkv", which the search does not weigh, are not counted."""


LM_HEAD_CHUNK_OPS = 11
"""The aten ops each slice of the LM head dispatches (executor/model/loss.py), counted in
tests/test_planner_vs_model.py: a head of n slices takes the host n - 1 slices' ops more than one of a single slice
(the profile's `head_s`), at the host's time per op."""
LOSS_LOGIT_PASSES = 3
"""Passes of the loss's kernel over a logit's bytes (executor/model/fused.py): two reads and one write."""


def with_host_time(c: Costs, spec: ModelSpec, knobs: Knobs, machine: Machine) -> Costs:
    """Each block pass and the head take at least the host's time for them: the GPU runs kernels as fast as the
    host launches them, so the longer of the two paces the stream (the host runs ahead while the GPU is the slower;
    on a CPU, the host's time adds to the arithmetic);
    the step's own host work (the loop, the optimizer's launches) comes on top, as the step waits for it. The host's time of a block pass (`HostOverhead`, measured by `fastml profile`)
    is shared out by the ops each pass dispatches. A torch.compile'd block costs the host as much: measured on the
    H200, 2.03 ms a block pass eager and compiled alike (results/host_overhead-h200.json)."""
    host = machine.host_overhead
    if host is None:
        return c
    per_op = host.block_pass_s / (FORWARD_OPS + BACKWARD_OPS)
    parts = ("block",) if "block" in knobs.recompute else knobs.recompute
    recomputed = sum(RECOMPUTE_OPS.get(part, 0) for part in parts)
    chunk_ops = LM_HEAD_CHUNK_OPS * (knobs.lm_head_chunks - 1)  # one slice's are the unchunked head's, in head_s
    # A GPU runs its kernels while the host queues the next; a CPU's one thread of control does both in turn.
    paced = (lambda work, host_s: work + host_s) if machine.device == "cpu" else max
    return dataclasses.replace(
        c, layer_forward=paced(c.layer_forward, FORWARD_OPS * per_op),
        layer_backward=paced(c.layer_backward, BACKWARD_OPS * per_op),
        layer_recompute=paced(c.layer_recompute, recomputed * per_op),
        head_forward_backward=paced(c.head_forward_backward, host.head_s + chunk_ops * per_op),
        step_host_s=host.step_s + spec.num_layers * host.optimizer_per_block_s)


def calibrated(modelled: Costs, knobs: Knobs, cal: Calibration) -> Costs:
    """The GPU's work times the calibration (`Calibration`: measured over modelled time of the blocks' forward
    passes, of the GPU's other work, of the CPU's optimizer steps and of transfers, and what each pass of a block
    adds)."""
    if cal == Calibration():
        return modelled
    compute = ("grad_accumulate", "grad_clip", "gpu_adam_per_param", "layer_weight_cast_backward",
               "layer_weight_cache")
    per_pass = ("layer_backward", "head_forward_backward")
    transfers = ("h2d_per_byte", "d2h_per_byte", "layer_weights_h2d", "layer_masters_h2d", "layer_grads_h2d",
                 "layer_grads_d2h",
                 "layer_input_d2h", "layer_input_h2d", "shard_h2d")
    changed = {name: getattr(modelled, name) * cal.compute + cal.layer_overhead_s for name in per_pass}
    changed["layer_forward"] = modelled.layer_forward * cal.forward + cal.layer_overhead_s
    changed["layer_weight_cast_forward"] = modelled.layer_weight_cast_forward * cal.forward
    changed |= {name: getattr(modelled, name) * cal.compute for name in compute}
    changed["cpu_adam_per_param"] = modelled.cpu_adam_per_param * cal.cpu_optimizer
    changed |= {name: getattr(modelled, name) * cal.transfer for name in transfers}
    changed["layer_recompute"] = modelled.layer_recompute * cal.forward + \
        (cal.layer_overhead_s if knobs.recompute else 0.0)
    return dataclasses.replace(modelled, **changed)  # collectives apply cal.transfer themselves (`collective`)


KINDS = ("matmul", "attention", "elementwise", "fp8 cast")
"""The kinds of GPU work a block's passes are priced by (`LayerWork`); the head's are "matmul" and "loss"."""


@dataclass(frozen=True)
class LayerWork:
    """Seconds of GPU work by kind, before calibration, of one block's passes over one micro-batch (KINDS; the
    casts of its weights to fp8 are apart, in Costs) and of the head's forward and backward pass."""

    forward: dict[str, float]
    backward: dict[str, float]
    recompute: dict[str, float]
    """What the block's recompute parts (knobs.recompute) run again in its backward pass."""
    head: dict[str, float]
    """The LM head's matmuls and the loss's (tokens x vocab) tensors."""


def layer_work(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> LayerWork:
    gpu = machine.gpu
    t = knobs.micro_batch_size * seq_len
    dtype = knobs.matmul_dtype
    # fp8 is the blocks' linear layers' alone: attention and the LM head stay bf16 (executor/model/fp8.py)
    other_dtype = "bf16" if dtype == "fp8" else dtype

    def gemms(*names: str, backward: bool = False) -> float:
        shapes = layer_gemms(spec, t)
        return sum(gpu.gemm_seconds(*shapes[name], dtype, backward) for name in names)

    def hbm(num_bytes: float) -> float:
        return num_bytes / gpu.hbm_bytes_per_s

    def cast(num_bytes: float) -> float:  # fastml's fp8 casts, at their own measured rate
        return num_bytes / gpu.fp8_cast_bytes_per_s if dtype == "fp8" else 0.0

    flops = layer_flops(spec, knobs.micro_batch_size, seq_len)
    attention = _attention_s(flops["forward.attention"], spec, knobs.micro_batch_size, seq_len, machine,
                             other_dtype)
    elementwise = (spec.elementwise_elements_per_token(knobs.compile) * t * activation_bytes(knobs) /
                   gpu.elementwise_bytes_per_s)
    quantize_forward, quantize_backward = (cast(b) for b in fp8_cast_bytes(spec, t))
    forward = {"matmul": gemms("qkv", "out", "gate_up", "down"), "attention": attention, "elementwise": elementwise,
               "fp8 cast": quantize_forward}
    # With knobs.fp8_backward_fast_accum the backward GEMMs accumulate as the forward ones: at their rate (on an H200
    # the three GEMMs of a linear then ran within 5% of each other; benchmarks/NOTES.md, issue 25 part 14).
    backward = {"matmul": 2 * gemms("qkv", "out", "gate_up", "down", backward=not knobs.fp8_backward_fast_accum),
                "attention": ATTENTION_BACKWARD_FACTOR * attention,
                "elementwise": (ELEMENTWISE_PASSES - 1) * elementwise,
                "fp8 cast": quantize_backward}
    # fp8: recomputed linears cast their inputs again (their weights too, where not cached: simulate.py)
    input_casts = {name: cast(num_bytes) for name, num_bytes in fp8_input_cast_bytes(spec, t).items()}
    recompute = _recompute_work(knobs.recompute, forward,
                                {"matmul": gemms("gate_up", "down"),
                                 "fp8 cast": input_casts["gate_up"] + input_casts["down"]},
                                {"matmul": gemms("qkv"), "fp8 cast": input_casts["qkv"]}, attention, elementwise)
    # The head (executor/model/loss.py), a slice of the tokens at a time: its three matmuls, the loss's kernel reading
    # each logit twice and writing its gradient over it, each slice after the first adding its weight gradient in
    # its GEMM (which reads the sum so far), and the backward pass scaling both gradients in place.
    chunks = knobs.lm_head_chunks
    chunk = -(-t // chunks)
    weight_bytes = spec.vocab_size * spec.hidden_size * param_bytes(knobs)
    hidden_bytes = t * spec.hidden_size * activation_bytes(knobs)
    head = {"matmul": chunks * (gpu.gemm_seconds(chunk, *spec.lm_head_shape(), other_dtype) +
                                2 * gpu.gemm_seconds(chunk, *spec.lm_head_shape(), other_dtype, backward=True)),
            "loss": hbm(LOSS_LOGIT_PASSES * loss_logit_bytes(knobs, machine.device) * t * spec.vocab_size +
                        (chunks - 1) * weight_bytes + 2 * (weight_bytes + hidden_bytes))}
    return LayerWork(forward, backward, recompute, head)


def step_work(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> dict[str, float]:
    """The GPU work of one optimizer step by kind as the costs price it before calibration, on one GPU without
    offload (where the simulated step is this work end to end): the blocks' passes (recomputed parts too) and the
    head's for each micro-batch, the fp8 weight casts, the gradients' accumulation, their clipping and the AdamW
    step. benchmarks/profile_step.py sets it beside a traced step's kernels by kind."""
    if machine.num_gpus > 1 or any(getattr(knobs, name) for name in OFFLOAD_FRACTIONS):
        fail("knobs", "the work by kind is priced for one GPU without offload")
    machine = dataclasses.replace(machine, calibration=Calibration())
    work, c = layer_work(spec, seq_len, knobs, machine), costs(spec, seq_len, knobs, machine)
    micro, layers = knobs.grad_accum_steps, spec.num_layers
    kinds = dict.fromkeys((*KINDS, "loss"), 0.0)
    for passes, work_of_pass in ((micro * layers, work.forward), (micro * layers, work.backward),
                                 (micro * layers * bool(knobs.recompute), work.recompute), (micro, work.head)):
        for kind, seconds in work_of_pass.items():
            kinds[kind] += passes * seconds
    cached = len(fp8_cached_blocks(knobs, layers, 1))
    recast = recomputed_weight_share(spec, knobs.recompute) if knobs.recompute else 0.0
    kinds["fp8 cast"] += micro * (layers - cached) * (c.layer_weight_cast_forward * (1 + recast) +
                                                      c.layer_weight_cast_backward) + cached * c.layer_weight_cache
    kinds["gradient accumulation"] = (micro - 1) * c.grad_accumulate
    kinds["optimizer"] = c.grad_clip + spec.num_params() * c.gpu_adam_per_param
    return {kind: seconds for kind, seconds in kinds.items() if seconds}


def _modelled_costs(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Costs:
    gpu = machine.gpu
    t = knobs.micro_batch_size * seq_len
    work = layer_work(spec, seq_len, knobs, machine)

    def hbm(num_bytes: float) -> float:
        return num_bytes / gpu.hbm_bytes_per_s

    weight_casts = [num_bytes / gpu.fp8_cast_bytes_per_s if knobs.matmul_dtype == "fp8" else 0.0
                    for num_bytes in fp8_weight_cast_bytes(spec)]
    p = spec.num_params()
    layer_bytes = spec.layer_params() * param_bytes(knobs)
    h2d, d2h = 1 / machine.h2d_bytes_per_s(), 1 / machine.d2h_bytes_per_s()
    block_input = block_input_bytes(spec, knobs, t)
    groups = group_params(spec)

    def gather(num_params: int) -> Collective:
        return collective("all_gather", num_params * param_bytes(knobs), machine, knobs.comm)

    def reduce(num_params: int) -> Collective:
        return collective("reduce_scatter" if knobs.shard_optimizer else "all_reduce", num_params * param_bytes(knobs),
                          machine, knobs.comm)
    return Costs(
        layer_forward=sum(work.forward.values()), layer_backward=sum(work.backward.values()),
        layer_weight_gradient_share=work.backward["matmul"] / 2 / sum(work.backward.values()),
        layer_recompute=sum(work.recompute.values()), head_forward_backward=sum(work.head.values()),
        layer_weight_cast_forward=weight_casts[0], layer_weight_cast_backward=weight_casts[1],
        layer_weight_cache=weight_casts[2],
        # a micro-batch's gradient added to the sum: both read, the sum written
        grad_accumulate=hbm(3 * p * param_bytes(knobs) / (machine.num_gpus if knobs.shard_gradients else 1)),
        grad_clip=hbm(p * param_bytes(knobs)),
        gpu_adam_per_param=hbm(optimizer_step_bytes(knobs)), cpu_adam_per_param=1 / cpu_adam_rate(machine),
        h2d_per_byte=h2d, d2h_per_byte=d2h,
        layer_weights_h2d=layer_bytes * h2d, layer_masters_h2d=spec.layer_params() * FP32_BYTES * h2d,
        layer_grads_h2d=layer_bytes * h2d, layer_grads_d2h=layer_bytes * d2h,
        layer_input_d2h=block_input * d2h, layer_input_h2d=block_input * h2d,
        layer_weight_gather=gather(spec.layer_params()), layer_grad_reduce=reduce(spec.layer_params()),
        # but of the weights the node's ranks share in host memory: each rank stepped its shard of them there
        step_weight_gather=gather(p - shared_host_weight_params(spec, knobs, machine.num_gpus)), embed_gather=gather(groups["embed"]), head_gather=gather(groups["head"]),
        embed_grad_reduce=reduce(groups["embed"]), head_grad_reduce=reduce(groups["head"]),
        shard_h2d=layer_bytes / machine.num_gpus * h2d,
    )


def collective(kind: str, num_bytes: float, machine: Machine, comm: str) -> Collective:
    """A collective over all GPUs of `num_bytes` (the full, unsharded size), on what it occupies."""
    n = machine.num_gpus
    if n == 1:
        return Collective()
    factor = machine.calibration.transfer
    if comm == "memcpy":
        c = _memcpy(kind, num_bytes, machine)
        return dataclasses.replace(c, d2h_s=c.d2h_s * factor, h2d_s=c.h2d_s * factor)
    seconds = nccl_s(kind, num_bytes, machine) * factor
    if not machine.gpu.p2p and machine.num_nodes == 1:
        # NCCL's shared-memory transport copies through host memory over the node's PCIe, both directions at once
        # for the whole collective, sharing them with offload's copies.
        return Collective(d2h_s=seconds, h2d_s=seconds, both_ways=True)
    return Collective(comm_s=seconds)


def _memcpy(kind: str, num_bytes: float, machine: Machine) -> Collective:
    """The memcpy collectives (executor/parallel/hostcomm.py) in rounds of a slot each, a barrier between each round's copies
    down and up: a reduce-scatter sends the (n-1)/n of its input that the others sum down and fetches theirs up,
    then adds on the GPU; an all-gather sends its shard down and fetches the (n-1) others; an all-reduce is both. A
    round's copies up overlap the next round's down (separate engines): the simulator runs all the copies down, then
    what is left of the copies up once the last round's are down."""
    n = machine.num_gpus
    share = num_bytes * (n - 1) / n
    down = {"reduce_scatter": share, "all_gather": num_bytes / n, "all_reduce": share + num_bytes / n}[kind]
    up = {"reduce_scatter": share, "all_gather": share, "all_reduce": 2 * share}[kind]
    def rounds_of(cells: int) -> int:  # a reduce-scatter's row has a cell per rank, an all-gather's one
        return math.ceil(num_bytes / n / (MEMCPY_ROW_BYTES / cells))
    rounds = {"reduce_scatter": rounds_of(n), "all_gather": rounds_of(1),
              "all_reduce": rounds_of(n) + rounds_of(1)}[kind]
    adds = share * 3 / machine.gpu.hbm_bytes_per_s if kind != "all_gather" else 0.0  # read 2, write 1
    down_s, up_s = down / machine.d2h_bytes_per_s(), up / machine.h2d_bytes_per_s() + adds
    return Collective(d2h_s=rounds * machine.collective_latency_s + down_s,
                      h2d_s=max(up_s / rounds, up_s - down_s * (rounds - 1) / rounds))


def nccl_s(kind: str, num_bytes: float, machine: Machine) -> float:
    """The time of an NCCL collective over all GPUs of `num_bytes` (the full, unsharded size)."""
    n = machine.num_gpus
    if n == 1:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather
    moved = passes * num_bytes * (n - 1) / n
    bandwidth = min(machine.bus_bytes_per_s[kind], link_bytes_per_s(machine))
    if machine.num_nodes > 1:  # a ring across nodes runs at the slower of the links it crosses
        bandwidth = min(bandwidth, machine.node.nic_bytes_per_s / machine.gpus_per_node)
    return machine.collective_latency_s * (2 if machine.num_nodes > 1 else 1) + moved / bandwidth


def link_bytes_per_s(machine: Machine) -> float:
    """The most one GPU can send to its ring neighbour in the node, whatever the profile's NCCL numbers say: over
    NVLink; over PCIe peer to peer; or, without P2P (consumer GPUs), through pinned host memory, where NCCL's
    shared-memory transport copies down and up again on the node's shared PCIe root (DESIGN.md: with
    NCCL_P2P_DISABLE=1 two H200s run below one)."""
    gpu = machine.gpu
    if gpu.p2p and gpu.nvlink_bytes_per_s:
        return gpu.nvlink_bytes_per_s
    if gpu.p2p:
        return min(gpu.h2d_bytes_per_s, gpu.d2h_bytes_per_s)
    return min(machine.h2d_bytes_per_s(), machine.d2h_bytes_per_s(), machine.host_routed_bus_bytes_per_s)


def _attention_s(flops: float, spec: ModelSpec, micro_batch_size: int, seq_len: int, machine: Machine,
                 dtype: str) -> float:
    """Forward attention's time (the backward's is ATTENTION_BACKWARD_FACTOR times it): at the rate the profile
    measured for attention at this head size and sequence length (bf16), else estimated from GEMMs."""
    measured = machine.gpu.attention_efficiency(spec.head_dim, seq_len, micro_batch_size, spec.num_heads) \
        if dtype == "bf16" else None
    if measured:
        return flops / (machine.gpu.sustained_flops_for(dtype) * measured)
    # Flash attention runs all heads and sequences at once: as efficient as one GEMM of (tokens x heads) rows,
    # seq_len columns and head_dim depth. On the H200 that was 2.3 times what attention reached at TinyLlama's shape
    # (results/fidelity-profile-h200.json's curve against results/attention-h200.json).
    size = (micro_batch_size * seq_len * spec.num_heads * seq_len * spec.head_dim) ** (1 / 3)
    return flops / (machine.gpu.sustained_flops_for(dtype) * machine.gpu.gemm_efficiency_at(size))


RECOMPUTED_ELEMENTWISE = {"norm": 0.15, "swiglu": 0.3, "attention": 0.3}
"""Rough shares of a block's elementwise traffic that recomputing each part runs again."""


def _recompute_work(parts: tuple[str, ...], forward: dict[str, float], ffn: dict[str, float],
                    qkv: dict[str, float], attention: float, elementwise: float) -> dict[str, float]:
    if "block" in parts:
        return dict(forward)
    work = dict.fromkeys(KINDS, 0.0)
    work["elementwise"] = sum(elementwise * RECOMPUTED_ELEMENTWISE[p] for p in parts if p in RECOMPUTED_ELEMENTWISE)
    if "ffn" in parts:
        work["elementwise"] += elementwise * RECOMPUTED_ELEMENTWISE["swiglu"]
        for kind, seconds in ffn.items():
            work[kind] += seconds
    if "attention" in parts:
        work["attention"] += attention
    if "qkv" in parts:
        for kind, seconds in qkv.items():
            work[kind] += seconds
    return work
