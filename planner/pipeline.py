"""A pipeline's step as its ranks run it: each rank's passes in the contract's order (fastml.layout.pipeline_order),
each pass waiting for the one before it on its rank and for its input from the neighbouring stage (a forward pass for
the stage before's output, a backward pass for the stage after's gradient), the send between ranks taking `p2p_s`.

Closed forms hold only for equal stages and free sends (the bubble of GPipe and 1F1B is (p-1)/(m+p-1) of the step,
interleaved 1F1B's (p-1)/v of a micro-batch's passes more; Narayanan et al. 2021, section 2.2; ZB-H1's (p-1) times
a forward and an input-gradient pass less a weights' pass, Qi et al. 2024); scheduling the passes themselves also
prices uneven stages, the sends, and a rank that runs ahead of the one after it. tests/test_model_parallel.py checks
the closed forms.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

from fastml.layout import Action, pipeline_order, splits_backward


@dataclass(frozen=True)
class PipelineRun:
    step_s: float
    """From the first forward pass to the last backward pass of the step, on any rank."""
    busy_s: tuple[float, ...]
    """Per pipeline rank, the seconds it computes."""
    in_flight: tuple[int, ...]
    """Per pipeline rank, the most micro-batch chunks whose forward pass it has run and backward pass not yet: the
    activations it holds at once, in chunks (a stage's blocks, a rank's share of them when interleaved)."""
    awaiting_weights: tuple[int, ...] = ()
    """Per pipeline rank, the most micro-batch chunks whose backward pass it has run and weights' pass ("W") not
    yet, at any moment (schedules that split the backward pass; zeros otherwise): what each keeps for its weights'
    gradients."""

    def bubble_s(self, rank: int) -> float:
        """The time rank `rank` waits within the step."""
        return self.step_s - self.busy_s[rank]


def run_pipeline(schedule: str, pipeline: int, micro_batches: int, virtual: int, forward_s: list[float],
                 backward_s: list[float], p2p_s: float, weights_s: list[float] | None = None) -> PipelineRun:
    """The step of `pipeline` ranks, each virtual stage s's forward and backward pass taking forward_s[s] and
    backward_s[s] (the last stage's forward pass with the loss); weights_s[s] of that backward pass makes the
    weights' gradients, a pass of its own where the schedule splits them off (`splits_backward`)."""
    weights_s = weights_s if weights_s is not None and splits_backward(schedule) else [0.0] * len(backward_s)
    seconds_of = (forward_s, [b - w for b, w in zip(backward_s, weights_s)], weights_s)  # by PASS_KINDS
    rank_free = [0.0] * pipeline
    busy = [0.0] * pipeline
    done: list[float] = []
    for rank, kind, stage, source, same_rank in zip(*_passes_in_order(schedule, pipeline, micro_batches, virtual)):
        ready = 0.0 if source < 0 else done[source] + (0.0 if same_rank else p2p_s)
        seconds = seconds_of[kind][stage]
        rank_free[rank] = max(rank_free[rank], ready) + seconds
        done.append(rank_free[rank])
        busy[rank] += seconds
    return PipelineRun(max(rank_free), tuple(busy), *held_at_once(schedule, pipeline, micro_batches, virtual))


PASS_KINDS = "FBW"


@functools.lru_cache(maxsize=16)
def _passes_in_order(schedule: str, pipeline: int, micro_batches: int, virtual: int) -> tuple[array, ...]:
    """Every pass of the step as columns (rank, kind, stage, source, same_rank), each pass after the one before it
    on its rank and after `source`, the index of the pass whose output it takes (-1 for none; `same_rank` where that
    pass ran on its rank, so no send); `kind` indexes PASS_KINDS. One walk over it prices a step, whatever order the
    ranks' clocks interleave in. The planner prices the same few orders for many plans, and found which pass waits
    on which at every step before (28.8 million such lookups to plan 1,024 GPUs). Arrays, not tuples: the sampler
    draws pipelines of millions of passes."""
    order = pipeline_order(schedule, pipeline, micro_batches, virtual)
    stages = pipeline * virtual
    index: dict[Action, int] = {}
    passes = []
    position = [0] * pipeline
    blocked_on: dict[Action, list[int]] = {}  # a pass not placed yet: the ranks whose next pass waits for it
    runnable = list(range(pipeline))
    while runnable:
        rank = runnable.pop()
        while position[rank] < len(order[rank]):
            action = order[rank][position[rank]]
            source = _source(action, stages)
            if source is not None and source not in index:
                blocked_on.setdefault(source, []).append(rank)
                break
            index[action] = len(passes)
            same_rank = source is not None and source.stage % pipeline == rank
            passes.append((rank, PASS_KINDS.index(action.kind), action.stage,
                           -1 if source is None else index[source], same_rank))
            position[rank] += 1
            runnable.extend(blocked_on.pop(action, ()))
    if len(passes) < sum(map(len, order)):
        raise ValueError(f"the {schedule} order deadlocks: rank passes wait on each other")
    return tuple(array(code, column) for code, column in zip("iBiqB", zip(*passes)))


@functools.lru_cache(maxsize=256)
def held_at_once(schedule: str, pipeline: int, micro_batches: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    """`PipelineRun.in_flight` and `.awaiting_weights`: what the order alone decides, whatever the passes' times."""
    order = pipeline_order(schedule, pipeline, micro_batches, virtual)
    return (tuple(_most_between(actions, "F", "B") for actions in order),
            tuple(_most_between(actions, "B", "W") if splits_backward(schedule) else 0 for actions in order))


def _source(action: Action, stages: int) -> Action | None:
    """The pass whose output `action` takes as its input, or None for a first stage's forward pass."""
    if action.kind == "W":  # its own backward pass's
        return action._replace(kind="B")
    if action.kind == "F":
        return Action("F", action.micro_batch, action.stage - 1) if action.stage > 0 else None
    if action.stage == stages - 1:  # the loss's gradient, made by this stage's own forward pass
        return Action("F", action.micro_batch, action.stage)
    return Action("B", action.micro_batch, action.stage + 1)


def _most_between(actions: list[Action], opens: str, closes: str) -> int:
    """The most passes of kind `opens` whose pass of kind `closes` has not run yet, at any point of `actions`."""
    held = most = 0
    for action in actions:
        held += (action.kind == opens) - (action.kind == closes)
        most = max(most, held)
    return most
