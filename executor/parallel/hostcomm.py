"""The memcpy collectives (`knobs.comm = "memcpy"`): reduce-scatter, all-gather and all-reduce between the ranks of one
node through pinned host memory they share, moved by the GPUs' copy engines. For GPUs that cannot reach each other
(consumer GPUs without peer-to-peer PCIe), where NCCL's own path through the host is slower: each byte crosses PCIe
once down and once up, the two directions overlapping, and the GPU adds.

The ranks share MEMCPY_SLOTS slots (fastml.plan), each a row of MEMCPY_ROW_BYTES per rank. A collective runs in
rounds, one slot each, taking turns: every rank copies what the others need from its GPU into its row (device to
host), waits for its copies, meets the others at a barrier (torch.ops.fastml.host_barrier, csrc/hostcomm.cpp: release
and acquire atomics on flags in the same shared memory, executor/memory/shared.py), then copies what it needs from
their rows to its GPU (host to device) and adds on the GPU. A reduce-scatter's row holds one cell per destination
rank; rank r sums the cells addressed to it in rank order 0, 1, ..., so that the sums are those of one process adding
micro-batches in that order (bitwise where the orders agree). Rank r's own contribution never leaves its GPU. An all-gather's row holds the
rank's shard; an all-reduce is a reduce-scatter then an all-gather.

Before a rank reaches the barrier of a round it has finished reading the slot it used the round before, so a slot is
rewritten only after every rank read it. A thread per rank runs the rounds, so the caller's compute stream goes on
(the rounds' device-to-host copies of one collective overlap the host-to-device copies of the one before); it waits
only where it uses a result (`Work.wait`). On a CPU (a job of CPU processes) the copies are plain ones, which is
how CI tests the same rounds.

A rank whose process dies never reaches its next barrier: the ranks waiting there see that its process is gone and
stop with a DistBackendError that names it (as gloo's and NCCL's collectives stop when a peer's connection drops), so
that the job ends at once and the launcher blames the rank that died, not the ones left waiting.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from fastml.plan import MEMCPY_ROW_BYTES, MEMCPY_SLOTS
from fastml.executor.memory.shared import BARRIER_TIMEOUT_S, NodeShared


class HostCollectives:
    """The memcpy collectives of one rank (see the module's docstring); every rank of the node makes one, together."""

    def __init__(self, world, device: torch.device, watchdog=None):
        if world.num_nodes > 1:
            raise ValueError("memcpy collectives route through the host memory of one node")
        self.world, self.device, self.watchdog = world, device, watchdog
        self.cuda = device.type == "cuda"
        slot_bytes = world.size * MEMCPY_ROW_BYTES
        # reserved where pinned whole; on a CPU a round writes only what it moves (planner/memory.py counts that)
        self.shared = NodeShared(world, MEMCPY_SLOTS * slot_bytes, self.cuda,
                                 watchdog.timeout_s if watchdog is not None else BARRIER_TIMEOUT_S, reserve=self.cuda)
        self.slots = [self.shared.data[k * slot_bytes:][:slot_bytes] for k in range(MEMCPY_SLOTS)]
        self.round = 0
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.last_up = None  # the event after this rank's last round's reads of a slot
        self.jobs: queue.Queue = queue.Queue()
        self.broken: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="fastml-memcpy", daemon=True)
        self.thread.start()

    # --- the interface of collectives.py ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor):
        if tensor.numel() % self.world.size:
            raise ValueError(f"memcpy all_reduce needs a multiple of {self.world.size} elements, got {tensor.numel()}")
        shard = torch.empty(tensor.numel() // self.world.size, dtype=tensor.dtype, device=tensor.device)

        def rounds() -> None:
            self._reduce_scatter(shard, tensor)
            self._after_own_results()  # the all-gather sends the sums the reduce-scatter has just made
            self._all_gather(tensor, shard)
        return self._submit(rounds, tensor, shard)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor):
        return self._submit(lambda: self._reduce_scatter(out, full), out, full)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor):
        return self._submit(lambda: self._all_gather(out, shard), out, shard)

    def close(self) -> None:
        """Ends the thread once it has run what was submitted; one stuck at a barrier (a job going down) is left to
        end with the process."""
        self.jobs.put(None)
        self.thread.join(timeout=10)

    def _submit(self, rounds, *tensors: torch.Tensor) -> _Job:
        if self.watchdog is not None:
            self.watchdog.tick()
        job = _Job(rounds, torch.cuda.current_stream(self.device).record_event() if self.cuda else None, tensors)
        self.jobs.put(job)
        return job

    # --- the thread ---------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.broken is None:
                try:
                    self.ready = job.ready
                    job.rounds()
                    job.done = self.h2d.record_event() if self.cuda else None
                except BaseException as e:  # noqa: BLE001: the caller's wait raises it
                    self.broken = e
            job.error = self.broken
            job.finished.set()

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        size, rank = self.world.size, self.world.rank
        shard = out.numel()
        if full.numel() != size * shard:
            raise ValueError(f"reduce_scatter of {full.numel()} elements into shards of {shard}")
        cell = _cell_bytes(size) // full.element_size()
        for start in range(0, shard, cell):
            n = min(cell, shard - start)
            mine = lambda r: full[r * shard + start:][:n]  # noqa: E731: the part of `full` rank r sums
            self._down([(self._cell(rank, j, size, full.dtype, n), mine(j)) for j in range(size) if j != rank])
            self._up_and_add(out[start:start + n], mine(rank),
                             {i: self._cell(i, rank, size, full.dtype, n) for i in range(size) if i != rank})

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        size, rank = self.world.size, self.world.rank
        numel = shard.numel()
        if out.numel() != size * numel:
            raise ValueError(f"all_gather of shards of {numel} elements into {out.numel()}")
        row = MEMCPY_ROW_BYTES // shard.element_size()
        in_place = shard.data_ptr() == out[rank * numel:].data_ptr()
        for start in range(0, numel, row):
            n = min(row, numel - start)
            self._down([(self._cell(rank, 0, 1, shard.dtype, n), shard[start:start + n])])
            pairs = [(out[i * numel + start:][:n], self._cell(i, 0, 1, shard.dtype, n)) for i in range(size)
                     if i != rank]
            if not in_place:
                pairs.append((out[rank * numel + start:][:n], shard[start:start + n]))
            self._up(pairs)

    def _cell(self, row: int, cell: int, cells: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """Elements [0, n) of cell `cell` (of `cells`) of rank `row`'s row in this round's slot."""
        slot = self.slots[self.round % MEMCPY_SLOTS]
        width = _cell_bytes(cells)
        start = row * MEMCPY_ROW_BYTES + cell * width
        return slot[start:start + width].view(dtype)[:n]

    def _down(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This round's copies into this rank's row, finished; then the barrier, once this rank's reads of the round
        before are finished too (so that the slot the next round writes is free)."""
        if self.cuda:
            self.d2h.wait_event(self.ready)
            with torch.cuda.stream(self.d2h):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            self.d2h.synchronize()
            if self.last_up is not None:
                self.last_up.synchronize()
        else:
            for dst, src in pairs:
                dst.copy_(src)
        self.shared.barrier()

    def _up(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.cuda.stream(self.h2d) if self.cuda else _nothing():
            for dst, src in pairs:
                dst.copy_(src, non_blocking=self.cuda)
        self._round_done()

    def _up_and_add(self, out: torch.Tensor, own: torch.Tensor, others: dict[int, torch.Tensor]) -> None:
        """out = the sum, in rank order, of this rank's `own` part and the others' cells."""
        with torch.cuda.stream(self.h2d) if self.cuda else _nothing():
            parts = {i: cell.to(out.device, non_blocking=self.cuda) for i, cell in others.items()}
            parts[self.world.rank] = own
            ordered = [parts[i] for i in range(self.world.size)]
            torch.add(ordered[0], ordered[1], out=out)
            for part in ordered[2:]:
                out.add_(part)
        self._round_done()

    def _after_own_results(self) -> None:
        """The next rounds' copies down wait for the copies up (and the additions) of the rounds so far."""
        if self.cuda:
            self.ready = self.h2d.record_event()

    def _round_done(self) -> None:
        self.last_up = self.h2d.record_event() if self.cuda else None
        self.round += 1


def _cell_bytes(cells: int) -> int:
    """The bytes of each of `cells` cells of a row: 64-byte aligned, for every element size and the copy engines."""
    return MEMCPY_ROW_BYTES // cells // 64 * 64


class _Job:
    """A collective in flight: `wait` makes the caller's stream wait for it (on a CPU: the caller)."""

    def __init__(self, rounds, ready, tensors):
        self.rounds, self.ready, self.tensors = rounds, ready, tensors  # tensors: kept alive until it is done
        self.finished = threading.Event()
        self.done = None
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.finished.wait()
        if self.error is not None:
            # A DistError (a rank died or never came: csrc/hostcomm.cpp) stays one, as torch.distributed's own are.
            kind = dist.DistBackendError if isinstance(self.error, dist.DistError) else RuntimeError
            raise kind(f"memcpy collective failed: {self.error}") from self.error
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
        self.tensors = ()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
