"""Data parallelism and ZeRO sharding over the ranks of a job, one parameter group (optim.layer_groups: the
embedding, each block, the head) at a time, on the plan's collectives (collectives.py).

Each group is one flat vector: its parameters back to back in model order, padded to a multiple of the world size,
so that rank r owns the contiguous shard [r*S, (r+1)*S) (`Layout`), and one collective moves the whole group.

- No sharding: every rank keeps everything; after the last micro-batch's backward pass each group's gradients are
  summed over the ranks (all-reduce). The loss of each micro-batch is divided by all the micro-batches of the step
  on all ranks (step.py), so the sums are the single-process gradients, summed in another order.
- shard_optimizer (ZeRO-1): a rank steps only its shard of each group, so it keeps only that shard of the master
  weights and Adam states (optim.py), and of the gradients after the last micro-batch (reduce-scatter); after its
  step the updated shards are gathered back into every rank's weights (all-gather).
- shard_gradients (ZeRO-2): the reduce-scatter runs after every micro-batch's backward pass of a group and the full
  gradients are freed at once; the rank's shard sums the micro-batches.
- shard_weights (ZeRO-3): a block's weights exist whole only while it computes: a rank keeps its shard, and the
  block is gathered one block ahead, in the forward pass and again in the backward pass (memory/placement.py
  schedules it like a streamed block); with cache_weights_on_host the gathered copy of a step's first forward pass
  goes to host memory and the step's backward passes fetch it from there instead of gathering again. The optimizer
  updates the shard in place.

Collectives run asynchronously; at most REDUCTIONS_IN_FLIGHT (fastml.plan) reductions are in flight, each holding one
group's flat gradients, which the planner counts as comm buffers (planner/memory.py), beside the group being reduced.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from fastml.plan import REDUCTIONS_IN_FLIGHT, Plan, offloaded_groups, shared_weight_groups, weights_sharded
from fastml.executor.memory.pinned import pinned_empty
from fastml.executor.memory.streams import Copier, CopyDone

@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in a rank's range of its group's flat vector."""

    index: int
    """The parameter's place in its group."""
    start: int
    end: int
    """Elements [start, end) of the flattened parameter."""
    offset: int
    """Where they begin in the rank's range."""


SHARD_ALIGNMENT = 8
"""Elements: 16 bytes of bf16 (csrc/adamw_cuda.cu's packed runs), 32 of fp32."""


@dataclass(frozen=True)
class Layout:
    """A parameter group as one flat vector, sharded over `world_size` ranks."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    world_size: int

    @staticmethod
    def of(shapes: dict[str, torch.Size], world_size: int) -> Layout:
        return Layout(tuple(shapes), tuple(math.prod(s) for s in shapes.values()), world_size)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """Each rank's share, rounded up to SHARD_ALIGNMENT elements, so that every rank's shard starts 16-byte
        aligned in the flat vectors (the GPU AdamW's packed kernel takes aligned runs; a misaligned start would put
        a rank's whole first piece on its one-element kernel)."""
        per_rank = -(-self.numel // self.world_size)
        return -(-per_rank // SHARD_ALIGNMENT) * SHARD_ALIGNMENT

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def offsets(self) -> list[int]:
        offsets, at = [], 0
        for n in self.numels:
            offsets.append(at)
            at += n
        return offsets

    def range_of(self, rank: int) -> tuple[int, int]:
        """The elements of the group (unpadded) that rank `rank` owns; empty for a rank past the last element."""
        start = min(rank * self.shard_numel, self.numel)
        return start, min(start + self.shard_numel, self.numel)

    def pieces(self, start: int, end: int) -> list[Piece]:
        """The parameters' parts in [start, end), in order."""
        pieces = []
        for index, (offset, n) in enumerate(zip(self.offsets(), self.numels)):
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                pieces.append(Piece(index, lo - offset, hi - offset, lo - start))
        return pieces


class DataParallel:
    """The collectives of a job of several ranks over a model's parameter groups (see the module's docstring).
    memory/placement.py calls it: `keep` places each parameter as it is initialized, `fetch` brings a sharded
    block's weights whole and `homes` gives what they point at between uses, `grads_ready` reduces a group's
    gradients, `finish` completes the step's reductions, and `gather_updated` spreads a group's updated shard after the
    optimizer step. `copier`: the copy streams it shares with the host offload."""

    def __init__(self, plan: Plan, world, device: torch.device, comm, shapes: dict[str, dict[str, torch.Size]],
                 dtype: torch.dtype, copier: Copier):
        knobs = plan.knobs
        self.world, self.device, self.comm, self.dtype, self.copier = world, device, comm, dtype, copier
        self.layouts = {group: Layout.of(s, world.size) for group, s in shapes.items()}
        self.shapes = shapes
        self.sharded = frozenset(g for g in shapes if weights_sharded(knobs, g))
        # A streamed block's shard lives in host memory and comes up before each gather.
        self.host_shards_of_weights = self.sharded & offloaded_groups(knobs, "offload_weights", plan.model.num_layers)
        # knobs.share_host_weights: streamed blocks whose one host copy a node each rank updates its shard of in place
        self.shared_on_host = shared_weight_groups(knobs, plan.model.num_layers)
        self.scatter = knobs.shard_optimizer
        self.every_micro_batch = knobs.shard_gradients
        # With sharded gradients, offload_gradients keeps these blocks' shards in host memory, summed there.
        self.host_shards = offloaded_groups(knobs, "offload_gradients", plan.model.num_layers) \
            if self.every_micro_batch else frozenset()
        self.host_grad_shards: dict[str, torch.Tensor] = {}
        self.host_events: dict[str, object] = {}  # a host shard's last copy down
        self.shard_norms: dict[str, torch.Tensor] = {}  # the final host shards' norms, taken on the GPU
        self.last_micro_batch = True
        self.cache_on_host = knobs.cache_weights_on_host and bool(self.sharded)
        self.flats: dict[str, torch.Tensor] = {}  # a replicated group's weights, padded (on the GPU or the host)
        self.shards: dict[str, torch.Tensor] = {}  # a sharded block's weight shard (on the GPU or the host)
        self.placeholders: dict[str, torch.Tensor] = {}  # a sharded block's weights while not gathered: no storage
        self.cache: dict[str, torch.Tensor] = {}  # a gathered block's forward copy, in pinned host memory
        self.cached: dict[str, object] = {}  # the blocks whose copy there is this step's: its copy's event
        self.grad_shards: dict[str, torch.Tensor] = {}
        self.in_flight: deque = deque()

    # --- placement ------------------------------------------------------------------------------------------

    def range(self, group: str) -> tuple[int, int]:
        return self.layouts[group].range_of(self.world.rank)

    def keep(self, group: str, name: str, p: torch.Tensor) -> torch.Tensor:
        """Where an initialized parameter lives: a sharded block keeps its part of this rank's shard (in host memory
        where the block is streamed) and the parameter points at a placeholder without storage; a replicated group
        (but a streamed one, whose host copy memory/offload.py holds) keeps its padded flat vector."""
        layout = self.layouts[group]
        offset = layout.offsets()[layout.names.index(name)]
        if group in self.sharded:
            shard = self.shards.get(group)
            if shard is None:
                shard = self.shards[group] = _empty(layout.shard_numel, p.dtype, self.device,
                                                    on_host=group in self.host_shards_of_weights)
                self.placeholders[group] = _without_storage(self.shapes[group], p.dtype, self.device)
            start, end = self.range(group)
            lo, hi = max(start, offset), min(end, offset + p.numel())
            if lo < hi:
                shard[lo - start:hi - start].copy_(p.detach().view(-1)[lo - offset:hi - offset])
            return self.placeholders[group][layout.names.index(name)]
        flat = self.flats.get(group)
        if flat is None:
            flat = self.flats[group] = torch.zeros(layout.padded_numel, dtype=p.dtype, device=self.device)
        view = flat[offset:offset + p.numel()].view(p.shape)
        view.copy_(p.detach())
        return view

    # --- sharded weights ----------------------------------------------------------------------------------------

    def fetch(self, group: str, backward: bool = False):
        """Starts bringing a sharded block's weights whole onto the GPU, gathered from the ranks' shards; returns (its
        parameters' tensors, work to wait for). In the backward pass with cache_weights_on_host they come from the
        forward pass's host copy."""
        layout = self.layouts[group]
        full = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
        views = [full[o:o + n] for o, n in zip(layout.offsets(), layout.numels)]
        if backward and group in self.cached:
            event = self.copier.copy(self.copier.h2d, [(full[:layout.numel], self.cache[group])],
                                     after=self.cached[group])  # once the forward pass's copy is there
            return views, CopyDone(self.copier, event)
        shard = self.shards[group]
        mine = full[self.world.rank * layout.shard_numel:(self.world.rank + 1) * layout.shard_numel]
        if shard.device == full.device:
            mine.copy_(shard)
            return views, self.comm.all_gather(full, mine)
        # A streamed shard comes up on the copy stream, which the gather then follows: the compute stream waits only
        # for the gathered weights, when it uses them.
        self.copier.copy(self.copier.h2d, [(mine, shard)])
        with torch.cuda.stream(self.copier.h2d) if self.copier.cuda else contextlib.nullcontext():
            return views, self.comm.all_gather(full, mine)

    def gathered(self, group: str, tensors: list[torch.Tensor]) -> None:
        """A sharded block has computed its forward pass with `tensors`: with cache_weights_on_host they go to host
        memory for the step's backward passes, once a step (the weights change only with the optimizer's step)."""
        if not self.cache_on_host or group in self.cached:
            return
        layout = self.layouts[group]
        if group not in self.cache:  # pinned once, reused by every micro-batch
            self.cache[group] = pinned_empty(layout.numel, self.dtype, self.device.type == "cuda")
        host = self.cache[group]
        pairs, at = [], 0
        for t, n in zip(tensors, layout.numels):
            pairs.append((host[at:at + n], t.view(-1)))
            at += n
        self.cached[group] = self.copier.copy(self.copier.d2h, pairs)
        for t in tensors:
            self.copier.keep_until_copied(t, self.copier.d2h)

    def homes(self, group: str) -> list[torch.Tensor]:
        """What a sharded block's parameters point at between uses: placeholders without storage."""
        return self.placeholders[group]

    # --- gradients ----------------------------------------------------------------------------------------------

    def grads_ready(self, group: str, params: list[nn.Parameter], last_micro_batch: bool, wait: bool) -> None:
        """A group's gradients of this micro-batch are complete: reduced now where the plan says (every micro-batch
        with sharded gradients, else after the last one). Scattered, the full gradients are dropped; summed, each
        parameter's gradient becomes a view of the reduced flat vector (`wait`: before the caller reads it)."""
        self.last_micro_batch = last_micro_batch
        if not (self.every_micro_batch or last_micro_batch):
            return
        self._make_room()
        layout = self.layouts[group]
        flat = torch.zeros(layout.padded_numel, dtype=params[0].grad.dtype, device=params[0].grad.device)
        torch._foreach_copy_([flat[o:o + n] for o, n in zip(layout.offsets(), layout.numels)],
                             [p.grad.view(-1) for p in params])
        if self.scatter:
            out = torch.empty(layout.shard_numel, dtype=flat.dtype, device=flat.device)
            self.in_flight.append((self.comm.reduce_scatter(out, flat), group, out, flat, last_micro_batch))
            for p in params:
                p.grad = None
            return
        work = self.comm.all_reduce(flat)
        for p, o, n in zip(params, layout.offsets(), layout.numels):
            p.grad = flat[o:o + n].view(p.shape)
        if wait:
            work.wait()
        else:
            self.in_flight.append((work, group, None, flat, last_micro_batch))

    def _make_room(self) -> None:
        while len(self.in_flight) >= REDUCTIONS_IN_FLIGHT:
            self._complete(*self.in_flight.popleft())

    def _complete(self, work, group: str, out: torch.Tensor | None, flat: torch.Tensor, last: bool = True) -> None:
        work.wait()
        if out is None:
            return
        if group in self.host_shards:
            self._to_host_shard(group, out, last)
        elif group in self.grad_shards:
            self.grad_shards[group].add_(out)  # the sum over micro-batches, as backward sums them without sharding
        else:
            self.grad_shards[group] = out

    def _to_host_shard(self, group: str, out: torch.Tensor, last: bool) -> None:
        """A micro-batch's reduced shard joins the sum in host memory: from the second on, the sum so far comes up
        and is added on the GPU (as without offload), then the sum goes down."""
        host = self.host_grad_shards.get(group)
        if host is None:
            host = self.host_grad_shards[group] = _empty(out.numel(), out.dtype, self.device, on_host=True)
        if group in self.host_events:  # not the first micro-batch of the step
            summed = torch.empty_like(out)
            self.copier.wait(self.copier.copy(self.copier.h2d, [(summed, host)], after=self.host_events[group]))
            out.add_(summed)
        if last:
            self.shard_norms[group] = torch.linalg.vector_norm(out, 2)
        self.host_events[group] = self.copier.copy(self.copier.d2h, [(host, out)])
        self.copier.keep_until_copied(out, self.copier.d2h)

    def finish(self) -> None:
        """Completes the step's reductions: every gradient (or shard) is final, host shards included."""
        while self.in_flight:
            self._complete(*self.in_flight.popleft())
        for event in self.host_events.values():
            if event is not None:
                event.synchronize()

    def grad_shard(self, group: str) -> tuple[torch.Tensor | None, bool]:
        """This rank's shard of a group's summed gradients (padded), once `finish` has run, and whether it is in host
        memory (then not clipped in place: its norm is in `shard_norms`)."""
        if group in self.host_shards:
            return (self.host_grad_shards[group] if group in self.host_events else None), True
        return self.grad_shards.get(group), False

    def begin_step(self) -> None:
        """The weights have changed since the host copies were made."""
        self.cached.clear()

    def zero_grad(self) -> None:
        self.grad_shards.clear()
        self.host_events.clear()
        self.shard_norms.clear()

    # --- after the optimizer step -------------------------------------------------------------------------------

    def gather_updated(self, group: str, host_flat: torch.Tensor | None) -> None:
        """Spreads this rank's updated shard of a replicated group to every rank, in place: into the padded flat
        vector its parameters are views of, or (a streamed block, `host_flat`: its unpadded host copy) through a
        GPU buffer. Not one whose host copy the node's ranks share: each updated its shard there."""
        if not self.scatter or group in self.sharded or group in self.shared_on_host:
            return
        layout = self.layouts[group]
        start, end = self.range(group)
        shard = slice(self.world.rank * layout.shard_numel, (self.world.rank + 1) * layout.shard_numel)
        if host_flat is None:
            flat = self.flats[group]
            self.comm.all_gather(flat, flat[shard]).wait()
            return
        full = torch.zeros(layout.padded_numel, dtype=host_flat.dtype, device=self.device)
        full[start:end].copy_(host_flat[start:end], non_blocking=True)
        self.comm.all_gather(full, full[shard]).wait()
        host_flat.copy_(full[:layout.numel])

    # --- checkpoints --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_weights(self, group: str) -> dict[str, torch.Tensor]:
        """A sharded block's weights whole, gathered (every rank must call it, in the same order)."""
        tensors, work = self.fetch(group)
        work.wait()
        return {name: t.view(self.shapes[group][name]) for name, t in zip(self.layouts[group].names, tensors)}

    @torch.no_grad()
    def load_weights(self, group: str, name: str, value: torch.Tensor) -> None:
        """Sets a sharded block's parameter `name` from its whole value: this rank's part of it."""
        layout = self.layouts[group]
        offset = layout.offsets()[layout.names.index(name)]
        start, end = self.range(group)
        lo, hi = max(start, offset), min(end, offset + value.numel())
        if lo < hi:
            self.shards[group][lo - start:hi - start].copy_(value.reshape(-1)[lo - offset:hi - offset])

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this engine keeps in host memory, by memory category (the meter's walk)."""
        weights = [s for s in self.shards.values() if s.device.type == "cpu"] + list(self.cache.values())
        tensors = {"weights": weights, "gradients": list(self.host_grad_shards.values())}
        return {k: v for k, v in tensors.items() if v}

    def gpu_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"weights": [s for s in self.shards.values() if s.device.type != "cpu"],
                "gradients": list(self.grad_shards.values())}


def _empty(numel: int, dtype: torch.dtype, device: torch.device, on_host: bool) -> torch.Tensor:
    if on_host:
        return pinned_empty(numel, dtype, device.type == "cuda").zero_()
    return torch.zeros(numel, dtype=dtype, device=device)


def _without_storage(shapes: dict[str, torch.Size], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Tensors of these shapes whose shared storage holds nothing: what a gathered block's parameters point at between
    their uses, shaped as they are, costing no memory (views are made first: a view of an empty storage is not)."""
    flat = torch.empty(sum(math.prod(s) for s in shapes.values()), dtype=dtype, device=device)
    views, at = [], 0
    for shape in shapes.values():
        views.append(flat[at:at + math.prod(shape)].view(shape))
        at += math.prod(shape)
    flat.untyped_storage().resize_(0)
    return views
