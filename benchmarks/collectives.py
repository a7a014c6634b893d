"""The collectives of a job of several processes on this machine, timed: torch's (gloo between CPU processes, NCCL
between GPUs) beside fastml's memcpy collectives (executor/hostcomm.py), reduce-scatter, all-gather and all-reduce
over sizes, as bus bandwidth (NCCL's convention: bytes each rank moves, (n-1)/n of the size, twice for an
all-reduce, over the time). Writes benchmarks/results/collectives-<device>.json; on a CPU these are the figures behind
hwprofiles/cpu.json's gloo estimate.

    python benchmarks/collectives.py [--device cpu|cuda] [--ranks 2]     # starts the ranks itself
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (2**16, 2**20, 2**24, 2**26)
"""Bytes of the whole tensor (fp32 on a CPU, bf16 on a GPU)."""
REPEATS = 5


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args.add_argument("--ranks", type=int, default=2)
    args.add_argument("--worker", help=argparse.SUPPRESS)
    a = args.parse_args()
    if a.worker:
        return worker(a.device, Path(a.worker))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(a.ranks), __file__, "--device", a.device, "--worker", str(out)], check=True)
        figures = json.loads(out.read_text())
    from record import write_result

    path = write_result(f"collectives-{a.device}.json", {"ranks": a.ranks, "figures": figures,
                                                        "meaning": "bus bandwidth, bytes/s; time, s; per size"})
    print(f"wrote {path}")


def worker(device_type: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from fastml.executor.collectives import TorchCollectives
    from fastml.executor.hostcomm import HostCollectives
    from fastml.executor.world import launched

    world = launched()
    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_size))
    device = torch.device(device_type, world.local_rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("gloo" if device_type == "cpu" else "cpu:gloo,cuda:nccl")
    dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    transports = {"torch": TorchCollectives(world), "memcpy": HostCollectives(world, device)}
    figures = {}
    for name, comm in transports.items():
        for size in SIZES:
            n = size // dtype.itemsize // world.size * world.size
            for kind in ("reduce_scatter", "all_gather", "all_reduce"):
                seconds = _time(comm, kind, n, world.size, device, dtype)
                moved = n * dtype.itemsize * (world.size - 1) / world.size * (2 if kind == "all_reduce" else 1)
                figures.setdefault(name, {}).setdefault(kind, {})[size] = {"s": seconds,
                                                                           "bus_bytes_per_s": moved / seconds}
    transports["memcpy"].close()
    if world.main:
        out.write_text(json.dumps(figures))
    dist.destroy_process_group()


def _time(comm, kind: str, n: int, ranks: int, device, dtype) -> float:
    """The fastest of REPEATS runs after a warm-up: other work on the machine only ever adds time."""
    import torch
    import torch.distributed as dist

    full = torch.randn(n, device=device).to(dtype)
    shard = torch.empty(n // ranks, dtype=dtype, device=device)
    run = {"reduce_scatter": lambda: comm.reduce_scatter(shard, full),
           "all_gather": lambda: comm.all_gather(full, shard), "all_reduce": lambda: comm.all_reduce(full)}[kind]
    times = []
    for _ in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        run().wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
