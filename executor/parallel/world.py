"""The processes that train one plan together: who this one is (its rank, its node), its device, the process group
that joins them, and the watchdog that stops the whole job when one of them dies or hangs.

A job of N processes is started the torchrun way (executor/parallel/launch.py, or torchrun itself), which puts each
process's place in its environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the node).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastml.config import fail, say_on_stderr
from fastml.plan import Plan

EXIT_OTHER_RANK = 4
"""The exit code of a rank that stops because another rank died, hung or lost contact."""
HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    """This process's index on its node: its GPU's index."""
    local_size: int = 1
    node: int = 0
    tensor: int = 1
    """Ranks of a tensor-parallel group: neighbours (fastml/layout.py numbers tensor-parallel ranks fastest, then
    data-parallel ranks, then pipeline stages)."""
    pipeline: int = 1
    """Pipeline ranks: rank r holds pipeline rank r // (tensor x data parallel size)."""

    @property
    def stride(self) -> int:
        """The ranks of one pipeline rank, tensor x data parallel: how far apart neighbouring stages' ranks are."""
        return self.size // self.pipeline

    @property
    def data(self) -> World:
        """The data-parallel ranks this one trains with, those of its tensor-parallel rank and pipeline rank: what data
        parallelism, ZeRO and the order of the data see."""
        t = self.tensor
        if t == 1 and self.pipeline == 1:
            return self
        size = self.stride // t
        return World(rank=self.rank // t % size, size=size, local_rank=self.local_rank // t % size,
                     local_size=max(1, min(size, self.local_size // t)), node=self.node)

    def holds_data_rank_0(self, rank: int) -> bool:
        """Whether `rank` is the first of its data-parallel group (where the replicated gradients are counted once)."""
        return rank // self.tensor % (self.stride // self.tensor) == 0

    @property
    def loss_ranks(self) -> list[int]:
        """The ranks whose losses are the step's, in data-parallel order: the first of each tensor-parallel group (its
        ranks compute the same loss) on the last pipeline stage (the others compute none)."""
        return list(range(self.size - self.stride, self.size, self.tensor))

    @property
    def num_nodes(self) -> int:
        return self.size // self.local_size

    @property
    def main(self) -> bool:
        """Rank 0 logs, shows progress and writes what all ranks share."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


SINGLE = World()


def launched() -> World | None:
    """The world a launcher (torchrun, or `fastml run`'s own) started this process in; None outside one."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    size = int(env["WORLD_SIZE"])
    return World(rank=int(env["RANK"]), size=size, local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                 local_size=int(env.get("LOCAL_WORLD_SIZE", size)), node=int(env.get("GROUP_RANK", 0)))


def check_world(plan: Plan, world: World) -> None:
    """The processes started are the ones the plan was made for."""
    h = plan.hardware
    if world.size != h.num_gpus or world.local_size != h.gpus_per_node:
        fail("hardware.num_gpus", f"the plan is for {h.num_gpus} {_units(plan)} ({h.gpus_per_node} per node) but "
                                  f"{world.size} processes were started ({world.local_size} per node); launch as "
                                  f"many as the plan says, or plan for what you have (`fastml plan --gpus N`)")
    if plan.knobs.comm == "memcpy" and world.num_nodes > 1:
        fail("knobs.comm", "'memcpy' collectives route through the host memory of one node; a plan for several "
                           "nodes uses 'nccl'")
    if plan.knobs.share_host_weights and world.num_nodes > 1:
        fail("knobs.share_host_weights", "the weights are shared in the host memory of one node; a plan for "
                                         "several nodes cannot share them")


def join(plan: Plan, world: World, device: torch.device, timeout_s: float, checkpoint_s: float) -> None:
    """Starts this process's part of the process group (once: a process may train several plans in turn). gloo
    carries CPU tensors (the step's few figures that all ranks agree on, checkpoint bookkeeping); NCCL carries GPU
    tensors where the plan's collectives are NCCL's; memcpy collectives move their data themselves."""
    if not world.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" and plan.knobs.comm == "nccl" else "gloo"
    # Longer than the watchdog's timeout (which names the rank the others wait for: the backends' own do not), and
    # than it allows a checkpoint, whose ranks wait for rank 0's files in a collective.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s + checkpoint_s + 60))


def groups(world: World) -> tuple[object, object]:
    """(this rank's tensor-parallel group, its data-parallel group), None for a group of one or where there is no
    layout but data parallelism (the default group serves); `release` them when the run ends. Every rank makes every
    group, in the same order, as torch.distributed requires."""
    t, d = world.tensor, world.stride // world.tensor
    if t == 1 and world.pipeline == 1:
        return None, None
    stages = range(0, world.size, world.stride)
    tensor = {first: dist.new_group(list(range(first, first + t))) if t > 1 else None
              for stage in stages for first in range(stage, stage + world.stride, t)}
    data = {stage + r: dist.new_group(list(range(stage + r, stage + world.stride, t))) if d > 1 else None
            for stage in stages for r in range(t)}
    stage = world.rank - world.rank % world.stride
    return tensor[world.rank - world.rank % t], data[stage + world.rank % t]


def pipeline_links(world: World) -> dict[tuple[str, int], object]:
    """This rank's process groups to and from its neighbouring pipeline ranks, one per direction: ("to", pipeline
    rank) and ("from", pipeline rank). The last pipeline rank and the first are neighbours too (interleaved stages
    wrap around, and the tied embedding's gradients pass there). A group of its own gives each direction its own
    NCCL communicator and stream: on one stream, a rank's send could queue ahead of the receive its peer's send waits
    for. `release` them when the run ends; every rank makes every group, in the same order."""
    p, stride = world.pipeline, world.stride
    if p == 1:
        return {}
    pairs = sorted({(a, (a + 1) % p) for a in range(p)} | {((a + 1) % p, a) for a in range(p)})
    me, offset, mine = world.rank // stride, world.rank % stride, {}
    for o in range(stride):
        for sender, receiver in pairs:
            group = dist.new_group([sender * stride + o, receiver * stride + o])
            if o == offset and me == sender:
                mine["to", receiver] = group
            if o == offset and me == receiver:
                mine["from", sender] = group
    return mine


def release(*made) -> None:
    """Ends the groups `groups` made (a process that trains several plans makes them again for each); left to the
    interpreter's exit, their teardown aborted a process now and then."""
    for group in made:
        if group is not None:
            dist.destroy_process_group(group)


def _units(plan: Plan) -> str:
    return "GPUs" if plan.hardware.device == "cuda" else "CPU processes"


class Watchdog:
    """Stops the job when it makes no progress for `timeout_s`: a rank that died, froze or is stuck leaves the
    others waiting in a collective for ever. Each rank counts its progress (`tick`: every collective, every step)
    and a thread publishes the count in the process group's store each second; when its own count has not moved
    for the timeout, it reads everyone's, names the rank the others wait for (the lowest count, or a heartbeat
    gone stale), says so on stderr and ends the process. The launcher then stops the rest."""

    def __init__(self, world: World, timeout_s: float, say=None):
        self.world, self.timeout_s = world, timeout_s
        self.say = say or say_on_stderr
        self.progress, self.where = 0, "starting"
        self.last_move = time.monotonic()
        self.allowed_s = timeout_s
        self._stop = threading.Event()
        self._store = dist.distributed_c10d._get_default_store() if world.distributed else None
        self._thread = None

    def __enter__(self) -> Watchdog:
        if self._store is not None:
            self._thread = threading.Thread(target=self._run, name="fastml-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def tick(self, where: str | None = None) -> None:
        self.progress += 1
        if where is not None:
            self.where = where
        self.allowed_s = self.timeout_s
        self.last_move = time.monotonic()

    def allow(self, seconds: float) -> None:
        """Lets the stretch without progress from now on last `seconds` (a checkpoint's files), until the next tick."""
        self.allowed_s = max(self.timeout_s, seconds)
        self.last_move = time.monotonic()

    def _run(self) -> None:
        key = f"fastml/beat/{self.world.rank}"
        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            self._store.set(key, f"{self.progress} {time.time()} {socket.gethostname()} {os.getpid()} {self.where}")
            if self.last_move < now - self.allowed_s:
                self.say(f"fastml: rank {self.world.rank}: {self._diagnosis(now - self.last_move)}; stopping the job")
                os._exit(EXIT_OTHER_RANK)

    def _diagnosis(self, stalled_s: float) -> str:
        beats = {}
        for rank in range(self.world.size):
            key = f"fastml/beat/{rank}"
            if self._store.check([key]):
                count, stamp, host, pid, where = self._store.get(key).decode().split(" ", 4)
                beats[rank] = (int(count), time.time() - float(stamp), host, pid, where)
        silent = sorted(set(range(self.world.size)) - set(beats))
        stale = [r for r, beat in beats.items() if beat[1] > 5 * HEARTBEAT_S + 5]
        behind = min(beats.values(), key=lambda beat: beat[0])[0] if beats else None
        culprits = silent or stale or [r for r, beat in beats.items() if beat[0] == behind]
        described = ", ".join(
            f"rank {r}" + (f" (host {beats[r][2]}, pid {beats[r][3]}, {'silent' if r in stale else 'at'} "
                           f"{beats[r][4]})" if r in beats else " (never reported)") for r in culprits)
        why = "has stopped reporting" if stale or silent else "is behind the others and makes no progress"
        return f"no progress for {stalled_s:.0f} s (--timeout {self.timeout_s:.0f}) while at {self.where}: " \
               f"{described} {why}"
