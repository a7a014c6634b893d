"""Hardware profiles shipped with fastml: one JSON file per machine kind, each citing its `source`; and the profile
of this machine's CPU, measured by the first `fastml plan` on it and cached (read here, never measured here)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from fastml.config import UserError, fail, from_dict, read_json

_HERE = Path(__file__).parent
CPU_MEASUREMENT_VERSION = 3
"""Bump when what is measured or how changes, so cached CPU measurements are taken again (2: the peak is the best
rate of every GEMM measured, and shapes are measured with a process's share of the threads too; 3: the blocks'
elementwise work is measured)."""


def names() -> list[str]:
    return sorted(p.stem for p in _HERE.glob("*.json"))


@cache
def load(name: str) -> dict:
    path = _HERE / f"{name}.json"
    if not path.is_file():
        fail("hardware.profile", f"{name!r} is not a shipped profile; choose one of {', '.join(names())}")
    data = json.loads(path.read_text())
    from fastml.hwprofiles.schema import parse_profile

    if name != "cpu":  # cpu.json is the template a measurement of this CPU fills in (hwprofiles/profile.py)
        parse_profile(data, f"hwprofiles/{name}.json")  # validated once, as every profile is: readers trust it
    return data


def fingerprint(name: str) -> str:
    """A short hash of the profile's contents: plans record it to notice a profile that changed under them."""
    return fingerprint_of(load(name))


def fingerprint_of(profile: dict) -> str:
    return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()[:16]


def for_device_name(device_name: str) -> str | None:
    """The profile whose `device_names` lists this GPU name (as torch or nvidia-smi report it), if any."""
    for name in names():
        if device_name in load(name)["device_names"]:
            return name
    return None


def peak_flops(name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of the profile for a matmul dtype; None where the profile has none. For
    "cpu", this machine's CPU: the whole CPU's best measured fp32 matmul rate, if a plan has measured it
    (`whole_cpu`)."""
    if name == "cpu":
        measured = whole_cpu()
        return measured.peak_fp32_flops_per_s if measured and dtype == "fp32" else None
    return load(name)["gpu"]["peak_flops"].get(dtype)


# ------------------------------------------------------------------------------------------- this machine's CPU


@dataclass(frozen=True, kw_only=True)
class CpuMeasurements:
    """What `fastml plan` measured of this machine's CPU (hwprofiles/profile.py), cached as JSON."""

    key: dict[str, str]
    """What would change the numbers: CPU model, CPU count, torch's threads and version."""
    date: str
    peak_fp32_flops_per_s: float
    """The CPU's peak for MFU and GEMM efficiency: the best fp32 rate ever measured here, of large square GEMMs or of
    any shape below (hwprofiles/profile.py `_peak`), so that no measured rate exceeds it."""
    memory_bytes_per_s: float
    """A large tensor copy: bytes read plus bytes written per second."""
    linear_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """A linear layer's forward and backward GEMMs (x·Wᵀ, then dx and dW) by "tokens,out,in" ("tokens,out,in@T" with
    T of the threads, as each of several CPU processes runs them): the fastest seconds measured, for the shapes of
    the models planned on this machine so far."""
    attention_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Causal scaled-dot-product attention's forward and backward by "batch,seq,heads,kv_heads,head_dim" (and "@T"):
    the fastest seconds measured, for the models planned here so far."""
    elementwise_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """A block's work outside its matmuls and attention, forward and backward, as the executor runs it, by
    "tokens,hidden,heads,kv_heads,head_dim,ffn" (and "@T"): the fastest seconds measured, for the models planned
    here."""
    host_overhead: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """The training loop's host time (hwprofiles/host.py, the profile's `host_overhead`) by torch threads ("2"): on a
    CPU it adds to the arithmetic, per op."""


def cache_dir() -> Path:
    """$FASTML_CACHE, else $XDG_CACHE_HOME/fastml, else ~/.cache/fastml: the CPU profile and the default corpus."""
    if os.environ.get("FASTML_CACHE"):
        return Path(os.environ["FASTML_CACHE"]).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg_cache).expanduser() if xdg_cache else Path.home() / ".cache") / "fastml"


def cpu_key() -> dict[str, str]:
    """What this CPU's measurements, taken now, depend on (torch's threads included)."""
    import torch

    return {"cpu": cpu_model(), "num_cpus": str(os.cpu_count()),
            "torch_threads": str(torch.get_num_threads()), "torch": torch.__version__,
            "version": str(CPU_MEASUREMENT_VERSION)}


def cpu_cache_path(key: dict[str, str] | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key or cpu_key(), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu-profile-{digest}.json"


def this_cpu() -> CpuMeasurements | None:
    """This machine's cached CPU measurements with as many torch threads as now, or None where no plan has measured
    them yet; never measures."""
    path = cpu_cache_path(cpu_key())
    if not path.is_file():
        return None
    try:
        return from_dict(CpuMeasurements, read_json(path, "a CPU profile"), str(path))
    except UserError as e:
        raise UserError(f"{e}; delete the file to measure this CPU again") from None


def whole_cpu() -> CpuMeasurements | None:
    """This CPU's cached measurements taken with the most torch threads: the whole CPU's, which MFU is measured
    against whatever threads this process has (torchrun starts each rank with OMP_NUM_THREADS=1, another
    `cpu_key`); None where no plan has measured this CPU."""
    here = cpu_key() | {"torch_threads": ""}
    found = []
    for path in cache_dir().glob("cpu-profile-*.json"):
        try:
            measured = from_dict(CpuMeasurements, read_json(path, "a CPU profile"), str(path))
        except UserError:
            continue  # another version's or damaged: `this_cpu` says so where it is the one asked for
        if measured.key | {"torch_threads": ""} == here:
            found.append(measured)
    return max(found, key=lambda measured: int(measured.key["torch_threads"]), default=None)


def save_cpu(measurements: CpuMeasurements) -> Path:
    path = cpu_cache_path(measurements.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")  # another process may plan at the same time
    temporary.write_text(json.dumps(dataclasses.asdict(measurements), indent=1) + "\n")
    temporary.replace(path)
    return path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_profile_path(device_name: str, count: int) -> Path:
    """Where `fastml profile` keeps this machine's measured profile, by its GPUs' kind and number."""
    tag = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return cache_dir() / f"machine-{tag}-x{count}.json"


def save_machine_profile(data: dict) -> Path:
    gpus = data["detected"]["gpus"]
    path = machine_profile_path(gpus[0]["name"], len(gpus))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def machine_profile(device_name: str, count: int) -> dict | None:
    """This machine's measured profile (`fastml profile`), or None where it has not been measured."""
    path = machine_profile_path(device_name, count)
    return read_json(path, "a hardware profile") if path.is_file() else None


def host_memory_bytes() -> int:
    """This machine's physical memory (on some VMs memory is added as it is used, so this can read low)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_gpus() -> tuple[str, int] | None:
    """This machine's CUDA GPUs as torch sees them: the first one's name and how many there are; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0), torch.cuda.device_count()
