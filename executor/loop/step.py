"""One optimizer step: forward and backward over the micro-batches, gradient clipping, the AdamW step."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from fastml.plan import Plan
from fastml.executor.model import fp8
from fastml.executor.parallel.collectives import agree
from fastml.executor.model.transformer import Transformer
from fastml.executor.memory.optim import AdamW, lr_at
from fastml.executor.parallel.world import SINGLE, World


@dataclass(frozen=True)
class StepHooks:
    """Called by the step at fixed points (the fault injection of the reliability tests uses them). `step` is the
    step being taken, counted from 1 as in the log."""

    after_loss: Callable[[int, torch.Tensor], torch.Tensor] = lambda step, loss: loss
    """Sees each micro-batch's loss before its backward pass; what it returns is used instead."""
    after_first_backward: Callable[[int], None] = lambda step: None
    """Runs once the first micro-batch's backward pass is done (the gradients are partly accumulated, or under a
    zero-bubble pipeline schedule, perhaps not yet)."""


def train_step(model: Transformer, optimizer: AdamW, batches, plan: Plan, step: int, device: torch.device,
               hooks: StepHooks = StepHooks(), meter=None, world: World = SINGLE,
               stop_requested: Callable[[], bool] = lambda: False) -> dict:
    """Optimizer step `step` (from 0) over grad_accum_steps micro-batches; returns its loss, lr and gradient norm. A
    step whose loss or gradient norm is not finite leaves the weights and optimizer state as they were ("skipped").
    A `meter` (meter.py) measures memory by category as the step goes.

    With several data-parallel ranks each micro-batch's loss is divided by the micro-batches of all, so that the
    gradients summed over the ranks (shard.py) are those of one process taking every micro-batch; the ranks then
    agree on the loss (their mean), on the gradient norm (optim.py) and so on skipping the step, and on whether any
    of them was asked to stop (`stop_requested`, the record's "stop"). The ranks of a tensor-parallel group take the
    same micro-batches and compute the same loss; under pipeline parallelism the last stage computes it."""
    knobs = plan.knobs
    micro_batches = knobs.grad_accum_steps * world.data.size
    if fp8.cached_linears(model):  # the cast reads every weight: the last step's CPU work (overlapped) first ends
        optimizer.finish_steps()
    fp8.refresh_weight_caches(model)  # the weights as the last step left them, cast to fp8 once for this one
    if optimizer.placement is not None:
        optimizer.placement.begin_step()
    if model.pp.active:
        losses = _pipeline_passes(model, optimizer, batches, plan, step, device, hooks, meter, micro_batches)
    else:
        losses = _passes(model, optimizer, batches, plan, step, device, hooks, meter, micro_batches)
    if meter is not None:
        meter.sample_states()  # every gradient is complete, no optimizer temporary exists yet
    # One wait for the device, after the whole step's work is queued; a pipeline stage before the last has no loss.
    mine = torch.stack(losses).tolist() if losses else [0.0] * knobs.grad_accum_steps
    stop = stop_requested()
    rows = agree([*mine, float(stop)]) if world.distributed else [[*mine, float(stop)]]
    loss_value = _step_loss([rows[rank] for rank in world.loss_ranks], micro_batches)
    stop = any(row[-1] for row in rows)
    clip = plan.training.grad_clip
    grad_norm = optimizer.clip_grad_norm_(clip if clip > 0 else float("inf"))
    skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
    lr = lr_at(step, plan.training)
    if not skipped:
        optimizer.set_lr(lr)
        optimizer.step()
    optimizer.zero_grad()
    # JSON has no NaN or infinity: a non-finite figure is logged as null.
    return {"step": step + 1, "loss": loss_value if math.isfinite(loss_value) else None, "lr": lr,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None, "skipped": skipped, "stop": stop}


def _passes(model: Transformer, optimizer: AdamW, batches, plan: Plan, step: int, device: torch.device,
            hooks: StepHooks, meter, micro_batches: int) -> list[torch.Tensor]:
    """The forward and backward pass of each of this rank's micro-batches in turn; their losses."""
    knobs, placement, losses = plan.knobs, optimizer.placement, []
    for micro in range(knobs.grad_accum_steps):
        if placement is not None:
            placement.begin_micro_batch(micro, last=micro == knobs.grad_accum_steps - 1)
        inputs, targets = next(batches)
        with meter.forward() if meter is not None else contextlib.nullcontext():
            loss = model.loss(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True),
                              knobs.lm_head_chunks)
        loss = hooks.after_loss(step + 1, loss)
        if micro == 0:  # the last step's CPU work is done before this step's gradients take its inputs' place
            optimizer.finish_steps()
        (loss / micro_batches).backward()
        losses.append(loss.detach())
        if micro == 0:
            hooks.after_first_backward(step + 1)
    return losses


def _pipeline_passes(model: Transformer, optimizer: AdamW, batches, plan: Plan, step: int, device: torch.device,
                     hooks: StepHooks, meter, micro_batches: int) -> list[torch.Tensor]:
    """This pipeline rank's passes over the step's micro-batches, in its schedule's order (parallel/pipeline.py);
    the losses where it holds the last stage. Every stage reads the micro-batches: the first embeds their tokens,
    the last takes their targets. Then the tied embedding's two gradients are summed."""
    knobs, placement = plan.knobs, optimizer.placement
    count = knobs.grad_accum_steps
    on_device = [tuple(t.to(device, non_blocking=True) for t in next(batches)) for _ in range(count)]

    def before_pass(micro: int) -> None:
        if placement is not None:  # the sharding engine reduces a group's gradients in its last micro-batch's pass
            placement.begin_micro_batch(micro, last=micro == count - 1)

    losses = model.pp.train_passes(model, on_device, knobs.lm_head_chunks, micro_batches,
                                   on_loss=lambda loss: hooks.after_loss(step + 1, loss),
                                   before_backward=optimizer.finish_steps,
                                   after_backward=lambda: hooks.after_first_backward(step + 1),
                                   before_pass=before_pass,
                                   measure_forward=meter.forward if meter is not None else contextlib.nullcontext)
    if model.spec.tied_embeddings and model.embed is not None:
        model.pp.sum_tied_gradients(optimizer.gradient(model.embed.weight))
    return losses


def _step_loss(rows: list[list[float]], micro_batches: int) -> float:
    """The mean of the step's micro-batch losses, added in float32 in the order of the data (rank r's micro-batch m
    is the step's micro-batch m * ranks + r, data.py): every layout, one process or several ranks, adds the same
    numbers in the same order, so the logged loss is the same bits on every machine."""
    ranks, total = len(rows), torch.zeros((), dtype=torch.float32)
    for index in range(micro_batches):
        total += rows[index % ranks][index // ranks]
    return total.item() / micro_batches
