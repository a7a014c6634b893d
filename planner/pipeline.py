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
    order = pipeline_order(schedule, pipeline, micro_batches, virtual)
    weights_s = weights_s if weights_s is not None and splits_backward(schedule) else [0.0] * len(backward_s)
    seconds_of = {"F": forward_s, "B": [b - w for b, w in zip(backward_s, weights_s)], "W": weights_s}
    stages = pipeline * virtual
    done: dict[Action, float] = {}
    rank_free = [0.0] * pipeline
    position = [0] * pipeline
    remaining = sum(map(len, order))
    while remaining:
        progressed = False
        for rank in range(pipeline):
            while position[rank] < len(order[rank]):
                action = order[rank][position[rank]]
                ready = _input_ready(action, stages, pipeline, done, p2p_s)
                if ready is None:
                    break
                start = max(rank_free[rank], ready)
                done[action] = rank_free[rank] = start + seconds_of[action.kind][action.stage]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"the {schedule} order deadlocks: rank passes wait on each other")
    busy = [sum(seconds_of[a.kind][a.stage] for a in actions) for actions in order]
    return PipelineRun(max(rank_free), tuple(busy), *held_at_once(schedule, pipeline, micro_batches, virtual))


@functools.lru_cache(maxsize=256)
def held_at_once(schedule: str, pipeline: int, micro_batches: int, virtual: int) -> tuple[tuple[int, ...], ...]:
    """`PipelineRun.in_flight` and `.awaiting_weights`: what the order alone decides, whatever the passes' times."""
    order = pipeline_order(schedule, pipeline, micro_batches, virtual)
    return (tuple(_most_between(actions, "F", "B") for actions in order),
            tuple(_most_between(actions, "B", "W") if splits_backward(schedule) else 0 for actions in order))


def _input_ready(action: Action, stages: int, pipeline: int, done: dict[Action, float],
                 p2p_s: float) -> float | None:
    """When the pass's input is on its rank, or None where the pass it waits for has not run yet."""
    if action.kind == "W":  # its own backward pass's
        source = action._replace(kind="B")
    elif action.kind == "F":
        source = Action("F", action.micro_batch, action.stage - 1) if action.stage > 0 else None
    elif action.stage == stages - 1:  # the loss's gradient, made by this stage's own forward pass
        source = Action("F", action.micro_batch, action.stage)
    else:
        source = Action("B", action.micro_batch, action.stage + 1)
    if source is None:
        return 0.0
    if source not in done:
        return None
    same_rank = source.stage % pipeline == action.stage % pipeline
    return done[source] + (0.0 if same_rank else p2p_s)


def _most_between(actions: list[Action], opens: str, closes: str) -> int:
    """The most passes of kind `opens` whose pass of kind `closes` has not run yet, at any point of `actions`."""
    held = most = 0
    for action in actions:
        held += (action.kind == opens) - (action.kind == closes)
        most = max(most, held)
    return most
