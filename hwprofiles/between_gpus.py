"""What `fastml profile` measures between the GPUs of a machine with several: peer-to-peer copies, and the
collectives a plan can run (NCCL's reduce-scatter, all-gather and all-reduce, and fastml's memcpy ones,
executor/parallel/hostcomm.py) over sizes, each fitted as time = α + bytes moved / bus bandwidth (NCCL's bus convention:
(n-1)/n of the size per rank, twice for an all-reduce; nccl-tests doc/PERFORMANCE.md).

The collectives are timed in one worker process per GPU, started as `fastml run` starts its ranks
(executor/parallel/launch.py); on a CPU the same workers time gloo, which is how the tests run it.
"""

from __future__ import annotations

import os
import time

import numpy as np

KINDS = ("reduce_scatter", "all_gather", "all_reduce")
SIZES, QUICK_SIZES = (2**16, 2**20, 2**24, 2**27), (2**20, 2**25)
"""Bytes of a collective's whole tensor."""
REPEATS = 5
P2P_BYTES = 2**28


def peer_access(gpus: int) -> bool:
    """Whether every pair of the first `gpus` GPUs can copy peer to peer, as NCCL would: CUDA says so, and
    NCCL_P2P_DISABLE does not forbid it (how a box of consumer GPUs behaves)."""
    import torch

    if os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return False
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(gpus) for b in range(gpus) if a != b)


def time_collectives(device_type: str, ranks: int, sizes=SIZES, repeats: int = REPEATS) -> dict:
    """Seconds of each collective by transport ("torch": NCCL between GPUs, gloo between CPU processes; "memcpy"),
    kind and size in bytes: the fastest of `repeats` after a warm-up, timed by rank 0 among `ranks` workers."""
    from torch.distributed.launcher.api import elastic_launch

    from fastml.executor.parallel.launch import _launch_config

    return elastic_launch(_launch_config(ranks), _worker)(device_type, tuple(sizes), repeats)[0]


def _worker(device_type: str, sizes: tuple[int, ...], repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from fastml.executor.loop.device import rank_cpu_threads
    from fastml.executor.parallel.collectives import TorchCollectives
    from fastml.executor.parallel.hostcomm import HostCollectives
    from fastml.executor.parallel.world import launched

    world = launched()
    if device_type == "cpu":
        torch.set_num_threads(rank_cpu_threads(world.local_size))
    device = torch.device(device_type, world.local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device_type == "cpu" else "cpu:gloo,cuda:nccl")
    dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    transports = {"torch": TorchCollectives(world), "memcpy": HostCollectives(world, device)}
    seconds = {name: {kind: {size: _seconds(comm, kind, size // dtype.itemsize // world.size * world.size, world.size,
                                            device, dtype, repeats) for size in sizes} for kind in KINDS}
               for name, comm in transports.items()}
    transports["memcpy"].close()
    dist.destroy_process_group()
    return seconds


def _seconds(comm, kind: str, n: int, ranks: int, device, dtype, repeats: int) -> float:
    """The fastest of `repeats` runs after a warm-up: other work on the machine only ever adds time."""
    import torch
    import torch.distributed as dist

    full = torch.randn(n, device=device).to(dtype)
    shard = torch.empty(n // ranks, dtype=dtype, device=device)
    run = {"reduce_scatter": lambda: comm.reduce_scatter(shard, full),
           "all_gather": lambda: comm.all_gather(full, shard), "all_reduce": lambda: comm.all_reduce(full)}[kind]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        run().wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def bus_bytes(kind: str, size: int, ranks: int) -> float:
    """Bytes each rank moves in NCCL's bus convention."""
    return size * (ranks - 1) / ranks * (2 if kind == "all_reduce" else 1)


def fit_alpha_beta(seconds_by_size: dict[int, float], kind: str, ranks: int) -> tuple[float, float]:
    """(α seconds, bus bytes/s) of time = α + bus bytes / bandwidth, least squares over the sizes with α ≥ 0."""
    from scipy.optimize import nnls

    sizes = sorted(seconds_by_size)
    moved = np.array([bus_bytes(kind, s, ranks) for s in sizes])
    t = np.array([seconds_by_size[s] for s in sizes])
    weights = 1 / t  # relative errors: the small sizes tell α, the large ones the bandwidth
    (alpha, per_byte), _ = nnls(np.stack([np.ones_like(moved), moved], axis=1) * weights[:, None], t * weights)
    return float(alpha), float(1 / per_byte) if per_byte > 0 else float("inf")


def profile_fields(seconds: dict, ranks: int, p2p: bool) -> dict:
    """The profile fields (hwprofiles/profile.py's dotted names) of what `time_collectives` measured: NCCL's α (the
    mean over kinds) and bus bandwidth per kind; without P2P also the host-routed bound (NCCL then goes through
    host memory); and, informational, every transport's fit under `collectives_fit`."""
    fits = {name: {kind: dict(zip(("latency_s", "bus_bytes_per_s"), fit_alpha_beta(by_size, kind, ranks)))
                   for kind, by_size in kinds.items()} for name, kinds in seconds.items()}
    nccl = fits["torch"]
    fields = {"collectives.latency_s": float(np.mean([f["latency_s"] for f in nccl.values()])),
              "collectives.bus_bytes_per_s": {kind: f["bus_bytes_per_s"] for kind, f in nccl.items()},
              "collectives_fit": fits}
    if not p2p:
        fields["collectives.host_routed_bus_bytes_per_s"] = max(f["bus_bytes_per_s"] for f in nccl.values())
    return fields


def p2p_bytes_per_s(num_bytes: int = P2P_BYTES) -> float:
    """A copy from GPU 0 to GPU 1 (over NVLink or PCIe peer to peer, as CUDA routes it), bytes per second."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        best = min(best, time.perf_counter() - start)
    return num_bytes / best
