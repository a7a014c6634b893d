"""Pipeline parallelism on torch.distributed's point-to-point sends: each pipeline rank holds consecutive blocks (one
chunk of them, or `virtual` chunks for interleaved 1F1B), and runs its passes in the order
`fastml.layout.pipeline_order` gives, the order the planner priced. A forward pass receives its input from the rank of the stage before (the first
stage embeds the tokens) and sends its output on; a backward pass receives the gradient of its output from the stage
after (the last stage takes its loss's) and sends the gradient of its input back.

Sends never wait: a rank waits only for what it receives, so a valid schedule cannot deadlock. The receives a pass
needs are posted together with the sends of the pass before, in one `batch_isend_irecv` (Megatron-LM's pairing of
send_forward with recv_backward: NCCL runs a batch's transfers together, where separate ones queue behind each
other on one stream). A rank posts its receives from a peer in the order that peer sends them, whatever order it
consumes them in, so that transports that match messages first in, first out (NCCL) match them right.

The last stage's loss is the step's; the embedding, where tied to the LM head, is held by the first stage and the
last, its two gradients summed (`sum_tied_gradients`) before the step; checkpoints gather every stage's whole tensors
on rank 0 (`gather_on_first`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastml.layout import Action, pipeline_order, stage_layers


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

    def connect(self, device: torch.device) -> None:
        """NCCL makes a group's communicator at its first call, which then must be every rank's (torch's
        batch_isend_irecv says so), where the first stage's first send would be two ranks' alone: one collective of
        the whole job on the device makes it first."""
        if self.active and device.type == "cuda":
            dist.all_reduce(torch.zeros(1, device=device))

    # --- one step's passes ------------------------------------------------------------------------------------

    def train_passes(self, model, micro_batches: list, chunks: int, scale: float, on_loss, before_backward,
                     after_backward, before_pass) -> list[torch.Tensor]:
        """Runs this rank's forward and backward passes over `micro_batches` ((inputs, targets) on the device), each
        loss's gradient scaled by 1 / `scale`; returns the losses in micro-batch order (the last stage's; none
        elsewhere). `on_loss(loss)` sees each loss before its backward pass and returns the one to use;
        `before_backward()` runs before the first backward pass, `after_backward()` after it; `before_pass(micro)`
        before each pass. The LM head runs over `chunks` slices of the tokens (model.head_loss)."""
        order = pipeline_order(self.schedule, self.size, len(micro_batches), self.virtual)
        links = _Links(self, order, _activation_shape(model, micro_batches[0][0]), model.dtype,
                       micro_batches[0][0].device)
        mine, kept, losses = order[self.rank], {}, {}
        first_backward = next(i for i, action in enumerate(mine) if action.kind == "B")
        links.post([], mine[0])
        for i, action in enumerate(mine):
            j, stage = action.micro_batch, action.stage
            before_pass(j)
            sends = []
            if action.kind == "F":
                x = micro_batches[j][0] if stage == 0 else links.take(("F", stage, j)).requires_grad_()
                out = model.stage(stage, x)
                if stage == self.stages - 1:
                    out = on_loss(model.head_loss(out, micro_batches[j][1], chunks))
                    losses[j] = out.detach()
                else:
                    sends.append((("F", stage + 1, j), out.detach().contiguous()))
                kept[stage, j] = (x, out)
            else:
                x, out = kept.pop((stage, j))
                if i == first_backward:
                    before_backward()
                if stage == self.stages - 1:
                    (out / scale).backward()
                else:
                    torch.autograd.backward(out, links.take(("B", stage, j)))
                if stage > 0:
                    sends.append((("B", stage - 1, j), x.grad.contiguous()))
                if i == first_backward:
                    after_backward()
            links.post(sends, mine[i + 1] if i + 1 < len(mine) else None)
        links.finish()
        return [losses[j] for j in sorted(losses)]

    @torch.no_grad()
    def forward_losses(self, model, micro_batches: list, chunks: int) -> list[torch.Tensor]:
        """The losses of `micro_batches` without gradients (the validation loss): every micro-batch through the
        stages in turn; the last stage's losses, none elsewhere."""
        mine = [Action("F", j, stage) for j in range(len(micro_batches)) for stage in self.held_stages]
        order = [[Action("F", j, stage) for j in range(len(micro_batches)) for stage in range(rank, self.stages,
                                                                                               self.size)]
                 for rank in range(self.size)]
        links = _Links(self, order, _activation_shape(model, micro_batches[0][0]), model.dtype,
                       micro_batches[0][0].device)
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
        other = torch.empty_like(gradient)
        peer = self.rank_of(self.stages - 1 if self.first else 0)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, gradient.contiguous(), peer),
                                        dist.P2POp(dist.irecv, other, peer)])
        for work in works:
            work.wait()
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
                dist.recv_object_list(header, src=rank * self.stride)
                for name, shape, dtype in header[0]:
                    tensor = torch.empty(shape, dtype=dtype)
                    dist.recv(tensor, src=rank * self.stride)
                    gathered.setdefault(name, tensor)
            return gathered
        if self.offset == 0:
            dist.send_object_list([[(name, t.shape, t.dtype) for name, t in tensors.items()]], dst=0)
            for t in tensors.values():
                dist.send(t.contiguous(), dst=0)
        return {}


def _activation_shape(model, tokens: torch.Tensor) -> tuple[int, int, int]:
    """What passes between stages: the hidden states (B, T, h), this rank's slice of the sequence under sequence
    parallelism."""
    tp = model.tp
    length = tokens.shape[1] // tp.size if tp.sequence else tokens.shape[1]
    return tokens.shape[0], length, model.spec.hidden_size


class _Links:
    """One rank's messages of one step: ("F", stage, micro-batch) is the input of that forward pass, sent by the
    rank of the stage before; ("B", stage, micro-batch) the gradient of that stage's output, sent by the rank of the
    stage after. All of them have the activations' shape."""

    def __init__(self, pipeline: PipelineParallel, order: list[list[Action]], shape, dtype, device):
        self.pipeline, self.shape, self.dtype, self.device = pipeline, shape, dtype, device
        self.incoming: dict[int, deque] = {}  # sender's pipeline rank -> what it sends this rank, in its order
        for sender, actions in enumerate(order):
            for action in actions:
                key = _sent_by(action, pipeline.stages)
                if key is not None and key[1] % pipeline.size == pipeline.rank:
                    self.incoming.setdefault(sender, deque()).append(key)
        self.arrived: dict[tuple, tuple[torch.Tensor, _Once]] = {}
        self.in_flight: list[tuple[_Once, torch.Tensor]] = []

    def post(self, sends: list[tuple[tuple, torch.Tensor]], next_action: Action | None) -> None:
        """Starts `sends` and the receive `next_action` needs (with those the same peer sends before it) together."""
        ops = [dist.P2POp(dist.isend, tensor, self.pipeline.rank_of(key[1]), tag=self._tag(key))
               for key, tensor in sends]
        needed = _received_by(next_action, self.pipeline.stages) if next_action is not None else None
        receiving = []
        if needed is not None and needed not in self.arrived:
            queue = self.incoming[_sender(needed, self.pipeline.size)]
            while needed not in receiving:
                key = queue.popleft()
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.pipeline.rank_of(_source(key)), tag=self._tag(key)))
                receiving.append(key)
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        # NCCL returns one work for the whole batch, gloo one per op; a gloo work waited on twice hangs.
        works = [_Once(work) for work in works] if len(works) == len(ops) else [_Once(works[0])] * len(ops)
        for key, work, op in zip(receiving, works[len(sends):], ops[len(sends):]):
            self.arrived[key] = (op.tensor, work)
        self.in_flight += [(work, tensor) for work, (_, tensor) in zip(works, sends)]  # kept until sent

    def take(self, key: tuple) -> torch.Tensor:
        tensor, work = self.arrived.pop(key)
        work.wait()
        return tensor

    def finish(self) -> None:
        """Waits for this step's sends (their tensors must outlive them)."""
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()

    def _tag(self, key: tuple) -> int:
        """One tag per message of a step (gloo matches by it too; NCCL ignores it)."""
        kind, stage, micro = key
        return (micro * self.pipeline.stages + stage) * 2 + (kind == "B")


class _Once:
    def __init__(self, work):
        self.work, self.done = work, False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


def _sent_by(action: Action, stages: int) -> tuple | None:
    """The message the pass `action` sends: its output to the next stage, or its input's gradient to the one before."""
    if action.kind == "F":
        return ("F", action.stage + 1, action.micro_batch) if action.stage + 1 < stages else None
    return ("B", action.stage - 1, action.micro_batch) if action.stage > 0 else None


def _received_by(action: Action, stages: int) -> tuple | None:
    """The message the pass `action` needs: its input from the stage before, or its output's gradient from the one
    after."""
    if action.kind == "F":
        return ("F", action.stage, action.micro_batch) if action.stage > 0 else None
    return ("B", action.stage, action.micro_batch) if action.stage + 1 < stages else None


def _source(key: tuple) -> int:
    """The stage whose pass sends message `key`."""
    kind, stage, _ = key
    return stage - 1 if kind == "F" else stage + 1


def _sender(key: tuple, size: int) -> int:
    return _source(key) % size
