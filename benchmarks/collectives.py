"""The collectives of a job of several processes on this machine, timed: torch's (gloo between CPU processes, NCCL
between GPUs) beside fastml's memcpy collectives (executor/parallel/hostcomm.py), reduce-scatter, all-gather and all-reduce
over sizes, as bus bandwidth (NCCL's convention: bytes each rank moves, (n-1)/n of the size, twice for an
all-reduce, over the time). Writes benchmarks/results/collectives-<device>.json; on a CPU these are the figures behind
hwprofiles/cpu.json's gloo estimate.

    python benchmarks/collectives.py [--device cpu|cuda] [--ranks 2]

It starts the ranks itself, as `fastml profile` does on a machine of several GPUs (hwprofiles/between_gpus.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SIZES = (2**16, 2**20, 2**24, 2**26)
"""Bytes of the whole tensor (fp32 on a CPU, bf16 on a GPU)."""


def main() -> None:
    from fastml.hwprofiles.between_gpus import bus_bytes, time_collectives

    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args.add_argument("--ranks", type=int, default=2)
    a = args.parse_args()
    seconds = time_collectives(a.device, a.ranks, SIZES)  # the workers `fastml profile` starts
    figures = {name: {kind: {size: {"s": s, "bus_bytes_per_s": bus_bytes(kind, size, a.ranks) / s}
                             for size, s in by_size.items()} for kind, by_size in kinds.items()}
               for name, kinds in seconds.items()}
    from record import write_result

    path = write_result(f"collectives-{a.device}.json", {"ranks": a.ranks, "figures": figures,
                                                        "meaning": "bus bandwidth, bytes/s; time, s; per size"})
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
