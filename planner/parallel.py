"""Tensor and pipeline parallelism priced on top of the one-GPU model: a GPU of a layout trains its slice of the model
(`view`: its share of the heads, FFN width and vocabulary, the blocks of its pipeline stages) as a data-parallel rank
among the GPUs that hold the same slice, which the simulator and memory model already price; this module adds what
the layout itself costs. Tensor parallelism's all-reduces run between a block's matmuls, on the compute stream's
critical path (Megatron-LM's column- and row-parallel linears: two a block forward, two backward; Shoeybi et al. 2019,
section 3). The pipeline's step is its ranks' passes as planner/pipeline.py schedules them; the time it waits beyond
its busiest rank's work is its bubble. A stage in 1F1B keeps as many micro-batches' activations as it has passes in
flight (Narayanan et al. 2021, section 2.2: the first stage the most); in a zero-bubble schedule, each micro-batch
whose weights' gradients are still to make keeps its linears' inputs and output gradients besides.

What this leaves out: the view prices one rank with the most blocks and the head, where the head may sit on a stage
with fewer blocks (the pipeline's busiest rank is then priced right, the view's data-parallel work on top as if
there); the point-to-point sends overlap nothing but are priced on their link; tensor parallelism's collectives are
NCCL's on the node's links (knobs.comm is refused with a layout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastml.layout import Layout, stage_layers
from fastml.plan import Knobs, block_group, fp8_cached_blocks, tensor_slice
from fastml.spec import ModelSpec
from fastml.planner.costs import Costs, costs, link_bytes_per_s, recomputed_weight_share
from fastml.planner.hardware import Machine
from fastml.planner.memory import (Memory, activation_bytes, block_input_bytes, head_weight_gradient_bytes,
                                  layer_activation_bytes, memory, weight_gradient_inputs_bytes)
from fastml.planner.pipeline import PipelineRun, held_at_once, run_pipeline
from fastml.planner.simulate import Simulation, simulate

LOSS_STATISTICS = 3
"""The vocabulary-parallel cross-entropy's all-reduces of a float per token: the logits' maximum, the sum of their
exponentials and the target's logit (Megatron-LM's parallel cross-entropy)."""


def layout_of_knobs(knobs: Knobs, num_gpus: int) -> Layout:
    tensor, pipeline = knobs.tensor_parallel, knobs.pipeline_parallel
    return Layout(tensor, pipeline, num_gpus // (tensor * pipeline), knobs.virtual_stages)


def is_layout(knobs: Knobs) -> bool:
    return knobs.tensor_parallel * knobs.pipeline_parallel > 1


def rank_layers(spec: ModelSpec, layout: Layout) -> list[int]:
    """Blocks per pipeline rank: the layers of its virtual stages."""
    per_stage = stage_layers(spec.num_layers, layout.stages)
    return [sum(per_stage[rank::layout.pipeline]) for rank in range(layout.pipeline)]


def view(spec: ModelSpec, knobs: Knobs, machine: Machine) -> tuple[ModelSpec, Machine]:
    """The model and machine one GPU of the layout trains as a data-parallel rank: its tensor slice of the blocks of
    its busiest pipeline rank, with one vocabulary matrix where there are stages (the embedding on the first, the
    head on the last); the data-parallel group's GPUs as the machine, sharing the node's NIC, PCIe root and CPU
    with the node's other groups."""
    layout = layout_of_knobs(knobs, machine.num_gpus)
    sliced = tensor_slice(spec, layout.tensor)
    if layout.pipeline > 1:
        sliced = dataclasses.replace(sliced, num_layers=max(rank_layers(spec, layout)), tied_embeddings=True)
    physical = machine.gpus_per_node
    per_node = layout.data_group_per_node(physical)
    share = per_node / physical
    node = dataclasses.replace(machine.node, gpus_per_node=per_node,
                               nic_bytes_per_s=machine.node.nic_bytes_per_s * share,
                               h2d_all_gpus_bytes_per_s=machine.node.h2d_all_gpus_bytes_per_s * share,
                               cpu_adam_params_per_s=machine.node.cpu_adam_params_per_s * share)
    return sliced, dataclasses.replace(machine, num_gpus=layout.data, node=node)


@dataclass(frozen=True)
class TensorParallelCosts:
    """Seconds of tensor parallelism's collectives per micro-batch: per block pass, and the embedding's and head's."""

    forward: float
    backward: float
    recompute: float
    head: float


def tensor_parallel_costs(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> TensorParallelCosts:
    t = knobs.tensor_parallel
    if t == 1:
        return TensorParallelCosts(0.0, 0.0, 0.0, 0.0)
    hidden = knobs.micro_batch_size * seq_len * spec.hidden_size * activation_bytes(knobs)
    # Sequence parallelism swaps each all-reduce for a reduce-scatter and an all-gather: the bytes of one, twice the
    # launches (Korthikanti et al. 2022, section 4.2.2).
    calls = 2 if knobs.sequence_parallel else 1
    bandwidth = min(machine.bus_bytes_per_s["all_reduce"], link_bytes_per_s(machine))

    def all_reduce(num_bytes: float) -> float:
        return (calls * machine.collective_latency_s + 2 * num_bytes * (t - 1) / t / bandwidth) * \
            machine.calibration.transfer

    block = 2 * all_reduce(hidden)  # after attention's and the FFN's row-parallel matmul; their inputs' gradients
    recomputed = 2 if "block" in knobs.recompute else int("ffn" in knobs.recompute)
    statistics = LOSS_STATISTICS * knobs.micro_batch_size * seq_len * 4
    # the embedding's output and the head's input gradient, and the loss's statistics
    head = 2 * all_reduce(hidden) + LOSS_STATISTICS * all_reduce(statistics / LOSS_STATISTICS)
    return TensorParallelCosts(block, block, recomputed * all_reduce(hidden), head)


def p2p_s(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> float:
    """A micro-batch's activations (or their gradient) to the next stage: each tensor-parallel rank sends its
    1/tensor_parallel of them, gathered again on the other side (Narayanan et al. 2021, section 4.1), over the NIC
    where stages sit on other nodes, else the links between the node's GPUs."""
    layout = layout_of_knobs(knobs, machine.num_gpus)
    num_bytes = knobs.micro_batch_size * seq_len * spec.hidden_size * activation_bytes(knobs) / layout.tensor
    if layout.pipeline_crosses_nodes(machine.gpus_per_node):
        bandwidth = machine.node.nic_bytes_per_s / machine.gpus_per_node
    else:
        bandwidth = link_bytes_per_s(machine)
    return (machine.collective_latency_s + num_bytes / bandwidth) * machine.calibration.transfer


def block_passes(spec: ModelSpec, knobs: Knobs, machine: Machine, c: Costs,
                 tp: TensorParallelCosts) -> tuple[list[float], list[float]]:
    """Each block's forward and backward pass over a micro-batch at the view's prices, with its tensor-parallel
    collectives and, where it does not cache them, its weights' fp8 casts (again for its recompute, as simulate.py
    counts them)."""
    cached = fp8_cached_blocks(knobs, spec.num_layers, machine.num_gpus)
    recast = recomputed_weight_share(spec, knobs.recompute)
    forward, backward = [], []
    for i in range(spec.num_layers):
        cast_forward, cast_backward = (0.0, 0.0) if block_group(i) in cached else \
            (c.layer_weight_cast_forward, c.layer_weight_cast_backward)
        forward.append(c.layer_forward + cast_forward + tp.forward)
        backward.append(c.layer_backward + c.layer_recompute + cast_backward + recast * cast_forward + tp.backward +
                        tp.recompute)
    return forward, backward


def first_block_waits(knobs: Knobs, c: Costs, data_parallel: int, head_s: float) -> tuple[float, float, float]:
    """Seconds a pipeline pass waits before its first block computes, for what that block needs: (a forward pass's,
    a backward pass's, the last stage's backward pass's). The executor fetches a block's weights while the block
    before it computes (memory/placement.py), and a pass's first block has none before it in the pass: its weights
    are gathered from the data-parallel ranks' shards (ZeRO-3; a streamed shard up from the host first; in the
    backward pass, from the step's host copy with cache_weights_on_host), or come up from the host (streamed
    weights: with a pipeline, every block or none); its input comes back from the host for the backward pass
    (offload_residuals), the two counted one after the other. The last stage's head fetches its last block's for
    the backward pass while it runs (under GPipe, the next micro-batch's forward pass takes them first)."""
    streamed = knobs.offload_weights > 0
    if knobs.shard_weights and data_parallel > 1:
        forward_s = c.layer_weight_gather.comm_s + streamed * c.shard_h2d
        backward_s = c.layer_weights_h2d if (knobs.cache_weights_on_host and not streamed) else forward_s
    elif streamed:
        forward_s = backward_s = c.layer_masters_h2d if knobs.stream_masters else c.layer_weights_h2d
    else:
        forward_s = backward_s = 0.0
    backward_s += knobs.offload_residuals * c.layer_input_h2d
    hidden_s = 0.0 if knobs.pipeline_schedule == "gpipe" else min(head_s, backward_s)
    return forward_s, backward_s, backward_s - hidden_s


def pipeline_run(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine, c: Costs,
                 tp: TensorParallelCosts, data_parallel: int) -> PipelineRun:
    """The step's passes over the pipeline's ranks: each stage's blocks (`block_passes`) after its first block's
    weights and input (`first_block_waits`), the head and loss with the last stage's forward pass."""
    layout = layout_of_knobs(knobs, machine.num_gpus)
    forward, backward = block_passes(spec, knobs, machine, c, tp)
    per_stage = stage_layers(spec.num_layers, layout.stages)
    starts = [sum(per_stage[:s]) for s in range(layout.stages)]
    head_s = c.head_forward_backward + tp.head
    wait_forward_s, wait_backward_s, wait_last_backward_s = first_block_waits(knobs, c, data_parallel, head_s)
    forward_s = [wait_forward_s + sum(forward[a:a + n]) for a, n in zip(starts, per_stage)]
    backward_s = [wait_backward_s + sum(backward[a:a + n]) for a, n in zip(starts, per_stage)]
    forward_s[-1] += head_s
    backward_s[-1] += wait_last_backward_s - wait_backward_s
    weights = c.layer_backward * c.layer_weight_gradient_share
    return run_pipeline(knobs.pipeline_schedule, layout.pipeline, knobs.grad_accum_steps, layout.virtual,
                        forward_s, backward_s, p2p_s(spec, seq_len, knobs, machine) if layout.pipeline > 1 else 0.0,
                        [n * weights for n in per_stage])


def layout_memory(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Memory:
    """One GPU's memory (`memory`, of the view) with the activations of the micro-batches its pipeline rank holds at
    once beyond the one the view counts, and the output of each of its passes in flight, which the executor keeps
    for that pass's backward (executor/parallel/pipeline.py; in one process the final norm holds it, counted). Under
    GPipe the last stage also keeps each micro-batch's LM-head gradients, made with its loss (executor/model/loss.py),
    until that micro-batch's backward pass. Under zero bubble each micro-batch awaiting its weights' pass keeps its
    blocks' linears' inputs and output gradients (`weight_gradient_inputs_bytes`). The most a rank holds of all
    these at once is the layout's, a bound where a rank's most in flight and most awaiting come at different
    times. With offload_residuals (every block's, with a pipeline) each block input in flight is in host memory
    instead, a buffer each in every GPU's process."""
    sliced, dp = view(spec, knobs, machine)
    m = memory(sliced, seq_len, knobs, dp.num_gpus, machine.gpus_per_node, machine.device, machine.calibration)
    if knobs.pipeline_parallel == 1:
        return m
    layout = layout_of_knobs(knobs, machine.num_gpus)
    in_flights, awaitings = held_at_once(knobs.pipeline_schedule, layout.pipeline, knobs.grad_accum_steps,
                                         layout.virtual)
    chunk_layers = max(rank_layers(spec, layout)) / layout.virtual
    tokens = knobs.micro_batch_size * seq_len
    outputs = tokens // (layout.tensor if knobs.sequence_parallel else 1) * spec.hidden_size * activation_bytes(knobs)
    on_host_bytes = knobs.offload_residuals * block_input_bytes(sliced, knobs, tokens)
    activations = layer_activation_bytes(sliced, knobs, tokens, machine.device) - on_host_bytes
    kept_for_weights = weight_gradient_inputs_bytes(sliced, knobs, tokens)
    extra = int(max(max(0, in_flight - layout.virtual) * chunk_layers * activations + in_flight * outputs +
                    awaiting * chunk_layers * kept_for_weights
                    for in_flight, awaiting in zip(in_flights, awaitings)))
    if knobs.pipeline_schedule == "gpipe":  # the last stage runs every loss before the first backward pass
        extra += (knobs.grad_accum_steps - 1) * head_gradients_bytes(sliced, knobs, tokens)
    extra_host_bytes = int(max(0, max(in_flights) - layout.virtual) * chunk_layers * on_host_bytes *
                           machine.gpus_per_node)
    return dataclasses.replace(m, gpu_peak=m.gpu_peak + extra,
                               gpu=m.gpu | {"activations": m.gpu["activations"] + extra},
                               peak_phase=m.peak_phase | {"activations": m.peak_phase["activations"] + extra},
                               host=m.host | {"activations": m.host["activations"] + extra_host_bytes})


@dataclass(frozen=True)
class LayoutStep:
    view: Simulation
    """The view's simulated step (`view`)."""
    tensor_parallel_s: float
    """Tensor parallelism's collectives in the step of the pipeline's busiest rank."""
    bubble_s: float
    """The time that rank waits in the pipeline's step."""
    computed_less_s: float
    """What that rank computes less than the view prices: blocks of the view's rank it does not hold, or the head."""
    first_block_waits_s: float
    """What that rank's passes wait for their first blocks' weights and inputs (`first_block_waits`)."""


def layout_step(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> LayoutStep:
    sliced, dp = view(spec, knobs, machine)
    c = costs(sliced, seq_len, knobs, dp)
    tp = tensor_parallel_costs(spec, seq_len, knobs, machine)
    run = pipeline_run(spec, seq_len, knobs, machine, c, tp, dp.num_gpus)
    layout = layout_of_knobs(knobs, machine.num_gpus)
    m, busiest = knobs.grad_accum_steps, max(range(layout.pipeline), key=lambda r: run.busy_s[r])
    layers, has_head = rank_layers(spec, layout)[busiest], busiest == layout.pipeline - 1
    forward, backward = block_passes(spec, knobs, machine, c, TensorParallelCosts(0.0, 0.0, 0.0, 0.0))
    per_layer = (sum(forward) + sum(backward)) / spec.num_layers  # a block of the view's (casts averaged)
    forward_s, backward_s, last_backward_s = first_block_waits(knobs, c, dp.num_gpus, c.head_forward_backward +
                                                               tp.head) if layout.pipeline > 1 else (0.0, 0.0, 0.0)
    first_waits_s = layout.virtual * (forward_s + backward_s) + has_head * (last_backward_s - backward_s)
    return LayoutStep(simulate(sliced, seq_len, knobs, dp),
                      m * (layers * (tp.forward + tp.backward + tp.recompute) + has_head * tp.head),
                      max(0.0, run.step_s - run.busy_s[busiest]),
                      m * ((sliced.num_layers - layers) * per_layer + (not has_head) * c.head_forward_backward),
                      m * first_waits_s)


def layout_simulation(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Simulation:
    """The view's simulated step, its blocks' and head's passes replaced by the pipeline's (`layout_step`): tensor
    parallelism's collectives charged to exposed communication, the bubble to "other" (the compute stream waits),
    the passes' first blocks' waits to exposed communication (gathered) or offload (from the host), and what the
    busiest rank computes less than the view taken off compute."""
    step = layout_step(spec, seq_len, knobs, machine)
    time_s = dict(step.view.time_s)
    time_s["exposed_comm"] += step.tensor_parallel_s
    gathered = knobs.shard_weights and layout_of_knobs(knobs, machine.num_gpus).data > 1
    time_s["exposed_comm" if gathered else "exposed_offload"] += step.first_block_waits_s
    time_s["other"] += step.bubble_s
    time_s["compute"] = max(0.0, time_s["compute"] - step.computed_less_s)
    return dataclasses.replace(step.view, step_time_s=sum(time_s.values()), time_s=time_s)


def simulate_any(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Simulation:
    """The step of any plan: a layout's (`layout_simulation`) or a data-parallel one's (`simulate`)."""
    return layout_simulation(spec, seq_len, knobs, machine) if is_layout(knobs) else \
        simulate(spec, seq_len, knobs, machine)


def memory_any(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Memory:
    return layout_memory(spec, seq_len, knobs, machine) if is_layout(knobs) else \
        memory(spec, seq_len, knobs, machine.num_gpus, machine.gpus_per_node, machine.device, machine.calibration)


def head_gradients_bytes(spec: ModelSpec, knobs: Knobs, tokens: int) -> int:
    """What the LM head's loss keeps from its forward to its backward pass: the head weight's gradient and the hidden
    states' (executor/model/loss.py)."""
    return head_weight_gradient_bytes(spec, knobs) + tokens * spec.hidden_size * activation_bytes(knobs)
