"""Pipeline parallelism on torch.distributed's point-to-point sends: each pipeline rank holds consecutive blocks (one
chunk of them, or `virtual` chunks for the interleaved schedules), and runs its passes in the order
`fastml.layout.pipeline_order` gives, the order the planner priced. A forward pass receives its input from the rank of
the stage before (the first stage embeds the tokens) and sends its output on; a backward pass receives the gradient of
its output from the stage after (the last stage takes its loss's) and sends the gradient of its input back. Where
the schedule splits the backward pass (zero bubble), it makes that gradient alone, and a later weights' pass of the
micro-batch makes the stage's weight gradients (model/deferred.py).

Sends never wait: a rank waits only for what it receives, so a valid schedule cannot deadlock. Each direction
between neighbouring pipeline ranks is a process group of its own (world.py `pipeline_links`), so that on NCCL,
which runs a group's transfers one after another on one stream, a rank's sends never queue ahead of its receives
(with one stream for both, interleaved 1F1B can deadlock: a send waiting for a receive its peer queued behind a
send of its own). On each link the receiver posts its receives in the order the sender sends them, each as the pass
before the one that needs it ends, or earlier where the sender sends another message first that is needed later
(interleaved zero bubble does): transports match them first in, first out (NCCL; gloo matches tags too, one per
message).

The last stage's loss is the step's; the embedding, where tied to the LM head, is held by the first stage and the
last, its two gradients summed (`sum_tied_gradients`) before the step; checkpoints gather every stage's whole tensors
on rank 0 (`gather_on_first`, through the process group's CPU side)."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fastml.executor.model import deferred
from fastml.layout import Action, pipeline_order, splits_backward, stage_layers

CPU = torch.device("cpu")


@dataclass(frozen=True)
class PipelineParallel:
    """This rank's place in the pipeline: `size` pipeline ranks of `virtual` chunks each, blocks split by
    `stage_layers`; `stride` global ranks between neighbouring pipeline ranks (tensor x data parallel) and `offset`
    this rank's place among those of its pipeline rank."""

    num_layers: int
    size: int = 1
    rank: int = 0
    virtual: int = 1
    schedule: str = "1f1b"
    stride: int = 1
    offset: int = 0
    links: dict = field(default_factory=dict, compare=False)
    """The process groups to and from the neighbouring pipeline ranks (world.py `pipeline_links`)."""

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def stages(self) -> int:
        return self.size * self.virtual

    def blocks_of(self, stage: int) -> range:
        layers = stage_layers(self.num_layers, self.stages)
        first = sum(layers[:stage])
        return range(first, first + layers[stage])

    @property
    def held_stages(self) -> list[int]:
        return list(range(self.rank, self.stages, self.size))

    @property
    def held_blocks(self) -> frozenset[int]:
        return frozenset(i for stage in self.held_stages for i in self.blocks_of(stage))

    @property
    def first(self) -> bool:
        """Holds the first stage: the embedding's lookup."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """Holds the last stage: the final norm, the LM head and the loss."""
        return self.rank == self.size - 1

    def rank_of(self, stage: int) -> int:
        """The global rank that holds `stage` for this rank's tensor- and data-parallel place."""
        return stage % self.size * self.stride + self.offset

    # --- one step's passes ------------------------------------------------------------------------------------

    def train_passes(self, model, micro_batches: list, chunks: int, scale: float, on_loss, before_backward,
                     after_backward, before_pass, measure_forward=contextlib.nullcontext) -> list[torch.Tensor]:
        """Runs this rank's forward and backward passes over `micro_batches` ((inputs, targets) on the device), each
        loss's gradient scaled by 1 / `scale`; returns the losses in micro-batch order (the last stage's; none
        elsewhere). `on_loss(loss)` sees each loss before its backward pass and returns the one to use;
        `before_backward()` runs before the first backward pass, `after_backward()` after it; `before_pass(micro)`
        before each pass, `measure_forward()` around each forward pass. The LM head runs over `chunks` slices of the
        tokens (model.head_loss)."""
        order = pipeline_order(self.schedule, self.size, len(micro_batches), self.virtual)
        links = _Links(self, order, model, micro_batches[0][0])
        mine, kept, losses, put_off = order[self.rank], {}, {}, {}
        first_backward = next(i for i, action in enumerate(mine) if action.kind == "B")
        links.post([], mine[0])
        for i, action in enumerate(mine):
            j, stage = action.micro_batch, action.stage
            before_pass(j)
            sends = []
            if action.kind == "F":
                x = micro_batches[j][0] if stage == 0 else links.take(("F", stage, j)).requires_grad_()
                with measure_forward():
                    out = model.stage(stage, x)
                    if stage == self.stages - 1:
                        out = model.head_loss(out, micro_batches[j][1], chunks)
                if stage == self.stages - 1:
                    out = on_loss(out)
                    losses[j] = out.detach()
                else:
                    sends.append((("F", stage + 1, j), out.detach().contiguous()))
                kept[stage, j] = (x, out)
            elif action.kind == "B":
                x, out = kept.pop((stage, j))
                if i == first_backward:
                    before_backward()
                last = stage == self.stages - 1
                out, grad = (out / scale, None) if last else (out, links.take(("B", stage, j)))
                if splits_backward(self.schedule):
                    input_grad, put_off[stage, j] = self._input_gradient(model, stage, x, out, grad)
                else:
                    torch.autograd.backward(out, grad)
                    input_grad = x.grad
                if stage > 0:
                    sends.append((("B", stage - 1, j), input_grad.contiguous()))
                if i == first_backward:
                    after_backward()
            else:
                self._weights_pass(model, stage, *put_off.pop((stage, j)))
            links.post(sends, mine[i + 1] if i + 1 < len(mine) else None)
        links.finish()
        return [losses[j] for j in sorted(losses)]

    def _input_gradient(self, model, stage: int, x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None):
        """A backward pass of a schedule that splits it: (the gradient of the stage's input `x`, or None for the
        first stage's tokens; what the weights' pass needs). The gradients it makes of the blocks' other parameters
        (their norms') are kept for that pass too, so that each of a block's gradients reaches its hooks there,
        once a micro-batch (model/deferred.py); the head's and the embedding's, whose gradients nothing puts off
        (the head's is made in the forward pass), are accumulated now."""
        blocks = [p for i in reversed(self.blocks_of(stage)) for p in model.blocks[i].parameters()]
        ends = ([*model.norm.parameters(), model.lm_head_weight] if stage == self.stages - 1 else []) + \
            ([model.embed.weight] if stage == 0 else [])
        inputs = ([x] if stage > 0 else []) + blocks + ends
        with deferred.put_off() as linears:
            grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
        made = dict(zip(inputs, grads))
        _accumulate([(p, made[p]) for p in ends])
        return (grads[0] if stage > 0 else None), ({p: made[p] for p in blocks if made[p] is not None}, linears)

    def _weights_pass(self, model, stage: int, made: dict, linears: list) -> None:
        """The weights' pass of a split backward pass (`_input_gradient`): each block's gradients accumulated into
        their parameters by autograd, as their hooks expect, from the last block to the first, a linear's weight
        gradient made just before (one at a time: the pass holds no more of them at once than a backward pass)."""
        kept = {k.weight: k for k in linears}
        for i in reversed(self.blocks_of(stage)):
            for p in model.blocks[i].parameters():
                if p in kept:
                    _accumulate(kept.pop(p).gradients())
                elif p in made:
                    _accumulate([(p, made.pop(p))])

    @torch.no_grad()
    def forward_losses(self, model, micro_batches: list, chunks: int) -> list[torch.Tensor]:
        """The losses of `micro_batches` without gradients (the validation loss): every micro-batch through the
        stages in turn; the last stage's losses, none elsewhere."""
        order = [[Action("F", j, stage) for j in range(len(micro_batches)) for stage in range(rank, self.stages,
                                                                                               self.size)]
                 for rank in range(self.size)]
        links, mine = _Links(self, order, model, micro_batches[0][0]), order[self.rank]
        links.post([], mine[0])
        losses = []
        for i, (_, j, stage) in enumerate(mine):
            x = micro_batches[j][0] if stage == 0 else links.take(("F", stage, j))
            out = model.stage(stage, x)
            sends = []
            if stage == self.stages - 1:
                losses.append(model.head_loss(out, micro_batches[j][1], chunks))
            else:
                sends.append((("F", stage + 1, j), out.contiguous()))
            links.post(sends, mine[i + 1] if i + 1 < len(mine) else None)
        links.finish()
        return losses

    # --- between the first stage and the last -----------------------------------------------------------------

    def sum_tied_gradients(self, gradient: torch.Tensor | None) -> None:
        """The embedding's gradient (what the optimizer reads of it on this rank) where the first and last stages
        both hold it, tied to the LM head: each adds the other's, so both step the same sum (a + b is b + a in
        floating point: the two stay the same bits)."""
        if not (self.active and (self.first or self.last)) or gradient is None:
            return
        peer = self.size - 1 if self.first else 0
        send = dist.isend(gradient.contiguous(), self.rank_of(peer), group=self.links["to", peer])
        other = torch.empty_like(gradient)
        dist.irecv(other, self.rank_of(peer), group=self.links["from", peer]).wait()
        send.wait()
        gradient.add_(other)

    def gather_on_first(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every pipeline rank's `tensors` (whole, in host memory, those of the first rank of its tensor- and
        data-parallel groups) on global rank 0, in stage order, a tensor at a time; a name two stages hold (the tied
        embedding) is taken from the first. Every rank calls it; rank 0 returns them all, the others {}."""
        if not self.active:
            return tensors
        if self.rank == 0 and self.offset == 0:
            gathered = dict(tensors)
            for rank in range(1, self.size):
                header = [None]
                dist.recv_object_list(header, src=rank * self.stride, device=CPU)
                for name, shape, dtype in header[0]:
                    tensor = torch.empty(shape, dtype=dtype)
                    dist.recv(tensor, src=rank * self.stride)
                    gathered.setdefault(name, tensor)
            return gathered
        if self.offset == 0:  # on the process group's CPU side (gloo), as rank 0 receives them
            dist.send_object_list([[(name, t.shape, t.dtype) for name, t in tensors.items()]], dst=0, device=CPU)
            for t in tensors.values():
                dist.send(t.detach().cpu().contiguous(), dst=0)
        return {}


def _accumulate(gradients: list[tuple[torch.nn.Parameter, torch.Tensor | None]]) -> None:
    """Adds each gradient into its parameter's as a backward pass does: through autograd, so that the parameter's
    hooks run."""
    gradients = [(p, g) for p, g in gradients if g is not None]
    if gradients:
        torch.autograd.backward([p for p, _ in gradients], [g for _, g in gradients])


class _Links:
    """One rank's messages of one step: ("F", stage, micro-batch) is the input of that forward pass, sent by the
    rank of the stage before; ("B", stage, micro-batch) the gradient of that stage's output, sent by the rank of the
    stage after. All of them are the hidden states (B, T, h) of a micro-batch of `tokens`' shape, in the model's
    dtype, this rank's slice of the sequence under sequence parallelism."""

    def __init__(self, pipeline: PipelineParallel, order: list[list[Action]], model, tokens: torch.Tensor):
        tp, (batch, length) = model.tp, tokens.shape
        self.shape = (batch, length // tp.size if tp.sequence else length, model.spec.hidden_size)
        self.pipeline, self.dtype, self.device = pipeline, model.dtype, tokens.device
        self.incoming: dict[int, deque] = {}  # sender's pipeline rank -> what it sends this rank, in its order
        for sender, actions in enumerate(order):
            for action in actions:
                key = _sent_by(action, pipeline.stages)
                if key is not None and key[1] % pipeline.size == pipeline.rank:
                    self.incoming.setdefault(sender, deque()).append(key)
        self.arrived: dict[tuple, tuple[torch.Tensor, object]] = {}  # posted receives: (buffer, its work)
        self.in_flight: list[tuple[object, torch.Tensor]] = []  # sends not known to be done: (work, tensor)

    def post(self, sends: list[tuple[tuple, torch.Tensor]], next_action: Action | None) -> None:
        """Starts `sends`, and the receive `next_action` needs."""
        self.in_flight = [(work, tensor) for work, tensor in self.in_flight if not work.is_completed()]
        for key, tensor in sends:  # kept until sent
            receiver = key[1] % self.pipeline.size
            self.in_flight.append((dist.isend(tensor, self.pipeline.rank_of(key[1]), tag=self._tag(key),
                                              group=self.pipeline.links["to", receiver]), tensor))
        needed = _received_by(next_action, self.pipeline.stages) if next_action is not None else None
        if needed is None or needed in self.arrived:
            return
        sender = _source(needed) % self.pipeline.size
        while True:  # and before it, any message the sender sends first (interleaved zero bubble has some)
            key = self.incoming[sender].popleft()
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.arrived[key] = (buffer, dist.irecv(buffer, self.pipeline.rank_of(_source(key)), tag=self._tag(key),
                                                    group=self.pipeline.links["from", sender]))
            if key == needed:
                return

    def take(self, key: tuple) -> torch.Tensor:
        tensor, work = self.arrived.pop(key)
        work.wait()
        return tensor

    def finish(self) -> None:
        """Waits for this step's sends (their tensors must outlive them; each work is waited on once: a gloo work
        waited on twice hangs)."""
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()

    def _tag(self, key: tuple) -> int:
        """One tag per message of a step (gloo matches by it too; NCCL ignores it)."""
        kind, stage, micro = key
        return (micro * self.pipeline.stages + stage) * 2 + (kind == "B")


def _sent_by(action: Action, stages: int) -> tuple | None:
    """The message the pass `action` sends: its output to the next stage, or its input's gradient to the one before
    (a weights' pass sends none)."""
    if action.kind == "W":
        return None
    if action.kind == "F":
        return ("F", action.stage + 1, action.micro_batch) if action.stage + 1 < stages else None
    return ("B", action.stage - 1, action.micro_batch) if action.stage > 0 else None


def _received_by(action: Action, stages: int) -> tuple | None:
    """The message the pass `action` needs: its input from the stage before, or its output's gradient from the one
    after (a weights' pass needs none)."""
    if action.kind == "W":
        return None
    if action.kind == "F":
        return ("F", action.stage, action.micro_batch) if action.stage > 0 else None
    return ("B", action.stage, action.micro_batch) if action.stage + 1 < stages else None


def _source(key: tuple) -> int:
    """The stage whose pass sends message `key`."""
    kind, stage, _ = key
    return stage - 1 if kind == "F" else stage + 1


