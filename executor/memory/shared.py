"""Host memory shared by the ranks of one node: one segment that every rank maps, with a barrier of its own.

The memcpy collectives pass their data through one (executor/parallel/hostcomm.py); with knobs.share_host_weights
the streamed blocks' weights live in one (executor/memory/offload.py), a single copy a node instead of one a rank.

The segment is a file in SHARED_DIR that rank 0 creates afresh, for this user alone (never a file or link that was
there before), its pages reserved at once (a container's small /dev/shm then fails at the start with a clear error,
not with SIGBUS in the middle of a run), and that it removes once every rank has mapped it or one has failed: a rank
killed later leaves nothing behind. Its name holds rank 0's pid: should rank 0 be killed in between, the next job on
this node removes it (`_remove_stale`).

The barrier's flags lie at the segment's start, a cache line per rank, so that no two ranks write one line (its count
of barriers, its process id: csrc/hostcomm.cpp). A rank that dies is seen by the ranks waiting for it, which stop
with a DistBackendError naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import uuid
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from fastml.executor import native
from fastml.executor.memory.pinned import pin
from fastml.executor.storage.files import is_running

FLAG_LINE_BYTES = 64
"""A rank's line of barrier flags; the data after the flags starts 64-byte aligned (the copy engines, any dtype)."""
SHARED_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHARED_PREFIX = "fastml-shared-"
"""A segment's file is SHARED_DIR/fastml-shared-PID-TOKEN, PID that of the rank 0 that created it."""
BARRIER_TIMEOUT_S = 600.0
"""How long a barrier waits for a rank that is alive but does not come (one that dies is seen at once)."""

_SHARERS: dict[int, tuple[int, int]] = {}
"""The start of each segment this process maps -> its bytes, and the ranks that map it (`sharers`)."""


class NodeShared:
    """`num_bytes` of zeroed host memory (`data`) that every rank of this node maps, pinned where the ranks train on
    GPUs, and `barrier()` between them. Every rank of the node makes one, together (the module's docstring)."""

    def __init__(self, world, num_bytes: int, cuda: bool, timeout_s: float = BARRIER_TIMEOUT_S, reserve: bool = True):
        """`reserve`: its pages reserved now (`_create_file`), for memory every page of which will be written; else
        only those written are ever resident (a CPU's memcpy rows, of which a round writes what it moves)."""
        if world.num_nodes > 1:
            raise ValueError("shared host memory is one node's: a job of several nodes cannot share it")
        native.load()
        self.rank, self.size, self.timeout_s = world.local_rank, world.local_size, timeout_s
        flag_bytes = self.size * FLAG_LINE_BYTES
        whole = _map(world, flag_bytes + num_bytes, reserve)
        if cuda:
            pin(whole)
        start = whole.untyped_storage().data_ptr()
        _SHARERS[start] = whole.nbytes, self.size
        weakref.finalize(whole, _SHARERS.pop, start, None)
        self.whole = whole  # kept: the pinning and the registration last as long as it
        self.flags = whole[:flag_bytes].view(torch.int64)
        self.data = whole[flag_bytes:]
        self.generation = 0

    def barrier(self) -> None:
        """Returns once every rank of the node has arrived: what each wrote to the segment before is visible to all."""
        self.generation += 1
        torch.ops.fastml.host_barrier(self.flags, self.rank, self.size, self.generation, self.timeout_s)


def sharers(tensor: torch.Tensor) -> int:
    """How many ranks map the host storage of `tensor`: those of its node where it is a shared segment, else 1 (the
    meter counts a rank's share of a segment, as the kernel's proportional set size does)."""
    return _SHARERS.get(tensor.untyped_storage().data_ptr(), (0, 1))[1]


def others_share_bytes() -> int:
    """Of the segments this process maps, the bytes that are the other ranks' shares: in its resident set (which
    holds every page it touched whole), not in its share of the node's memory."""
    return sum(num_bytes - num_bytes // ranks for num_bytes, ranks in _SHARERS.values())


def _map(world, num_bytes: int, reserve: bool = True) -> torch.Tensor:
    """The node's segment of `num_bytes` (uint8), mapped by this rank; made by rank 0 (the module's docstring)."""
    name = [f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}" if world.main else None]
    if world.main:
        _remove_stale()
    dist.broadcast_object_list(name, src=0)
    path = SHARED_DIR / name[0]
    try:
        if world.main:
            _create_file(path, num_bytes, reserve)
        dist.barrier()
        shared = torch.from_file(str(path), shared=True, size=num_bytes, dtype=torch.uint8)
        dist.barrier()
    finally:
        if world.main:
            path.unlink(missing_ok=True)
    return shared


def _create_file(path: Path, num_bytes: int, reserve: bool) -> None:
    """A new file of `num_bytes` zeros that only this user may open, its pages reserved now where `reserve` (and the
    system can: not macOS); an existing file or link at `path` is an error."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, num_bytes)
        try:
            if reserve and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, num_bytes)
        except OSError as e:
            raise RuntimeError(f"{path.parent} has no room for {num_bytes / 2**30:.2f} GiB of host memory shared by "
                               f"this node's ranks ({e.strerror}); a container needs a larger /dev/shm "
                               f"(docker run --shm-size)") from e
    finally:
        os.close(fd)


def _remove_stale() -> None:
    """Removes the segments' files of jobs whose rank 0 has died (killed between creating and removing one), and
    those of earlier fastml versions (fastml-memcpy-PID-TOKEN)."""
    for path in SHARED_DIR.glob("fastml-*"):
        match = re.fullmatch(r"fastml-(?:shared|memcpy)-(\d+)-[0-9a-f]{12}", path.name)
        if match and not is_running(int(match[1])):
            with contextlib.suppress(OSError):  # another user's (SHARED_DIR is sticky), or removed meanwhile
                path.unlink()
