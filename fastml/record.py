"""A run record: what one `fastml run` measured, in the terms of the plan's `predicted`, with the plan and the machine
it ran on. The executor writes one into every run's directory (`record.json`); `fastml calibrate` reads them to fit
the machine's profile to what its runs measure (planner/calibrate.py). Part of the contract: planner and executor
both read it, neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fastml.config import fail, from_dict, read_json, to_dict
from fastml.plan import Plan

RECORD_VERSION = 1
RECORD_FILE = "record.json"
"""A run's record in its directory (`fastml run --run-dir`)."""
TRACE_FILE = "trace.json"
"""In a run's directory beside its record: a step as torch's profiler saw it (`fastml run --trace-step N`)."""


@dataclass(frozen=True, kw_only=True)
class RunMachine:
    """The machine a run measured: what `fastml calibrate` checks a record against."""

    device: str
    """"cuda" or "cpu"."""
    device_name: str
    """The GPU's name as CUDA reports it, or the CPU's model."""
    num_devices: int
    """GPUs (or CPU processes) that trained together."""
    host: str
    cpu_threads: int | None = None
    """torch's threads of each rank for its CPU work (a CPU job's steps, a GPU job's C++ AdamW): its share of the
    node's cores where several ranks share them. None in records of fastml before it was recorded."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """The steady state (the median step after the first) as `predicted` names it; None where not measured."""

    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    peak_memory_bytes: int | None
    """One GPU's (rank 0's) peak, as torch's allocator counts it; None on a CPU."""
    memory_bytes: dict[str, int | None] | None
    host_memory_bytes: dict[str, int | None] | None
    """One process's (rank 0's), by category; of memory the node's ranks share, its share."""
    node_host_memory_bytes: int | None = None
    """The node's ranks' proportional set sizes at the end of the run, summed (what they share counted once): the
    figure to set beside the plan's host total."""


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    version: int = RECORD_VERSION
    plan: Plan
    machine: RunMachine
    steps: int
    """Steps measured (the first is left out of the steady figures: it compiles and warms the allocator)."""
    date: str
    measured: Measured

    def __post_init__(self) -> None:
        if self.version != RECORD_VERSION:
            fail("version", f"run record version {self.version} is not supported (this fastml reads "
                            f"{RECORD_VERSION})")


def save_record(record: RunRecord, path: str | Path) -> None:
    import json

    Path(path).write_text(json.dumps(to_dict(record), indent=2) + "\n")


def load_record(path: str | Path) -> RunRecord:
    """The validated record in the file at `path`; a malformed one is a one-line UserError naming the field."""
    data = read_json(path, "a run record")
    if isinstance(data, dict) and "knobs" in data and "plan" not in data:
        fail(str(path), "is a plan, not a run record: give a run's directory (`fastml run --run-dir`) or the "
                        "record.json in it")
    return from_dict(RunRecord, data, str(path))
