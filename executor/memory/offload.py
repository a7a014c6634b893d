"""The plan's offload knobs for weights, gradients and residuals on a GPU: what lives in pinned host memory, and the
copies that bring it to the GPU and send it back. When each copy runs is placement.py's schedule; this module holds
the host buffers and moves them.

Per block (a parameter group, `fastml.plan.layer_of`), as `fastml.plan.offloaded_groups` names them:
- offload_weights: the block's bf16 weights live in pinned host memory; a parameter points at its host copy except
  while the block runs, when it points at a GPU copy (`fetch`, one block ahead, forward and backward). With
  knobs.stream_masters the host copy of a block that steps on the CPU is its fp32 master (`master_streamed`): the
  parameter points at it, fp32, between uses, and the fetch rounds it to bf16 on the GPU. With
  knobs.share_host_weights the host copies are one a node, in memory its ranks share (memory/shared.py): each rank
  writes only its shard of them (`write`; its optimizer's CPU step, in place), and `settle` waits for the others'.
- offload_gradients: once backward has accumulated a block's gradients they go to pinned host memory and leave the
  GPU (`grads_to_host`). Micro-batches after the first fetch the sum so far back (`fetch_grad_sums`), so that
  backward adds into it as it would without offload (the same arithmetic, bit for bit).
- offload_residuals: a block's input (the residual stream, all that block recompute keeps) goes to the host after the
  block's forward, its GPU storage freed, and comes back before the block's backward. Each micro-batch's input has
  a host buffer of its own while it is there (a pipeline stage holds several micro-batches' at once); a buffer its
  input has come back from serves the next.
Master weights and Adam states are the optimizer's (optim.py). On a CPU plan the "GPU" is the CPU: the same code runs
with plain copies, which is how CI tests it.
"""

from __future__ import annotations

import torch
from torch import nn

from fastml.plan import Plan, master_streamed_groups, offloaded_groups
from fastml.executor.memory.pinned import pinned_empty
from fastml.executor.memory.shared import BARRIER_TIMEOUT_S, NodeShared
from fastml.executor.memory.streams import Copier, CopyDone
from fastml.executor.parallel.shard import Layout


class _Flat:
    """One pinned host buffer holding several blocks' tensors back to back, with a view per parameter name; the
    buffer is made by `make(numel)` (default: this process's own)."""

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, cuda: bool, make=None):
        numel = sum(shape.numel() for shape in shapes.values())
        self.buffer = make(numel) if make is not None else pinned_empty(numel, dtype, cuda)
        self.views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in shapes.items():
            self.views[name] = self.buffer[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()


class HostOffload:
    """Weights (bf16 copies, or fp32 masters: `master_streamed`), gradients and block inputs in host memory, as the
    plan's offload knobs say (the module's docstring).
    `shapes`: each group's parameter shapes by name; `sharded`: the groups whose weights the sharding engine keeps
    (their streamed shards are its own); `grads_summed_elsewhere`: sharded gradients, whose host sums the sharding
    engine keeps; `world`: the ranks of a job, with whom knobs.share_host_weights shares the host copies, waiting
    at most `timeout_s` (the job's watchdog's) for one at their barrier."""

    def __init__(self, plan: Plan, shapes: dict[str, dict[str, torch.Size]], device: torch.device, copier: Copier,
                 dtype: torch.dtype, sharded: frozenset[str] = frozenset(), grads_summed_elsewhere: bool = False,
                 world=None, timeout_s: float | None = None):
        knobs, num_layers = plan.knobs, plan.model.num_layers
        self.device, self.copier, self.shapes, self.dtype = device, copier, shapes, dtype
        held = frozenset(shapes)  # a pipeline stage's groups alone
        self.streamed = offloaded_groups(knobs, "offload_weights", num_layers) & held
        self.host_weights = self.streamed - sharded  # whose whole weights live here
        self.master_streamed = master_streamed_groups(knobs, num_layers) & held  # whose host copy is the fp32 master
        self.grads_out = frozenset() if grads_summed_elsewhere else \
            offloaded_groups(knobs, "offload_gradients", num_layers) & held
        self.residuals_out = offloaded_groups(knobs, "offload_residuals", num_layers) & held
        self.world = world
        self.node = None  # knobs.share_host_weights: the node's shared memory, where the host copies live
        make = None
        if knobs.share_host_weights and world is not None and world.distributed and self.host_weights:
            def make(numel: int) -> torch.Tensor:
                self.node = NodeShared(world, numel * dtype.itemsize, copier.cuda, timeout_s or BARRIER_TIMEOUT_S)
                return self.node.data.view(dtype)
        self.weights = _Flat(self._shapes(self.host_weights - self.master_streamed), dtype, copier.cuda, make)
        # Each master with storage of its own, as the optimizer's other masters: a checkpoint writes it as it is,
        # where a view of one buffer would be copied first (executor/storage/files.py, `compact`).
        self.masters = {name: pinned_empty(shape.numel(), torch.float32, copier.cuda).view(shape)
                        for name, shape in self._shapes(self.master_streamed).items()}
        self.grads = _Flat(self._shapes(self.grads_out), dtype, copier.cuda) if self.grads_out else None
        # Keyed by (group, micro-batch): a block input's host buffer, its latest copy's event, and the input itself,
        # whose storage went to the host; then (group -> [(buffer, event of the copy back)]) the buffers free again.
        self.residuals: dict[tuple[str, int], torch.Tensor] = {}
        self._residual_events: dict[tuple[str, int], object] = {}
        self._saved_inputs: dict[tuple[str, int], torch.Tensor] = {}
        self._free_residuals: dict[str, list[tuple[torch.Tensor, object]]] = {}
        self._grad_events: dict[str, object] = {}  # group -> event of its gradients' copy to the host
        self._grad_sums: dict[str, tuple[list[torch.Tensor], object]] = {}  # group -> sums so far on the GPU, event
        self.grad_norms: dict[nn.Parameter, torch.Tensor] = {}  # offloaded gradients' norms, taken on the GPU

    # --- weights ------------------------------------------------------------------------------------------------

    def keep(self, group: str, name: str, p: nn.Parameter) -> torch.Tensor:
        """A streamed block's initialized parameter goes to its host copy, which it points at from then on."""
        self.write(group, name, p.data)
        return self._host_copies(group)[name]

    def write(self, group: str, name: str, value: torch.Tensor) -> None:
        """Sets a streamed block's parameter `name` in its host copy: all of it, or where the ranks of a node share
        the copy, this rank's shard of it (the part its optimizer steps; `settle` waits for the others')."""
        host = self._host_copies(group)[name]
        if self.node is None:
            host.copy_(value)
            return
        layout = Layout.of(self.shapes[group], self.world.size)
        offset = layout.offsets()[layout.names.index(name)]
        start, end = layout.range_of(self.world.rank)
        lo, hi = max(start - offset, 0), min(end - offset, host.numel())
        if lo < hi:
            host.view(-1)[lo:hi].copy_(value.reshape(-1)[lo:hi])

    def settle(self) -> None:
        """Where the node's ranks share the host copies: returns once every rank has written its shard of them."""
        if self.node is not None:
            self.node.barrier()

    def fetch(self, group: str, backward: bool = False) -> tuple[list[torch.Tensor], CopyDone]:
        """Starts copying a streamed block's weights to the GPU; returns the copies and their end. fp32 masters come
        up whole and are rounded to the parameters' dtype on the copy stream, their staging freed once that is done."""
        host = self.homes(group)
        gpu = [torch.empty_like(h, device=self.device, dtype=self.dtype) for h in host]
        if group not in self.master_streamed:
            return gpu, CopyDone(self.copier, self.copier.copy(self.copier.h2d, list(zip(gpu, host))))
        staged = [torch.empty_like(h, device=self.device) for h in host]
        event = self.copier.copy(self.copier.h2d, list(zip(staged, host)) + list(zip(gpu, staged)))
        for tensor in staged:
            self.copier.keep_until_copied(tensor, self.copier.h2d)
        return gpu, CopyDone(self.copier, event)

    def homes(self, group: str) -> list[torch.Tensor]:
        """What a streamed block's parameters point at while it does not compute: their host copies."""
        copies = self._host_copies(group)
        return [copies[name] for name in self.shapes[group]]

    def _host_copies(self, group: str) -> dict[str, torch.Tensor]:
        return self.masters if group in self.master_streamed else self.weights.views

    def host_flat(self, group: str) -> torch.Tensor | None:
        """A streamed block's weights in host memory, as one vector (they lie back to back), or None."""
        # None too for a block whose host copy is its fp32 master: only sharded optimizer states gather from here,
        # and those never stream masters; and where the node's ranks share the copy: nothing to gather
        if group not in self.host_weights - self.master_streamed or self.node is not None:
            return None
        views = self.homes(group)
        start = views[0].storage_offset() - self.weights.buffer.storage_offset()
        return self.weights.buffer[start:start + sum(v.numel() for v in views)]

    def _shapes(self, groups: frozenset[str]) -> dict[str, torch.Size]:
        return {name: shape for group, shapes in self.shapes.items() if group in groups
                for name, shape in shapes.items()}

    # --- residuals ----------------------------------------------------------------------------------------------

    def residual_to_host(self, group: str, micro_batch: int, x: torch.Tensor) -> None:
        """A block's input of a micro-batch goes to the host once its forward pass is queued; its GPU storage is freed
        (autograd's saved views of it included) until `fetch_residual`."""
        storage = x.untyped_storage()
        if not x.is_contiguous() or storage.nbytes() != x.nbytes:
            raise RuntimeError(f"{group}: its input does not own its storage; offload_residuals cannot move it")
        free = self._free_residuals.setdefault(group, [])
        fitting = next((i for i, (h, _) in enumerate(free) if h.shape == x.shape and h.dtype == x.dtype), None)
        host, copied_back = free.pop(fitting) if fitting is not None else \
            (pinned_empty(x.numel(), x.dtype, self.copier.cuda).view(x.shape), None)
        key = (group, micro_batch)
        self.residuals[key] = host
        # once the buffer's last input has come back from it
        self._residual_events[key] = self.copier.copy(self.copier.d2h, [(host, x.detach())], after=copied_back)
        self.copier.keep_until_copied(x, self.copier.d2h)
        storage.resize_(0)
        self._saved_inputs[key] = x

    def fetch_residual(self, group: str, micro_batch: int) -> None:
        key = (group, micro_batch)
        x = self._saved_inputs.pop(key, None)
        if x is None:
            return
        x.untyped_storage().resize_(x.nbytes)
        # Written through `.data`, which does not count as a change of x: autograd's saved views of x stay valid.
        self._residual_events[key] = self.copier.copy(self.copier.h2d, [(x.data, self.residuals[key])],
                                                      after=self._residual_events.get(key))

    def wait_residual(self, group: str, micro_batch: int) -> None:
        """The block's backward pass is next: its input must be back; its host buffer is free for another's."""
        key = (group, micro_batch)
        event = self._residual_events.pop(key, None)
        self.copier.wait(event)
        if key in self.residuals and key not in self._saved_inputs:
            self._free_residuals.setdefault(group, []).append((self.residuals.pop(key), event))

    # --- gradients ----------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.grad_norms.clear()

    def grads_to_host(self, group: str, params: list[nn.Parameter], last_micro_batch: bool) -> None:
        """A block's gradients (the sum over this step's micro-batches so far) go to the host and leave the GPU."""
        grads = [p.grad for p in params]
        if last_micro_batch:  # clipping's norms, taken where the gradients are (optim.AdamW.clip_grad_norm_)
            self.grad_norms.update(zip(params, torch._foreach_norm(grads, 2)))
        self._grad_events[group] = self.copier.copy(
            self.copier.d2h, [(self.grads.views[name], g) for name, g in zip(self.shapes[group], grads)])
        for p, g in zip(params, grads):
            self.copier.keep_until_copied(g, self.copier.d2h)
            p.grad = None

    def fetch_grad_sums(self, group: str) -> None:
        """For a micro-batch after the first: the sum so far starts back to the GPU ahead of the block's backward."""
        if group in self._grad_sums:
            return
        host = [self.grads.views[name] for name in self.shapes[group]]
        gpu = [torch.empty_like(h, device=self.device) for h in host]
        self._grad_sums[group] = gpu, self.copier.copy(self.copier.h2d, list(zip(gpu, host)),
                                                       after=self._grad_events.pop(group, None))

    def take_grad_sums(self, group: str, params: list[nn.Parameter]) -> None:
        """The block's backward is about to add into its gradients: they are the fetched sums (assigned only now: a
        gradient must be on its parameter's device)."""
        if group not in self._grad_sums:
            return
        sums, event = self._grad_sums.pop(group)
        self.copier.wait(event)
        for p, g in zip(params, sums):
            p.grad = g

    def host_grad(self, name: str) -> torch.Tensor | None:
        """The step's gradient of parameter `name` in host memory (complete after `finish`), or None."""
        return self.grads.views.get(name) if self.grads is not None else None

    def finish(self) -> None:
        """Waits for the last gradients to reach the host, and for the last weights to leave it, before the CPU reads
        the one and overwrites the other."""
        for event in self._grad_events.values():
            if event is not None:
                event.synchronize()
        self._grad_events.clear()
        if self.copier.cuda and self.streamed:  # whole weights, or (sharded) a shard on its way to be gathered
            self.copier.h2d.synchronize()

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The pinned host buffers by memory category."""
        tensors = {"weights": [self.weights.buffer, *self.masters.values()],
                   "gradients": [self.grads.buffer] if self.grads else [],
                   "activations": [*self.residuals.values(),
                                   *(h for free in self._free_residuals.values() for h, _ in free)]}
        return {k: v for k, v in tensors.items() if v}
