"""The machine a plan is made for: a shipped hwprofile (or a user's JSON file), resized by the user's flags.

All rates come from the profile's JSON; none are written here (STYLE.md, item 9).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fastml import hwprofiles
from fastml.config import UserError, check_range, fail, read_json


@dataclass(frozen=True, kw_only=True)
class Gpu:
    memory_bytes: int
    peak_flops: dict[str, float]
    gemm_efficiency: tuple[tuple[float, float], ...]
    """(g, achieved / dense bf16 peak), g the geometric mean of a GEMM's M, N and K; sorted by g."""
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    p2p: bool
    nvlink_bytes_per_s: float

    def gemm_seconds(self, m: int, n: int, k: int, dtype: str) -> float:
        """A GEMM's time: 2mnk FLOPs over the dtype's peak times the efficiency measured at this size
        (interpolated in log g; the curve is measured in bf16 and applied to fp8 too)."""
        return 2.0 * m * n * k / (self.peak_flops_for(dtype) * self.gemm_efficiency_at((m * n * k) ** (1 / 3)))

    def peak_flops_for(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            fail("knobs.matmul_dtype", f"{dtype!r}: this GPU has no {dtype} tensor cores in its profile (it has "
                                       f"{', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]

    def gemm_efficiency_at(self, g: float) -> float:
        sizes = [s for s, _ in self.gemm_efficiency]
        i = bisect.bisect_left(sizes, g)
        if i == 0:
            return self.gemm_efficiency[0][1] * g / sizes[0]  # below the curve: launch-bound, time ~ constant
        if i == len(sizes):
            return self.gemm_efficiency[-1][1]
        (g0, e0), (g1, e1) = self.gemm_efficiency[i - 1], self.gemm_efficiency[i]
        return e0 + (e1 - e0) * math.log(g / g0) / math.log(g1 / g0)


@dataclass(frozen=True, kw_only=True)
class Node:
    gpus_per_node: int
    host_memory_bytes: int
    h2d_all_gpus_bytes_per_s: float
    """All GPUs of the node copying from host at once: the shared PCIe root complex's limit."""
    cpu_adam_params_per_s: float
    host_copy_bytes_per_s: float
    nic_bytes_per_s: float


@dataclass(frozen=True, kw_only=True)
class Machine:
    profile: str
    fingerprint: str
    source: str
    gpu: Gpu
    node: Node
    num_gpus: int
    collective_latency_s: float
    bus_bytes_per_s: dict[str, float]
    """NCCL bus bandwidth within a node at large sizes, by collective (all_reduce, reduce_scatter, all_gather)."""
    usd_per_gpu_hour: float
    watts_per_gpu: float

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_gpus / self.node.gpus_per_node)

    @property
    def gpus_per_node(self) -> int:
        return min(self.num_gpus, self.node.gpus_per_node)

    def h2d_bytes_per_s(self) -> float:
        """One GPU's host-to-device rate while every GPU of its node copies too."""
        return min(self.gpu.h2d_bytes_per_s, self.node.h2d_all_gpus_bytes_per_s / self.gpus_per_node)

    def d2h_bytes_per_s(self) -> float:
        return min(self.gpu.d2h_bytes_per_s, self.node.h2d_all_gpus_bytes_per_s / self.gpus_per_node)


def load_machine(hw: str, num_gpus: int | None = None, num_nodes: int | None = None,
                 gpu_memory: str | int | None = None, host_memory: str | int | None = None) -> Machine:
    """`hw` a shipped profile name or a JSON file; num_gpus is per node, so the world is num_gpus x num_nodes."""
    data = _read_profile(hw)
    try:
        machine = _machine(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"hardware profile {hw!r}: malformed ({e.__class__.__name__}: {e})") from None
    node = machine.node
    gpus_per_node = node.gpus_per_node if num_gpus is None else num_gpus
    check_range("--gpus", gpus_per_node, 1)
    check_range("--nodes", num_nodes or 1, 1)
    if num_nodes and num_nodes > 1 and gpus_per_node != node.gpus_per_node:
        fail("--gpus", f"with several nodes each node has all its {node.gpus_per_node} GPUs")
    gpu = machine.gpu if gpu_memory is None else dataclasses.replace(
        machine.gpu, memory_bytes=min(machine.gpu.memory_bytes, parse_bytes(gpu_memory, "--gpu-mem")))
    if host_memory is not None:
        node = dataclasses.replace(node, host_memory_bytes=parse_bytes(host_memory, "--host-mem"))
    node = dataclasses.replace(node, gpus_per_node=gpus_per_node if (num_nodes or 1) == 1 else node.gpus_per_node)
    return dataclasses.replace(machine, gpu=gpu, node=node, num_gpus=gpus_per_node * (num_nodes or 1))


def has_gpu(hw: str) -> bool:
    """Whether a profile describes GPUs (the shipped `cpu` profile and `fastml profile` without a GPU do not)."""
    gpu = _read_profile(hw).get("gpu")
    if not isinstance(gpu, dict):
        fail("--hw", f"{hw}: not a hardware profile (no 'gpu' object)")
    return bool(gpu.get("memory_bytes"))


def _read_profile(hw: str) -> dict:
    path = Path(hw)
    if hw.endswith(".json") or path.is_file():
        if not path.exists():
            fail("--hw", f"{hw}: no such file")
        data = read_json(path, "a hardware profile")
        if not isinstance(data, dict):
            fail("--hw", f"{hw}: not a hardware profile (expected a JSON object)")
        return data
    return hwprofiles.load(hw)


def _machine(data: dict) -> Machine:
    gpu, node, pcie = data["gpu"], data["node"], data["gpu"].get("pcie", {})
    return Machine(
        profile=data["name"], fingerprint=hwprofiles.fingerprint_of(data), source=data["source"],
        gpu=Gpu(memory_bytes=int(gpu["memory_bytes"]), peak_flops=dict(gpu["peak_flops"]),
                gemm_efficiency=tuple(sorted((float(g), float(e)) for g, e in gpu.get("gemm_efficiency", []))),
                hbm_bytes_per_s=float(gpu.get("hbm_bytes_per_s", 0)),
                h2d_bytes_per_s=float(pcie.get("h2d_bytes_per_s", 0)),
                d2h_bytes_per_s=float(pcie.get("d2h_bytes_per_s", 0)), p2p=bool(gpu.get("p2p", False)),
                nvlink_bytes_per_s=float(gpu.get("nvlink_bytes_per_s", 0))),
        node=Node(**{k: node[k] for k in ("gpus_per_node", "host_memory_bytes", "h2d_all_gpus_bytes_per_s",
                                           "cpu_adam_params_per_s", "host_copy_bytes_per_s", "nic_bytes_per_s")}),
        num_gpus=int(node["gpus_per_node"]),
        collective_latency_s=float(data["collectives"]["latency_s"]),
        bus_bytes_per_s=dict(data["collectives"]["bus_bytes_per_s"]),
        usd_per_gpu_hour=float(data["price"]["usd_per_gpu_hour"]),
        watts_per_gpu=float(data["power"]["watts_per_gpu"]))


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int, where: str) -> int:
    """'16GiB', '24 GB', '512gib' or a plain number of bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        fail(where, f"{value!r} is not a size; write e.g. 16GiB, 24GB or 512GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
