"""The validation loss: the mean next-token loss over the validation split's first sequences (the same ones every
time), with the weights as they are, each rank taking its share and the ranks adding up their sums, so that every
layout (one process or several, offloaded, sharded, fp8) evaluates the same sequences to the same value but for the
order of the arithmetic."""

from __future__ import annotations

import math

import torch

from fastml.plan import Plan
from fastml.executor.model import fp8
from fastml.executor.parallel.collectives import agree
from fastml.executor.parallel.world import World
from fastml.executor.storage.data import TokenData, read_header, validation_path


class Validation:
    """The sequences one rank evaluates, in micro-batches of the plan's size, and when: training.eval_tokens of the
    split (at most all of it) in whole rounds of a micro-batch for every rank, at least one."""

    def __init__(self, plan: Plan, data: TokenData, world: World):
        t, micro = plan.training, plan.knobs.micro_batch_size
        per_round = micro * world.size  # a micro-batch for every rank
        rounds = max(1, min(t.eval_tokens // t.seq_len, data.num_windows) // per_round)
        self.num_sequences = rounds * per_round
        self.batches = data.fixed_batches(micro, self.num_sequences, world.rank, world.size)
        self.interval, self.steps, self.chunks = t.eval_interval, t.steps, plan.knobs.lm_head_chunks

    @classmethod
    def open(cls, plan: Plan, world: World, say=lambda message: None) -> Validation | None:
        """The plan's data's validation split, or None where it has none, or one too short for a micro-batch of
        every rank (`say` says so)."""
        t, micro = plan.training, plan.knobs.micro_batch_size
        path = validation_path(t.data)
        if path is None:
            return None
        windows = (read_header(path).num_tokens - 1) // t.seq_len
        if windows < micro * world.size:
            say(f"note: no validation loss: the validation split {path} holds {windows} sequence(s) of "
                f"{t.seq_len} tokens, fewer than a micro-batch of {micro} for each of {world.size} rank(s)")
            return None
        return cls(plan, TokenData.open(path, t.seq_len, plan.model.vocab_size), world)

    def due(self, steps_done: int) -> bool:
        """Whether an evaluation follows step `steps_done` (from 1): every `eval_interval` steps, and after the last."""
        return steps_done == self.steps or (self.interval > 0 and steps_done % self.interval == 0)

    def loss(self, model: torch.nn.Module, device: torch.device) -> float | None:
        """The mean loss per token over the sequences of every rank (a model built by executor/loop/build.py)."""
        model.placement.finish_steps()  # the last step's CPU work, where it overlaps the next step, first ends
        fp8.refresh_weight_caches(model)  # the fp8 copies of the weights as the last optimizer step left them
        on_device = [(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True))
                     for inputs, targets in self.batches]
        with torch.no_grad():
            if model.pp.active:  # the last stage's losses; the stages before it have none
                losses = model.pp.forward_losses(model, on_device, self.chunks)
            else:
                losses = [model.loss(inputs, targets, self.chunks) for inputs, targets in on_device]
            model.placement.end_evaluation()
        tokens = [targets.numel() for _, targets in self.batches][:len(losses)]
        mine = sum(loss * n for loss, n in zip(torch.stack(losses).double().tolist() if losses else [], tokens))
        rows = agree([mine, float(sum(tokens))])
        loss = sum(row[0] for row in rows) / sum(row[1] for row in rows)
        return loss if math.isfinite(loss) else None  # JSON has no NaN: logged as null, as a step's loss is
