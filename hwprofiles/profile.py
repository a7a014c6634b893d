"""`fastml profile`: the GPUs, their links and the host as NVML reports them, and the rates measured on them
(hwprofiles/measure.py), written as a hwprofile JSON that `fastml plan` then uses for this machine; and this machine's
CPU, measured, as the profile CPU plans are made with.

A GPU profile starts from the nearest shipped one: what NVML detects and what is measured are written over it, and
the rest (the dense peaks, the collectives between GPUs, the price and the power) is the shipped profile's; the
written `source` says which fields are which. A CPU has no datasheet to take rates from, so they are measured (a few
seconds, once per machine and torch, cached): the best fp32 matmul rate, the forward and backward GEMMs of the
linear layers of each model planned (the efficiency curve), their blocks' elementwise work as the executor runs it
(a CPU runs it far below its copy's rate), and the memory bandwidth of a large tensor copy.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fastml import hwprofiles
from fastml.config import fail, gib
from fastml.hwprofiles.schema import ATTENTION_BACKWARD_FACTOR, ELEMENTWISE_PASSES

DEFAULT_OUTPUT = "hwprofile.json"

_SHORT_LEVEL = {"same board": "BOARD", "single PCIe switch": "PIX", "multiple PCIe switches": "PXB",
                "host bridge": "PHB", "NUMA node": "NODE", "system": "SYS"}


def detect_topology() -> dict:
    """GPUs, PCIe and NVLink links, P2P and topology between every pair, and the host, read through NVML.

    With no NVML library or driver the result has no GPUs and says why in `no_gpu_reason`."""
    topology = {"date": datetime.date.today().isoformat(), "host": _host(), "gpus": [], "p2p": [],
                "topology": [], "no_gpu_reason": None}
    try:
        import pynvml as nvml
    except ImportError as e:
        return {**topology, "no_gpu_reason": f"nvidia-ml-py is not installed: {e}"}
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return {**topology, "no_gpu_reason": f"NVML is not available: {e}"}
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        topology["host"]["driver_version"] = _text(_query(nvml, "nvmlSystemGetDriverVersion"))
        topology["gpus"] = [_gpu(nvml, i, handle) for i, handle in enumerate(handles)]
        topology["p2p"] = _matrix(handles, lambda a, b: _p2p_status(nvml, a, b))
        topology["topology"] = _matrix(handles, lambda a, b: _topology_level(nvml, a, b))
    finally:
        nvml.nvmlShutdown()
    if not handles:
        topology["no_gpu_reason"] = "NVML found no GPU"
    return topology


def _query(nvml, function: str, *args):
    """One NVML call, or None where this GPU, driver or binding does not support it."""
    fn = getattr(nvml, function, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _host() -> dict:
    # On some VMs memory is added as it is used, so this can read low; the user can edit the written file.
    return {"memory_bytes": hwprofiles.host_memory_bytes(), "num_cpus": os.cpu_count(), "driver_version": None}


def _gpu(nvml, index: int, handle) -> dict:
    numa_node = _query(nvml, "nvmlDeviceGetNumaNodeId", handle)
    num_words = -(-(os.cpu_count() or 1) // 64)
    return {
        "index": index,
        "name": _text(nvml.nvmlDeviceGetName(handle)),
        "memory_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        "pcie": {"generation": _query(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
                 "max_generation": _query(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle),
                 "width": _query(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle),
                 "max_width": _query(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle)},
        "num_nvlinks": _num_nvlinks(nvml, handle),
        "numa_node": numa_node if numa_node is not None and numa_node >= 0 else None,
        "cpu_affinity": _cpu_list(_query(nvml, "nvmlDeviceGetCpuAffinity", handle, num_words)),
        "num_sms": getattr(_query(nvml, "nvmlDeviceGetAttributes", handle), "multiprocessorCount", None),
    }


def _num_nvlinks(nvml, handle) -> int:
    states = [_query(nvml, "nvmlDeviceGetNvLinkState", handle, link) for link in range(nvml.NVML_NVLINK_MAX_LINKS)]
    return sum(state == nvml.NVML_FEATURE_ENABLED for state in states)


def _p2p_status(nvml, a, b) -> str | None:
    """NVML's P2P read status between two GPUs ("ok", or why not); None where NVML cannot tell."""
    index = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    index = index[0] if isinstance(index, tuple) else index  # nvidia-ml-py 13 defines it as (0,), a stray comma
    status = _query(nvml, "nvmlDeviceGetP2PStatus", a, b, index)
    if status is None:
        return None
    names = {nvml.NVML_P2P_STATUS_OK: "ok", nvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED: "chipset not supported",
             nvml.NVML_P2P_STATUS_GPU_NOT_SUPPORTED: "GPU not supported",
             nvml.NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED: "IOH topology not supported",
             nvml.NVML_P2P_STATUS_DISABLED_BY_REGKEY: "disabled by regkey",
             nvml.NVML_P2P_STATUS_NOT_SUPPORTED: "not supported"}
    return names.get(status, "unknown")


def _topology_level(nvml, a, b) -> str | None:
    """The closest common ancestor of two GPUs on the PCIe tree; None where NVML cannot tell."""
    level = _query(nvml, "nvmlDeviceGetTopologyCommonAncestor", a, b)
    names = {nvml.NVML_TOPOLOGY_INTERNAL: "same board", nvml.NVML_TOPOLOGY_SINGLE: "single PCIe switch",
             nvml.NVML_TOPOLOGY_MULTIPLE: "multiple PCIe switches", nvml.NVML_TOPOLOGY_HOSTBRIDGE: "host bridge",
             nvml.NVML_TOPOLOGY_NODE: "NUMA node", nvml.NVML_TOPOLOGY_SYSTEM: "system"}
    return None if level is None else names.get(level, f"level {level}")


def _matrix(handles: list, value) -> list[list]:
    return [[None if i == j else value(a, b) for j, b in enumerate(handles)] for i, a in enumerate(handles)]


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _cpu_list(words) -> str | None:
    """NVML's CPU affinity bit mask (64-bit words) as a list of ranges, like "0-31,64-95"."""
    if words is None:
        return None
    spans: list[list[int]] = []
    for cpu in (64 * i + bit for i, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or None


def profile_json(topology: dict, measured: dict | None = None) -> dict:
    """A hwprofile (the schema of hwprofiles/*.json) for the detected machine: the nearest shipped profile with
    what was detected and what was `measured` (hwprofiles/measure.py's fields) written over it, the raw topology under
    the extra top-level key `detected` and the measurements under `measured`."""
    if not topology["gpus"]:
        # Measured again: the way to replace a cached measurement taken while other work loaded the CPU.
        return this_cpu_profile(topology=topology, fresh=True)
    gpus = topology["gpus"]
    base, match = _base_profile(gpus[0]["name"], gpus[0]["memory_bytes"])
    data = copy.deepcopy(hwprofiles.load(base))
    fields = _write_detected(data, topology)
    rates = _write_measured(data, measured or {})
    kinds = sorted({g["name"] for g in gpus})
    mixed = f"; the GPUs are of {len(kinds)} kinds, so the profile takes the smallest memory and PCIe link" \
        if len(kinds) > 1 else ""
    how = "--quick, " if rates and measured.get("quick") else ""
    measured_here = f" Measured by `fastml profile` ({how}hwprofiles/measure.py): {', '.join(rates)}." if rates else ""
    data["name"] = f"detected-{base}"
    data["source"] = (
        f"detected by `fastml profile` on {topology['date']}: {', '.join(fields)}; the raw NVML topology is under "
        f"`detected`{mixed}.{measured_here} Taken from shipped profile {base!r} ({match}): every other figure "
        f"(the dense peaks, price and power, and NVLink and the collectives where not measured). Source of "
        f"{base!r}: {data['source']}")
    data["detected"] = {**topology, "base_profile": base, "base_match": match}
    if measured:
        data["measured"] = measured
    return data


def _write_measured(data: dict, measured: dict) -> list[str]:
    """Writes the measured rates over `data` (dotted profile fields, hwprofiles/measure.py); returns their names."""
    written = []
    for field, value in measured.items():
        if "." not in field:  # informational (the launch cost, whether --quick)
            continue
        section, _, name = field.rpartition(".")
        target = data
        for part in section.split("."):
            target = target.setdefault(part, {})
        target[name] = value
        written.append(field)
    return written


def _base_profile(device_name: str, memory_bytes: int) -> tuple[str, str]:
    """The shipped profile listing this GPU name, else the GPU profile nearest in memory; and how it was chosen."""
    named = hwprofiles.for_device_name(device_name)
    if named:
        return named, f"its device_names list {device_name!r}"
    candidates = [n for n in hwprofiles.names() if hwprofiles.load(n).get("device", "cuda") == "cuda"]
    if not candidates:
        fail("profile", "no shipped GPU profile to start from")
    nearest = min(candidates, key=lambda n: abs(hwprofiles.load(n)["gpu"]["memory_bytes"] - memory_bytes))
    return nearest, f"nearest in GPU memory: no shipped profile lists {device_name!r}"


def _write_detected(data: dict, topology: dict) -> list[str]:
    """Writes the detected values over `data`; returns the dotted names of the fields written."""
    gpus, gpu, node = topology["gpus"], data["gpu"], data["node"]
    data["device_names"] = sorted({g["name"] for g in gpus})
    gpu["memory_bytes"] = min(g["memory_bytes"] for g in gpus)
    node["gpus_per_node"] = len(gpus)
    node["host_memory_bytes"] = topology["host"]["memory_bytes"]
    fields = ["name", "device_names", "gpu.memory_bytes", "node.gpus_per_node", "node.host_memory_bytes"]
    if len(gpus) > 1:
        # A pair NVML cannot tell about counts as no P2P: the safe assumption for a consumer box.
        pairs = [s for i, row in enumerate(topology["p2p"]) for j, s in enumerate(row) if i != j]
        gpu["p2p"] = all(s == "ok" for s in pairs)
        fields.append("gpu.p2p (P2P read OK between every pair)")
    for key, detected in (("generation", "max_generation"), ("lanes", "max_width")):
        values = [g["pcie"][detected] for g in gpus]
        if None not in values:
            gpu.setdefault("pcie", {})[key] = min(values)
            fields.append(f"gpu.pcie.{key} (the link's maximum)")
    return fields


def print_topology(topology: dict, console: Console) -> None:
    host = topology["host"]
    driver = f", NVIDIA driver {host['driver_version']}" if host.get("driver_version") else ""
    console.print(f"host: {host['num_cpus']} CPUs, {gib(host['memory_bytes'])} memory{driver}")
    if not topology["gpus"]:
        console.print(f"no CUDA GPU found ({topology['no_gpu_reason']})")
        return
    console.print(_gpu_table(topology["gpus"]))
    if len(topology["gpus"]) > 1:
        console.print(_pair_table(topology))
        legend = ", ".join(f"{short} {name}" for name, short in _SHORT_LEVEL.items())
        console.print(f"P2P: ok, no or ? (unknown); common ancestor: {legend}")


def _gpu_table(gpus: list[dict]) -> Table:
    table = Table("GPU", "name", "memory GiB", "PCIe (max)", "NVLink links", "NUMA", "CPUs", "SMs", title="GPUs")
    for g in gpus:
        pcie = g["pcie"]
        link = f"gen{_or_unknown(pcie['max_generation'])} x{_or_unknown(pcie['max_width'])}"
        if (pcie["generation"], pcie["width"]) != (pcie["max_generation"], pcie["max_width"]):
            link += f" (now gen{_or_unknown(pcie['generation'])} x{_or_unknown(pcie['width'])})"
        table.add_row(str(g["index"]), g["name"], f"{g['memory_bytes'] / 2**30:.1f}", link, str(g["num_nvlinks"]),
                      _or_unknown(g["numa_node"]), _or_unknown(g["cpu_affinity"]), _or_unknown(g["num_sms"]))
    return table


def _pair_table(topology: dict) -> Table:
    n = len(topology["gpus"])
    table = Table("", *(f"GPU {j}" for j in range(n)), title="P2P read / closest common ancestor")
    for i in range(n):
        cells = ["-" if i == j else f"{_p2p_mark(topology['p2p'][i][j])} "
                 f"{_SHORT_LEVEL.get(topology['topology'][i][j], _or_unknown(topology['topology'][i][j]))}"
                 for j in range(n)]
        table.add_row(f"GPU {i}", *cells)
    return table


def _p2p_mark(status: str | None) -> str:
    return "?" if status is None else "ok" if status == "ok" else "no"


def _or_unknown(value) -> str:
    return "?" if value is None else str(value)


def _dumps(data: dict) -> str:
    """Indented JSON with each list of numbers or strings on one line, as in the shipped profiles."""
    def one_line(match: re.Match) -> str:
        try:
            return json.dumps(json.loads(match.group()))
        except json.JSONDecodeError:  # brackets inside a string
            return match.group()
    return re.sub(r"\[[^\[\]{}]*\]", one_line, json.dumps(data, indent=2)) + "\n"


def profile(output: str | None = None, console: Console | None = None, quick: bool = False) -> dict:
    """`fastml profile [--quick] [-o FILE]`: detects the machine, prints it, measures its GPUs' rates, writes its
    hwprofile JSON to `output` (default hwprofile.json) and as this machine's profile, which `fastml plan` uses
    (hwprofiles.machine_profile_path), and returns it."""
    console = console or Console()
    topology = detect_topology()
    print_topology(topology, console)
    data = profile_json(topology, _measure(topology, quick, console) if topology["gpus"] else None)
    path = Path(output or DEFAULT_OUTPUT)
    try:
        path.write_text(_dumps(data))
    except OSError as e:
        fail("-o", f"cannot write {path}: {e.strerror or e}")
    if data.get("device") == "cpu":
        console.print(f"wrote {path}: profile {data['name']!r}, no CUDA GPU: this CPU's rates, measured")
        return data
    cached = hwprofiles.save_machine_profile(data)
    console.print(f"wrote {path}: profile {data['name']!r}, measured here (see its source); `fastml plan` on this "
                  f"machine uses it ({cached})")
    return data


FIRST_USE_S = 20
"""About how long the first-use measurement takes (`measure_on_first_use`), as said before it starts."""


def measure_on_first_use(say=None) -> dict:
    """`fastml plan` on a GPU machine nobody has profiled: the quick profile, without building fastml's native ops
    (what needs them keeps the shipped figures until `fastml profile` measures it), cached where `fastml profile`
    caches its own; one line before, one after. Returns the profile."""
    from fastml.hwprofiles.measure import measure_gpus

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    topology = detect_topology()
    gpus = topology["gpus"]
    path = hwprofiles.machine_profile_path(gpus[0]["name"], len(gpus))
    say(f"measuring this machine's {len(gpus)} x {gpus[0]['name']} for planning, once (about {FIRST_USE_S} s; "
        f"cached in {path}; `fastml profile` measures more, --no-profile plans with the shipped figures)")
    base, _ = _base_profile(gpus[0]["name"], gpus[0]["memory_bytes"])
    peaks = hwprofiles.load(base)["gpu"]["peak_flops"]
    start = time.perf_counter()
    measured = measure_gpus(peaks["bf16"], quick=True, nvlink=all(g["num_nvlinks"] for g in gpus),
                            peak_fp8_flops=peaks.get("fp8"), build_ops=False)
    data = profile_json(topology, {**measured, "quick": True, "date": topology["date"]})
    hwprofiles.save_machine_profile(data)
    kept = f"; kept {base}'s {', '.join(measured['not_built'])} (fastml's native ops are not built yet)" \
        if measured.get("not_built") else ""
    say(f"measured in {time.perf_counter() - start:.0f} s{kept}")
    return data


def _measure(topology: dict, quick: bool, console: Console) -> dict:
    from rich.progress import Progress

    from fastml.hwprofiles.measure import measure_gpus

    base, _ = _base_profile(topology["gpus"][0]["name"], topology["gpus"][0]["memory_bytes"])
    peaks = hwprofiles.load(base)["gpu"]["peak_flops"]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=None)
        start = time.perf_counter()
        measured = measure_gpus(peaks["bf16"], quick,
                                lambda what: progress.update(task, description=f"measuring {what}"),
                                nvlink=all(g["num_nvlinks"] for g in topology["gpus"]), peak_fp8_flops=peaks.get("fp8"))
    console.print(f"measured in {time.perf_counter() - start:.0f} s", highlight=False)
    if "fp8_error" in measured:
        console.print(f"[yellow]note:[/] fp8 not measured ({measured['fp8_error']}): the profile keeps whatever fp8 "
                      f"figures {base} has; without them the planner prices fp8 GEMMs at the bf16 efficiencies and "
                      f"fp8 casts at the HBM rate")
    if "between_gpus_error" in measured:
        console.print(f"[yellow]warning:[/] the measurements between GPUs failed ({measured['between_gpus_error']}); "
                      f"the profile keeps {base}'s figures for peer copies and collectives")
    return {**measured, "quick": quick, "date": topology["date"]}


# ------------------------------------------------------------------------------------ this machine's CPU, measured

PEAK_SQUARE_SIZES = (1024, 2048)
COPY_ELEMENTS = 32 * 2**20  # fp32: 128 MiB, far beyond any cache
MAX_MEASURED_FLOPS = 2e10
"""A linear layer's forward and backward GEMMs above this many FLOPs are measured with fewer tokens (the same
layer): large GEMMs run at the CPU's plateau, and the measurement stays a few seconds for any model."""
ATTENTION_FLOPS_FACTOR = 1 + ATTENTION_BACKWARD_FACTOR
"""Attention's forward and backward over its forward FLOPs."""
ADAM_BYTES_PER_PARAM = 7 * 4
"""fp32 AdamW on fp32 parameters, as a CPU trains: it reads the gradient and reads and writes the weight, m and v
(planner/costs.py's optimizer_step_bytes of such a plan, which a test holds it to)."""


def linear_shapes(spec, token_counts: Iterable[int]) -> list[tuple[int, int, int]]:
    """(tokens, out, in) of every linear layer of `spec` (the costs of planner/costs.py) at each token count."""
    layers = [*spec.block_linear_shapes().values(), spec.lm_head_shape()]
    return sorted({_measurable(t, n, k) for t in token_counts for n, k in layers})


def _measurable(tokens: int, out: int, inp: int) -> tuple[int, int, int]:
    while tokens > 1 and 6 * tokens * out * inp > MAX_MEASURED_FLOPS:
        tokens //= 2
    return tokens, out, inp


def attention_shapes(spec, seq_len: int, micro_batches: Iterable[int]) -> list[tuple[int, int, int, int, int]]:
    """(batch, seq, heads, kv_heads, head_dim) of `spec`'s attention at each micro-batch, with fewer sequences, and a
    shorter sequence, where one would take long (as for linear layers): attention's rate levels off with the
    sequence's length, and the planner prices a longer one at the rate of the longest measured (planner/costs.py)."""
    shapes = set()
    for batch in micro_batches:
        seq = seq_len
        while seq > 1 and ATTENTION_FLOPS_FACTOR * _attention_flops(1, seq, spec.q_size) > MAX_MEASURED_FLOPS:
            seq //= 2
        flops = ATTENTION_FLOPS_FACTOR * _attention_flops(1, seq, spec.q_size)
        while batch > 1 and batch * flops > MAX_MEASURED_FLOPS:
            batch //= 2
        shapes.add((batch, seq, spec.num_heads, spec.num_kv_heads, spec.head_dim))
    return sorted(shapes)


MAX_ELEMENTWISE_ELEMENTS = 2**25
"""The blocks' elementwise work is measured at no more tokens than keep its largest tensor below this many elements
(as for linear layers: a CPU's rate levels off long before)."""


def elementwise_shapes(spec, token_counts: Iterable[int]) -> list[tuple[int, int, int, int, int, int]]:
    """(tokens, hidden, heads, kv_heads, head_dim, ffn) of `spec`'s blocks at each token count, fewer tokens where
    that would exceed MAX_ELEMENTWISE_ELEMENTS."""
    shapes = set()
    for tokens in token_counts:
        while tokens > 1 and tokens * 2 * spec.ffn_hidden_size > MAX_ELEMENTWISE_ELEMENTS:
            tokens //= 2
        shapes.add((tokens, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size))
    return sorted(shapes)


def _attention_flops(batch: int, seq_len: int, q_size: int) -> float:
    """Causal attention's forward matmul FLOPs, as ModelSpec.attention_forward_flops_per_token counts them."""
    return 2.0 * batch * seq_len * seq_len * q_size


def process_threads(processes: int) -> int:
    """The torch threads of each of `processes` CPU processes training together: an equal share of this process's
    threads (executor/loop/device.py gives each rank its share of the cores), at least one."""
    import torch

    return max(1, torch.get_num_threads() // processes)


def measure_cpu(shapes: list[tuple[int, int, int]], attention: list[tuple[int, ...]] = (),
                elementwise: list[tuple[int, ...]] = (), say=None, fresh: bool = False,
                threads: int | None = None) -> hwprofiles.CpuMeasurements:
    """This CPU's measurements for the given linear-layer, attention and elementwise shapes (`elementwise_shapes`),
    run with `threads` torch threads (a process's share, `process_threads`; default all of them): the cached ones,
    with what they lack measured now (and cached); `fresh` measures them all again. Each figure keeps the best ever
    measured: other work sharing the CPU only ever slows a measurement, so the fastest is the machine's own rate,
    and a peak or a rate measured under load is replaced by the next measurement at a quieter time. `say` gets the
    progress lines."""
    import torch

    cached = hwprofiles.this_cpu()
    all_threads = torch.get_num_threads()
    threads = min(threads or all_threads, all_threads)
    # each table of timings: the shapes asked for that it lacks, and how to time one
    tables = {"linear_seconds": (shapes, _linear_seconds), "attention_seconds": (attention, _attention_seconds),
              "elementwise_seconds": (elementwise, _elementwise_seconds)}
    missing = {table: [s for s in wanted if fresh or cached is None or
                       _shape_key(s, threads, all_threads) not in getattr(cached, table)]
               for table, (wanted, _) in tables.items()}
    missing_host = fresh or cached is None or str(threads) not in cached.host_overhead
    if not any(missing.values()) and not missing_host:
        return cached
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    per_process = f" with {threads} of its {all_threads} threads (a process's share)" if threads < all_threads else ""
    counts = [len(missing[table]) for table in tables]
    say(f"measuring this CPU for planning: its peak and memory bandwidth, {counts[0]} GEMM, {counts[1]} attention "
        f"and {counts[2]} elementwise shapes{', the training loop' if missing_host else ''}{per_process} "
        f"(cached in {hwprofiles.cpu_cache_path()})")
    load, num_cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > num_cpus / 2:
        say(f"warning: other work loads this CPU (load average {load:.1f} on {num_cpus} CPUs): its measured rates "
            f"may be low; measure again with `fastml profile` when it is idle")
    start = time.perf_counter()
    progress = _Progress(say, 1 + 2 * sum(counts) + missing_host)
    base = _measure_cpu_base()
    progress.step()
    with _torch_threads(threads):
        new = {table: {_shape_key(s, threads, all_threads): seconds
                       for s, seconds in _fastest_of_two(time_one, missing[table], progress).items()}
               for table, (_, time_one) in tables.items()}
        host = {str(threads): _cpu_host_overhead(progress)} if missing_host else {}
    measured = _best(cached, base, new) if cached else dataclasses.replace(base, **new)
    measured = dataclasses.replace(measured, host_overhead={**measured.host_overhead, **host})
    measured = dataclasses.replace(measured, peak_fp32_flops_per_s=_peak(measured))
    hwprofiles.save_cpu(measured)
    say(f"measured in {time.perf_counter() - start:.1f} s")
    return measured


class _Progress:
    """A line every LOG_EVERY_S once the measurement has run SHOW_AFTER_S (a long sequence's attention can take a
    while): how many of its timings are done."""

    SHOW_AFTER_S = 1.0
    LOG_EVERY_S = 5.0

    def __init__(self, say, total: int):
        self.say, self.total, self.done = say, total, 0
        self.started_s, self.said_s = time.perf_counter(), None

    def step(self) -> None:
        self.done += 1
        elapsed_s = time.perf_counter() - self.started_s
        if elapsed_s >= self.SHOW_AFTER_S and self.done < self.total and (
                self.said_s is None or elapsed_s - self.said_s >= self.LOG_EVERY_S):
            self.say(f"measuring this CPU: {self.done} of {self.total} timings done ({elapsed_s:.0f} s)")
            self.said_s = elapsed_s


def _best(cached: hwprofiles.CpuMeasurements, base: hwprofiles.CpuMeasurements,
          new: dict[str, dict[str, float]]) -> hwprofiles.CpuMeasurements:
    """The cached measurements with new ones (tables of seconds by field name) merged in, each figure the best of
    both."""
    def fastest(old: dict[str, float], new: dict[str, float]) -> dict[str, float]:
        return {**old, **{key: min(seconds, old.get(key, seconds)) for key, seconds in new.items()}}
    return dataclasses.replace(
        cached, date=base.date, peak_fp32_flops_per_s=max(cached.peak_fp32_flops_per_s, base.peak_fp32_flops_per_s),
        memory_bytes_per_s=max(cached.memory_bytes_per_s, base.memory_bytes_per_s),
        **{name: fastest(getattr(cached, name), table) for name, table in new.items()})


def _peak(measured: hwprofiles.CpuMeasurements) -> float:
    """This CPU's fp32 peak: the best rate of any fp32 GEMM or attention measured on it, square or at a layer's shape;
    one measured on a share of the threads counts as many times as such shares fit in all of them (what as many
    processes run at once). So no measured efficiency exceeds 1, and no predicted MFU 100%."""
    all_threads = int(measured.key["torch_threads"])
    rates = [measured.peak_fp32_flops_per_s]
    for table, flops in ((measured.linear_seconds, _linear_flops), (measured.attention_seconds, _attention_pass_flops)):
        for key, seconds in table.items():
            shape, threads = _parse_key(key, all_threads)
            rates.append(flops(*shape) / seconds * (all_threads // threads))
    return max(rates)


@contextlib.contextmanager
def _torch_threads(threads: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fastest_of_two(seconds, shapes, progress: _Progress) -> dict[tuple, float]:
    """Two passes, each shape's fastest kept: a burst of other work must hit a shape in both to skew it."""
    passes = []
    for _ in range(2):
        timings = {}
        for shape in shapes:
            timings[shape] = seconds(*shape)
            progress.step()
        passes.append(timings)
    return {shape: min(p[shape] for p in passes) for shape in shapes}


def _cpu_host_overhead(progress: _Progress) -> dict[str, float]:
    """The training loop's host time on this CPU (hwprofiles/host.py), with the threads in effect."""
    from fastml.hwprofiles.host import measure_host_overhead

    measured = measure_host_overhead("cpu")
    progress.step()
    return measured


def _measure_cpu_base() -> hwprofiles.CpuMeasurements:
    """The best fp32 matmul rate of large square GEMMs and a large tensor copy's bandwidth, with all threads."""
    import torch

    rates = []
    for size in PEAK_SQUARE_SIZES:
        a, b = torch.randn(size, size), torch.randn(size, size)
        rates.append(2 * size**3 / _seconds(lambda: torch.matmul(a, b)))
    source, target = torch.randn(COPY_ELEMENTS), torch.empty(COPY_ELEMENTS)
    copy_s = _seconds(lambda: target.copy_(source))
    return hwprofiles.CpuMeasurements(key=hwprofiles.cpu_key(), date=datetime.date.today().isoformat(),
                                      peak_fp32_flops_per_s=max(rates),
                                      memory_bytes_per_s=2 * COPY_ELEMENTS * 4 / copy_s)


def _linear_seconds(tokens: int, out: int, inp: int) -> float:
    """A linear layer's forward (x·Wᵀ) and backward (dx = dy·W, dW = dyᵀ·x) GEMMs, in fp32."""
    import torch

    x, w, dy = torch.randn(tokens, inp), torch.randn(out, inp), torch.randn(tokens, out)
    return _seconds(lambda: (torch.matmul(x, w.t()), torch.matmul(dy, w), torch.matmul(dy.t(), x)))


def _attention_seconds(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """Causal attention's forward and backward as the executor runs it (executor/model/transformer.py), in fp32."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(batch, heads, seq_len, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, requires_grad=True) for _ in range(2))
    grad = torch.randn(batch, heads, seq_len, head_dim)

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads).backward(grad)
    return _seconds(run)


def _elementwise_seconds(tokens: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> float:
    """A block's work outside its matmuls and attention, forward and backward, by the executor's own modules in fp32,
    eager as a CPU trains (executor/model/transformer.py `Block`): its two norms, the rotary embedding of q and k, the
    heads' merge, SwiGLU and the two residual adds. Each matmul's and attention's output is a leaf here, so that only
    this work is timed; their gradients are returned, not summed into the leaves."""
    import torch

    from fastml.executor.model.transformer import RMSNorm, SwiGLU, apply_rotary

    norms, swiglu = (RMSNorm(hidden, 1e-5), RMSNorm(hidden, 1e-5)), SwiGLU()

    def leaf(*shape):
        return torch.randn(1, *shape, requires_grad=True)
    x, attn_out, ffn_out = leaf(tokens, hidden), leaf(tokens, hidden), leaf(tokens, hidden)  # `out`'s and `down`'s
    q, k = leaf(tokens, heads, head_dim), leaf(tokens, kv_heads, head_dim)  # qkv's output, split
    heads_out, gate_up = leaf(heads, tokens, head_dim), leaf(tokens, 2 * ffn)  # attention's output (B, H, T, D)
    cos, sin = torch.randn(tokens, head_dim), torch.randn(tokens, head_dim)
    inputs = [x, attn_out, ffn_out, q, k, heads_out, gate_up, *norms[0].parameters(), *norms[1].parameters()]
    output_shapes = [(1, tokens, hidden), q.shape, k.shape, (1, tokens, heads * head_dim), (1, tokens, hidden),
                     (1, tokens, ffn), (1, tokens, hidden)]
    grads = [torch.randn(shape) for shape in output_shapes]

    def run():
        middle = x + attn_out  # the residual after attention
        outputs = [norms[0](x), apply_rotary(q, cos, sin), apply_rotary(k, cos, sin),
                   heads_out.transpose(1, 2).flatten(2), norms[1](middle), swiglu(gate_up), middle + ffn_out]
        torch.autograd.grad(outputs, inputs, grads)
    return _seconds(run)


def _seconds(run, min_repeats: int = 3, max_repeats: int = 20, min_total_s: float = 0.05) -> float:
    """The fastest of several timed runs after a warm-up: other processes sharing the CPU only ever add time, so
    the fastest run is the machine's own rate (a run under load is slower than the plan predicts, not faster)."""
    run()
    times = []
    while len(times) < min_repeats or (sum(times) < min_total_s and len(times) < max_repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _shape_key(shape: tuple[int, ...], threads: int, all_threads: int) -> str:
    """"tokens,out,in" (or attention's shape), "@threads" after it where measured on a share of the threads."""
    return ",".join(map(str, shape)) + (f"@{threads}" if threads < all_threads else "")


def _parse_key(key: str, all_threads: int) -> tuple[tuple[int, ...], int]:
    shape, _, threads = key.partition("@")
    return tuple(int(n) for n in shape.split(",")), int(threads or all_threads)


def _linear_flops(tokens: int, out: int, inp: int) -> float:
    """A linear layer's forward and backward GEMMs: three of 2·t·n·k."""
    return 6.0 * tokens * out * inp


def _attention_pass_flops(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int) -> float:
    return ATTENTION_FLOPS_FACTOR * _attention_flops(batch, seq_len, heads * head_dim)


def cpu_profile_json(measured: hwprofiles.CpuMeasurements, shapes: list[tuple[int, int, int]],
                     attention: list[tuple[int, ...]] = (), elementwise: list[tuple[int, ...]] = (),
                     topology: dict | None = None, processes: int = 1) -> dict:
    """The hwprofile of this machine's CPU (schema of hwprofiles/schema.py): its peak, the efficiency of the model's
    linear layers at their shapes and of its attention (the curve, at the size planner/costs.py gives attention) as
    each of `processes` processes trains them (with its share of the threads, on its share of the peak), its memory
    bandwidth and memory."""
    peak, bandwidth = measured.peak_fp32_flops_per_s, measured.memory_bytes_per_s
    memory_bytes = hwprofiles.host_memory_bytes()
    key = measured.key
    threads = max(1, int(key["torch_threads"]) // processes)
    as_processes = (f"; the shapes as each of {processes} processes runs them, with {threads} of the threads, against "
                    f"its 1/{processes} of the peak" if processes > 1 else "")
    data = copy.deepcopy(hwprofiles.load("cpu"))
    data.update(
        name="detected-cpu",
        source=(f"measured on this machine ({key['cpu']}, {key['num_cpus']} CPUs, torch {key['torch']} with "
                f"{key['torch_threads']} threads) on {measured.date} by `fastml plan`, the best of every measurement: "
                f"peak_flops.fp32 is the best fp32 rate of the square GEMMs "
                f"{' and '.join(map(str, PEAK_SQUARE_SIZES))} and of every shape measured; gemm_shapes the forward "
                f"and backward GEMMs of the model's linear layers; gemm_efficiency its causal attention (forward and "
                f"backward), at g = (batch·seq·heads·seq·head_dim)^(1/3) as planner/costs.py models it"
                f"{as_processes}; elementwise_bytes_per_s the blocks' norms, rotary embedding, SwiGLU and residual "
                f"adds as the executor runs them (eager), bytes as planner/costs.py counts them; hbm_bytes_per_s "
                f"(and the host rates) a {COPY_ELEMENTS * 4 // 2**20} MiB tensor copy; cpu_adam_params_per_s that "
                f"rate over {ADAM_BYTES_PER_PARAM} bytes per parameter; memory the "
                f"physical memory (os.sysconf). Not priced."),
        gpu={"memory_bytes": memory_bytes, "peak_flops": {"fp32": peak},
             "gemm_efficiency": _attention_curve(measured, attention, processes),
             "gemm_shapes": _efficiencies(measured, shapes, processes), "hbm_bytes_per_s": bandwidth,
             "elementwise_bytes_per_s": _elementwise_rate(measured, elementwise, processes)},
        node={"gpus_per_node": 1, "host_memory_bytes": memory_bytes, "h2d_all_gpus_bytes_per_s": bandwidth,
              "cpu_adam_params_per_s": bandwidth / ADAM_BYTES_PER_PARAM, "host_copy_bytes_per_s": bandwidth,
              "nic_bytes_per_s": 0.0},
        measured={"key": key, "date": measured.date, "processes": processes})
    data["host_overhead"] = measured.host_overhead.get(str(threads))
    if topology is not None:
        data["detected"] = {**topology, "base_profile": "cpu", "base_match": "no CUDA GPU"}
    return data


def _efficiency(measured: hwprofiles.CpuMeasurements, table: dict[str, float], shape: tuple[int, ...],
                flops: float, processes: int) -> float:
    """Achieved over available of one of `processes` processes running `shape` with its share of the threads: its
    rate (slowed in proportion where the processes outnumber the cores they would each take) over its share of the
    peak (planner/hardware.py gives each process 1/processes of it)."""
    all_threads = int(measured.key["torch_threads"])
    threads = max(1, all_threads // processes)
    rate = flops / table[_shape_key(shape, threads, all_threads)] * min(1.0, all_threads / (processes * threads))
    return round(min(1.0, rate / (measured.peak_fp32_flops_per_s / processes)), 4)


def _elementwise_rate(measured: hwprofiles.CpuMeasurements, elementwise, processes: int = 1) -> float | None:
    """The blocks' elementwise work at `elementwise`'s shapes, bytes as planner/costs.py prices them (fp32, forward
    once and backward twice) over the seconds measured, as the whole CPU runs it (`processes` processes, each with
    its share of the threads: the planner gives each 1/processes of it); None where none is measured."""
    from fastml.spec import ModelSpec

    all_threads = int(measured.key["torch_threads"])
    threads = max(1, all_threads // processes)
    moved = seconds = 0.0
    for tokens, hidden, heads, kv_heads, head_dim, ffn in elementwise:
        spec = ModelSpec(name="elementwise", hidden_size=hidden, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                         ffn_hidden_size=ffn, vocab_size=1, head_dim=head_dim)
        moved += ELEMENTWISE_PASSES * spec.elementwise_elements_per_token(compiled=False) * tokens * 4
        seconds += measured.elementwise_seconds[_shape_key((tokens, hidden, heads, kv_heads, head_dim, ffn), threads,
                                                           all_threads)]
    return moved / seconds * processes * min(1.0, all_threads / (processes * threads)) if seconds else None


def _efficiencies(measured: hwprofiles.CpuMeasurements, shapes, processes: int = 1) -> list[list[float]]:
    """(tokens, out, in, achieved / peak) per measured shape: its forward and backward, 6·t·n·k FLOPs."""
    return [[t, n, k, _efficiency(measured, measured.linear_seconds, (t, n, k), _linear_flops(t, n, k), processes)]
            for t, n, k in shapes]


def _attention_curve(measured: hwprofiles.CpuMeasurements, attention, processes: int = 1) -> list[list[float]]:
    """(g, achieved / peak) of attention per measured shape, g and FLOPs as planner/costs.py counts them."""
    points = {}
    for shape in attention:
        b, s, heads, _, d = shape
        points[round((b * s * heads * s * d) ** (1 / 3), 1)] = _efficiency(
            measured, measured.attention_seconds, shape, _attention_pass_flops(*shape), processes)
    return [[g, e] for g, e in sorted(points.items())]


def this_cpu_profile(spec=None, seq_len: int = 256, micro_batches: Iterable[int] = (1, 2, 4, 8, 16), say=None,
                     topology: dict | None = None, fresh: bool = False, processes: int = 1) -> dict:
    """This machine's CPU profile for planning `spec` (default: tiny) at `seq_len` and these micro-batches, as
    `processes` processes train it, measuring what the cache lacks (everything, if `fresh`)."""
    from fastml.spec import PRESETS

    spec = spec or PRESETS["tiny"]
    tokens = [b * seq_len for b in micro_batches]
    shapes, elementwise = linear_shapes(spec, tokens), elementwise_shapes(spec, tokens)
    attention = attention_shapes(spec, seq_len, micro_batches)
    measured = measure_cpu(shapes, attention, elementwise, say, fresh, process_threads(processes))
    return cpu_profile_json(measured, shapes, attention, elementwise, topology, processes)
