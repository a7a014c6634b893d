"""The collectives data-parallel training needs, behind one interface with two transports (the plan's `knobs.comm`):

- `TorchCollectives` ("nccl"): torch.distributed's, NCCL between GPUs and gloo between CPU processes;
- `HostCollectives` ("memcpy", executor/parallel/hostcomm.py): copies through pinned host memory shared by the ranks of a
  node, for GPUs that cannot reach each other (consumer GPUs without peer-to-peer PCIe).

Each call is asynchronous and returns a `Work`, whose `wait()` makes the current CUDA stream (on a CPU: the caller)
wait for the result; inputs must stay untouched until then. Reductions are sums; the caller scales. Every rank must
issue the same calls in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# torch 2.13 renamed these (the old names warn); torch 2.11, on the GPU machines, has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchCollectives:
    """torch.distributed's collectives on the default process group (NCCL for GPU tensors, gloo for CPU ones), or on
    `group` (the data-parallel ranks, under tensor parallelism)."""

    def __init__(self, world, watchdog=None, group=None):
        self.world, self.watchdog, self.group = world, watchdog, group

    def _tick(self) -> None:
        if self.watchdog is not None:
            self.watchdog.tick()

    def all_reduce(self, tensor: torch.Tensor):
        """Sums `tensor` over the ranks, in place."""
        self._tick()
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor):
        """`out` (S elements) becomes the sum over the ranks of their `full[rank*S:(rank+1)*S]` (W*S elements)."""
        self._tick()
        return _reduce_scatter(out, full, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor):
        """`out` (W*S elements) becomes every rank's `shard` (S elements) in rank order; `shard` may be this rank's
        part of `out`."""
        self._tick()
        return _all_gather(out, shard, group=self.group, async_op=True)

    def close(self) -> None:
        pass


def agree(values: list[float]) -> list[list[float]]:
    """Every rank's `values`, in rank order, on every rank (through the CPU side of the process group), for the
    few figures of a step the ranks must agree on: the loss, a stop request, the gradient norm."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [row.tolist() for row in rows]


def make_collectives(comm: str, world, device: torch.device, watchdog=None, group=None):
    """The data-parallel collectives among `world`'s ranks (those of `group`, where not all of the job's)."""
    if comm == "memcpy":
        from fastml.executor.parallel.hostcomm import HostCollectives

        return HostCollectives(world, device, watchdog)
    return TorchCollectives(world, watchdog, group)
