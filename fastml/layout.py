"""How a plan lays the model out over its GPUs: tensor parallelism inside a block, pipeline stages across the blocks,
and data parallelism over what is left, with the order each pipeline rank runs its micro-batches in. Part of the
contract: the planner prices this order and the executor runs it (executor/parallel/pipeline.py).

The GPUs of a job are numbered tensor-parallel rank fastest, then data-parallel, then pipeline stage (Megatron-LM's
order): a tensor-parallel group is the neighbouring GPUs of one node, and pipeline stages are the farthest apart, their
point-to-point sends the traffic that crosses nodes best.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
"""Pipeline schedules: GPipe (every forward pass, then every backward pass), 1F1B (PipeDream-Flush: a stage keeps at
most as many micro-batches in flight as stages after it), interleaved 1F1B (each rank holds `virtual_stages`
chunks of the blocks, shrinking the bubble by as much; Narayanan et al. 2021, section 2.2) and zero bubble (1F1B whose
backward passes make only their input's gradient, which the stage before waits for; the weights' gradients, which
nothing waits for, are passes of their own that fill the bubble: Qi et al. 2024, ZB-H1, and with `virtual_stages`
chunks its interleaved form, torch.distributed.pipelining's ScheduleInterleavedZeroBubble)."""


@dataclass(frozen=True)
class Layout:
    tensor: int
    pipeline: int
    data: int
    virtual: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1 otherwise."""

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: chunks of consecutive blocks, stage s on pipeline rank s % pipeline."""
        return self.pipeline * self.virtual

    def tensor_group_in_node(self, gpus_per_node: int) -> bool:
        return self.tensor <= gpus_per_node

    def data_group_per_node(self, gpus_per_node: int) -> int:
        """How many ranks of one data-parallel group share a node (tensor-parallel ranks being the fastest)."""
        return max(1, min(self.data, gpus_per_node // self.tensor))

    def pipeline_crosses_nodes(self, gpus_per_node: int) -> bool:
        """Whether neighbouring pipeline stages sit on different nodes."""
        return self.tensor * self.data >= gpus_per_node


def layout_of(tensor_parallel: int, pipeline_parallel: int, virtual_stages: int, num_gpus: int) -> Layout:
    return Layout(tensor_parallel, pipeline_parallel, num_gpus // (tensor_parallel * pipeline_parallel),
                  virtual_stages)


def stage_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per virtual stage, in order: an even split, the blocks left over going one each to the stages after the
    first (the first stage holds the embedding and, in 1F1B, the most micro-batches in flight)."""
    base, extra = divmod(num_layers, stages)
    return tuple(base + (1 <= s <= extra) for s in range(stages))


def layout_problem(tensor: int, sequence_parallel: bool, pipeline: int, virtual: int, grad_accum_steps: int,
                   heads: int, kv_heads: int, ffn: int, vocab: int, num_layers: int, seq_len: int, num_gpus: int,
                   gpus_per_node: int) -> tuple[str, str]:
    """(knob, why) where the layout cannot be laid on this model and hardware; ("", "") where it can."""
    for name, size in (("num_heads", heads), ("num_kv_heads", kv_heads), ("ffn_hidden_size", ffn),
                       ("vocab_size", vocab)):
        if size % tensor:
            return "tensor_parallel", f"{tensor} must divide the model's {name} {size} (each GPU computes a slice)"
    if gpus_per_node % tensor:
        return "tensor_parallel", (f"{tensor} must divide the {gpus_per_node} GPUs of a node: its collectives run "
                                   f"twice a block and belong on the links inside a node")
    if sequence_parallel and seq_len % tensor:
        return "sequence_parallel", f"slices the sequence: tensor_parallel {tensor} must divide seq_len {seq_len}"
    if num_gpus % (tensor * pipeline):
        return "pipeline_parallel", (f"tensor_parallel {tensor} x pipeline_parallel {pipeline} must divide the "
                                     f"{num_gpus} GPUs (the rest is data parallel)")
    if pipeline * virtual > num_layers:
        return "pipeline_parallel", (f"{pipeline} x virtual_stages {virtual} stages for {num_layers} blocks: a stage "
                                     f"needs at least one block")
    if virtual > 1 and grad_accum_steps % interleaved_rounds(pipeline, grad_accum_steps):
        return "pipeline_schedule", (f"interleaved schedules run the micro-batches in rounds of about "
                                     f"pipeline_parallel {pipeline}: {grad_accum_steps} micro-batches "
                                     f"(grad_accum_steps) are not whole rounds of "
                                     f"{interleaved_rounds(pipeline, grad_accum_steps)}")
    return "", ""


def interleaved_rounds(pipeline: int, micro_batches: int) -> int:
    """Rounds of interleaved 1F1B: each runs a round's micro-batches through one chunk before the next chunk."""
    return max(1, micro_batches // pipeline)


class Action(NamedTuple):
    """One pass of a pipeline rank: the forward ("F") or backward ("B") pass of a micro-batch through a virtual
    stage, or ("W") the pass that makes its weights' gradients where the schedule splits them from the backward pass
    (`splits_backward`)."""

    kind: str
    micro_batch: int
    stage: int


def splits_backward(schedule: str) -> bool:
    """Whether the schedule's backward passes make their input's gradient alone, a "W" pass the weights' later."""
    return schedule == "zero_bubble"


def pipeline_order(schedule: str, pipeline: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """Per pipeline rank, its passes in the order it runs them. 1F1B's, interleaved 1F1B's and zero bubble's are
    torch.distributed.pipelining's (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble;
    tests/test_model_parallel.py compares them)."""
    return [list(actions) for actions in _pipeline_order(schedule, pipeline, micro_batches, virtual)]


@functools.lru_cache(maxsize=256)
def _pipeline_order(schedule: str, pipeline: int, micro_batches: int, virtual: int) -> tuple[tuple[Action, ...], ...]:
    """`pipeline_order`, kept: the planner prices the same few orders for many plans."""
    return tuple(map(tuple, _order(schedule, pipeline, micro_batches, virtual)))


def _order(schedule: str, pipeline: int, micro_batches: int, virtual: int) -> list[list[Action]]:
    if schedule == "gpipe":
        return [[Action("F", j, r) for j in range(micro_batches)] + [Action("B", j, r) for j in range(micro_batches)]
                for r in range(pipeline)]
    if schedule == "1f1b":
        return [_one_forward_one_backward(pipeline, micro_batches, 1, r) for r in range(pipeline)]
    if schedule == "interleaved_1f1b":
        return [_one_forward_one_backward(pipeline, micro_batches, virtual, r) for r in range(pipeline)]
    if schedule == "zero_bubble":
        return [_one_forward_one_backward(pipeline, micro_batches, virtual, r, zero_bubble=True)
                for r in range(pipeline)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _one_forward_one_backward(pipeline: int, micro_batches: int, virtual: int, rank: int,
                              zero_bubble: bool = False) -> list[Action]:
    """Warm-up forward passes, then one forward and one backward pass in turn, then the backward passes left. With
    several chunks a rank (`virtual`), the passes go through its chunks a round of micro-batches at a time, forward
    from the first chunk and backward from the last. `zero_bubble`: each backward pass after the rank's first `rank`
    ones is followed by the weights' pass ("W") of the oldest backward pass still without one, the rest at the end
    (ZB-H1: rank r puts off r of them, filling the time 1F1B waits for the stages after it; its interleaved form
    warms up with one pass a later rank instead of two)."""
    per_round = micro_batches // interleaved_rounds(pipeline, micro_batches) if virtual > 1 else micro_batches
    total = micro_batches * virtual
    if virtual == 1:
        warmup = min(pipeline - 1 - rank, micro_batches)
    else:
        warmup = min((virtual - 1) * per_round + (1 if zero_bubble else 2) * (pipeline - 1 - rank), total)
    next_micro_batch = {"F": {}, "B": {}}

    def action(kind: str, k: int) -> Action:
        chunk = (k // per_round) % virtual
        stage = (chunk if kind == "F" else virtual - 1 - chunk) * pipeline + rank
        j = next_micro_batch[kind].get(stage, 0)
        next_micro_batch[kind][stage] = j + 1
        return Action(kind, j, stage)

    order, without_weights = [action("F", k) for k in range(warmup)], deque()

    def backward(k: int) -> list[Action]:
        b = action("B", k)
        without_weights.append(b)
        if not zero_bubble or k < rank:
            return [b]
        return [b, without_weights.popleft()._replace(kind="W")]

    for k in range(total - warmup):
        order += [action("F", warmup + k), *backward(k)]
    for k in range(total - warmup, total):
        order += backward(k)
    if zero_bubble:
        order += [b._replace(kind="W") for b in without_weights]
    return order
