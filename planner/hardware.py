"""The machine a plan is made for: a shipped hwprofile, a user's JSON file or this machine's CPU (measured),
resized by the user's flags.

All rates come from the profile's JSON, validated by hwprofiles/schema.py; none are written here (STYLE.md, item 9).
A CPU profile describes the CPU as the device: it trains in host memory, so its "GPU" memory and the host memory
are one pool, and nothing crosses a bus (host-device copies run at its memory bandwidth).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fastml import hwprofiles
from fastml.config import check_range, fail, read_json
from fastml.hwprofiles.measure import attention_tiles, measured_attention_tiles
from fastml.hwprofiles.schema import Calibration, HardwareProfile, HostOverhead, NodeSection as Node, parse_profile


GEMM_OPERAND_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
"""Bytes of a GEMM's input elements by dtype; an fp8 GEMM writes bf16."""


@dataclass(frozen=True, kw_only=True)
class Gpu:
    memory_bytes: int
    peak_flops: dict[str, float]
    gemm_efficiency: tuple[tuple[float, float], ...]
    """(g, achieved / peak), g the geometric mean of a GEMM's M, N and K; sorted by g. A GPU's curve is of GEMMs
    against the dense bf16 peak; a CPU profile's is of attention against its fp32 peak (its GEMMs are measured at
    their exact shapes, `gemm_shapes`)."""
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    p2p: bool
    nvlink_bytes_per_s: float
    gemm_shapes: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
    """Efficiency measured at exactly these (M, N, K): on a CPU it depends on the shape more than on g."""
    backward_gemm_shapes: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
    """The two backward GEMMs' efficiency of the forward GEMM (M, N, K), in bf16."""
    fp8_gemm_shapes: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
    """fp8 GEMMs' efficiency against the fp8 peak, measured at these (M, N, K)."""
    fp8_backward_gemm_shapes: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)
    """The same for the two backward GEMMs of the forward GEMM (M, N, K)."""
    fp8_cast_bytes_per_s: float
    """fastml's fp8 casts, bytes as planner/costs.py counts them; the HBM rate where the profile has none."""
    elementwise_bytes_per_s: float
    """The blocks' elementwise work, bytes as planner/costs.py counts them; the HBM rate where the profile has none."""
    attention_shapes: dict[int, tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=dict)
    """head_dim -> ((seq_len, efficiency against the bf16 peak), ...) sorted, of causal attention forward and
    backward, measured."""
    attention_half_rate_tiles: float | None = None
    """Attention's rate against the query tiles in flight (the profile's gpu.attention_half_rate_tiles)."""
    sustained_compute_share: float = 1.0
    """The share of the measured GEMM and attention rates kept over a training run (the profile's)."""

    def gemm_seconds(self, m: int, n: int, k: int, dtype: str, backward: bool = False) -> float:
        """A GEMM's time: 2mnk FLOPs over the dtype's peak times the efficiency measured at this shape (in fp8, the
        fp8 GEMMs' where measured; `backward`: one of the two backward GEMMs of the forward GEMM (m, n, k), at their
        own rate where measured), else at this size (interpolated in log g; the curve is measured in bf16 and
        applied to fp8 too). Kept per shape: the search prices the same few shapes in every plan."""
        key = (m, n, k, dtype, backward)
        if key not in self._gemm_seconds:
            self._gemm_seconds[key] = self._priced_gemm_seconds(m, n, k, dtype, backward)
        return self._gemm_seconds[key]

    @functools.cached_property
    def _gemm_seconds(self) -> dict[tuple, float]:
        return {}

    def _priced_gemm_seconds(self, m: int, n: int, k: int, dtype: str, backward: bool) -> float:
        tables = [self.gemm_shapes]
        if dtype == "fp8":
            tables = [self.fp8_backward_gemm_shapes] * backward + [self.fp8_gemm_shapes] + tables
        elif dtype == "bf16":
            tables = [self.backward_gemm_shapes] * backward + tables
        measured = next((e for table in tables if (e := _shape_efficiency(table, m, n, k))), None)
        efficiency = measured or self.gemm_efficiency_at((m * n * k) ** (1 / 3))
        # At least the time to read its operands and write its result: a GEMM with one small side (an LM head's
        # chunk of tokens) is bound by its weight's bytes, which the curve in g does not see.
        operand, result = GEMM_OPERAND_BYTES[dtype], GEMM_OPERAND_BYTES["bf16" if dtype == "fp8" else dtype]
        memory_s = ((m * k + k * n) * operand + m * n * result) / self.hbm_bytes_per_s
        return max(2.0 * m * n * k / (self.sustained_flops_for(dtype) * efficiency), memory_s)

    def peak_flops_for(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            fail("knobs.matmul_dtype", f"{dtype!r}: this GPU has no {dtype} tensor cores in its profile (it has "
                                       f"{', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]

    def sustained_flops_for(self, dtype: str) -> float:
        """The peak scaled by the share a power-limited GPU keeps over a training run: what the efficiencies
        measured on short runs apply to."""
        return self.peak_flops_for(dtype) * self.sustained_compute_share

    def attention_efficiency(self, head_dim: int, seq_len: int, sequences: int, heads: int) -> float | None:
        """Measured attention's efficiency at the nearest head size measured (in log), interpolated in log
        seq_len and flat beyond the lengths measured, for `sequences` of `heads` query heads: the share of the rate
        measured (with many sequences) their query tiles reach (`attention_half_rate_tiles`); None where the
        profile measured none."""
        if not self.attention_shapes:
            return None
        nearest = min(self.attention_shapes, key=lambda d: (abs(math.log(d / head_dim)), d))
        efficiency = _log_interpolated(self.attention_shapes[nearest], seq_len)
        if not self.attention_half_rate_tiles:
            return efficiency
        x0 = self.attention_half_rate_tiles
        tiles, measured = attention_tiles(sequences, heads, seq_len), measured_attention_tiles(seq_len)
        return efficiency * (tiles / (tiles + x0)) / (measured / (measured + x0))

    def gemm_efficiency_at(self, g: float) -> float:
        sizes = [s for s, _ in self.gemm_efficiency]
        i = bisect.bisect_left(sizes, g)
        if i == 0:
            return self.gemm_efficiency[0][1] * g / sizes[0]  # below the curve: launch-bound, time ~ constant
        return _log_interpolated(self.gemm_efficiency, g)


def _log_interpolated(points: tuple[tuple[int, float], ...], x: float) -> float:
    """The value at x of (x, value) points sorted by x, linear in log x between them and flat outside."""
    xs = [px for px, _ in points]
    i = bisect.bisect_left(xs, x)
    if i == 0 or i == len(xs):
        return points[min(i, len(xs) - 1)][1]
    (x0, v0), (x1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * math.log(x / x0) / math.log(x1 / x0)


def _shape_efficiency(shapes: dict[tuple[int, int, int], float], m: int, n: int, k: int) -> float | None:
    """The efficiency measured at (m, n, k), or at the largest M measured below m with the same N and K (large
    GEMMs are measured with fewer rows, the rate having reached its plateau)."""
    below = [(mm, e) for (mm, nn, kk), e in shapes.items() if (nn, kk) == (n, k) and mm <= m]
    return max(below)[1] if below else None


@dataclass(frozen=True, kw_only=True)
class Machine:
    profile: str
    fingerprint: str
    source: str
    device: str
    """"cuda", or "cpu" where the CPU is the device and its memory the host's."""
    gpu: Gpu
    node: Node
    num_gpus: int
    collective_latency_s: float
    bus_bytes_per_s: dict[str, float]
    """NCCL bus bandwidth within a node at large sizes, by collective (all_reduce, reduce_scatter, all_gather)."""
    host_routed_bus_bytes_per_s: float
    """NCCL's bus bandwidth through host memory, without P2P (infinity where the profile gives none: PCIe bounds
    it)."""
    usd_per_gpu_hour: float
    """0 where the profile has no price (a CPU)."""
    watts_per_gpu: float
    calibration: Calibration = Calibration()
    """How measured runs on this machine differ from the model (planner/calibrate.py); applied by costs.py,
    simulate.py and memory.py."""
    host_overhead: HostOverhead | None = None
    """The host's time per pass and step, where the GPU may wait for it (costs.py); None: not priced."""

    @property
    def shares_host_memory(self) -> bool:
        """The device's memory is the host's: one pool for both sides' bytes."""
        return self.device == "cpu"

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


def load_machine(hw: str | dict, num_gpus: int | None = None, num_nodes: int | None = None,
                 gpu_memory: str | int | None = None, host_memory: str | int | None = None) -> Machine:
    """`hw` a shipped profile name, a JSON file or a profile's dict; "cpu" is this machine's CPU (measured once).
    num_gpus is per node, so the world is num_gpus x num_nodes."""
    data = hw if isinstance(hw, dict) else read_profile(hw)
    machine = _machine(parse_profile(data, data.get("name", "profile") if isinstance(hw, dict) else hw),
                       hwprofiles.fingerprint_of(data))
    if machine.shares_host_memory:
        return _resized_cpu(machine, num_gpus, num_nodes, gpu_memory, host_memory)
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


def check_cpu_options(profile: str, num_gpus, num_nodes, gpu_memory) -> None:
    """A CPU trains in host memory, as one device or as --gpus processes that share its cores (gloo between them),
    on this one machine: nodes and GPU memory do not apply."""
    if num_gpus is not None:
        check_range("--gpus", num_gpus, 1, MAX_CPU_PROCESSES)
    if num_nodes not in (None, 1):
        fail("--nodes", f"{num_nodes}: {profile} is this machine's CPU, one node; plan for several with --hw")
    if gpu_memory is not None:
        fail("--gpu-mem", f"{profile} is a CPU: it has no GPU memory; cap its memory with --host-mem")


MAX_CPU_PROCESSES = 64
"""More CPU processes than cores share them (each gets a thread): slower, but how CI tests four ranks on two cores."""


def _resized_cpu(machine: Machine, num_gpus, num_nodes, gpu_memory, host_memory) -> Machine:
    """A CPU trains as one device, or as `num_gpus` processes each with an equal share of its cores and memory
    bandwidth (the executor gives each process that many threads); --host-mem caps its one memory pool."""
    check_cpu_options(machine.profile, num_gpus, num_nodes, gpu_memory)
    n = num_gpus or 1
    gpu, node = machine.gpu, machine.node
    if n > 1:
        gpu = dataclasses.replace(gpu, peak_flops={k: v / n for k, v in gpu.peak_flops.items()},
                                  hbm_bytes_per_s=gpu.hbm_bytes_per_s / n, h2d_bytes_per_s=gpu.h2d_bytes_per_s / n,
                                  elementwise_bytes_per_s=gpu.elementwise_bytes_per_s / n,
                                  d2h_bytes_per_s=gpu.d2h_bytes_per_s / n)
        node = dataclasses.replace(node, gpus_per_node=n)  # the CPU AdamW's rate is shared in costs.py
    if host_memory is not None:
        pool = parse_bytes(host_memory, "--host-mem")
        gpu, node = dataclasses.replace(gpu, memory_bytes=pool), dataclasses.replace(node, host_memory_bytes=pool)
    return dataclasses.replace(machine, gpu=gpu, node=node, num_gpus=n)


def read_profile(hw: str) -> dict:
    if hw == "cpu":
        from fastml.hwprofiles.profile import this_cpu_profile

        return this_cpu_profile()
    return _read_file(hw) if _is_file(hw) else hwprofiles.load(hw)


def _is_file(hw: str) -> bool:
    return hw.endswith(".json") or Path(hw).is_file()


def _read_file(hw: str) -> dict:
    path = Path(hw)
    if not path.exists():
        fail("--hw", f"{hw}: no such file")
    data = read_json(path, "a hardware profile")
    if not isinstance(data, dict):
        fail("--hw", f"{hw}: not a hardware profile (expected a JSON object)")
    return data


def _machine(p: HardwareProfile, fingerprint: str) -> Machine:
    gpu, node = p.gpu, p.node
    # A CPU's "host-device" copies stay in its memory.
    h2d, d2h = (gpu.pcie.h2d_bytes_per_s, gpu.pcie.d2h_bytes_per_s) if gpu.pcie else (gpu.hbm_bytes_per_s,) * 2
    return Machine(
        profile=p.name, fingerprint=fingerprint, source=p.source, device=p.device,
        gpu=Gpu(memory_bytes=gpu.memory_bytes, peak_flops=dict(gpu.peak_flops),
                gemm_efficiency=tuple(sorted(gpu.gemm_efficiency)), hbm_bytes_per_s=gpu.hbm_bytes_per_s,
                gemm_shapes={(int(m), int(n), int(k)): e for m, n, k, e in gpu.gemm_shapes},
                backward_gemm_shapes={(int(m), int(n), int(k)): e for m, n, k, e in
                                      _checked_rows("gpu.backward_gemm_shapes", gpu.backward_gemm_shapes, 4)},
                fp8_gemm_shapes={(int(m), int(n), int(k)): e for m, n, k, e in gpu.fp8_gemm_shapes},
                fp8_backward_gemm_shapes={(int(m), int(n), int(k)): e for m, n, k, e in gpu.fp8_backward_gemm_shapes},
                fp8_cast_bytes_per_s=gpu.fp8_cast_bytes_per_s or gpu.hbm_bytes_per_s,
                elementwise_bytes_per_s=gpu.elementwise_bytes_per_s or gpu.hbm_bytes_per_s,
                attention_shapes=_by_head_dim(_checked_rows("gpu.attention_shapes", gpu.attention_shapes, 3)),
                attention_half_rate_tiles=gpu.attention_half_rate_tiles,
                sustained_compute_share=gpu.sustained_compute_share or 1.0,
                h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, p2p=gpu.p2p, nvlink_bytes_per_s=gpu.nvlink_bytes_per_s),
        node=node, num_gpus=node.gpus_per_node,
        collective_latency_s=p.collectives.latency_s, bus_bytes_per_s=dict(p.collectives.bus_bytes_per_s),
        host_routed_bus_bytes_per_s=p.collectives.host_routed_bus_bytes_per_s or math.inf,
        usd_per_gpu_hour=p.price.usd_per_gpu_hour if p.price else 0.0,
        watts_per_gpu=p.power.watts_per_gpu if p.power else 0.0, calibration=p.calibration,
        host_overhead=p.host_overhead)


def _checked_rows(name: str, rows: tuple[tuple[float, ...], ...], length: int) -> tuple[tuple[float, ...], ...]:
    """Rows of `length` positive numbers (sizes, then an efficiency), else one line naming the row."""
    for i, row in enumerate(rows):
        if len(row) != length or not all(value > 0 for value in row):
            fail(f"{name}[{i}]", f"{list(row)}: expected {length} positive numbers (sizes, then an efficiency)")
    return rows


def _by_head_dim(rows: tuple[tuple[float, float, float], ...]) -> dict[int, tuple[tuple[int, float], ...]]:
    by_head_dim = {}
    for head_dim, seq_len, efficiency in rows:
        by_head_dim.setdefault(int(head_dim), []).append((int(seq_len), efficiency))
    return {d: tuple(sorted(points)) for d, points in by_head_dim.items()}


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
