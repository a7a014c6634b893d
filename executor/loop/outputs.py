"""What a run writes besides its checkpoints, and the checks that it can write it before any work: the per-step
JSON-lines log, the summary, the run's directory (its plan and record, what `fastml calibrate` reads) and the trace of
a profiled step."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
from pathlib import Path

import torch
from rich.console import Console

from fastml import hwprofiles
from fastml.config import check_output_dir, check_output_file
from fastml.plan import Plan, save_plan
from fastml.record import RECORD_FILE, TRACE_FILE, Measured, RunMachine, RunRecord, save_record

LOG_FILE = "log.jsonl"
"""In a run's directory: its per-step log, unless --log-json names another file."""


def prepare_outputs(plan: Plan, run_dir: Path | None, log_json, summary_json) -> None:
    """Checks that the run can write every file it will, before any work (a checkpoint directory naming a file once
    failed after the last step), and makes the run's directory."""
    if plan.training.checkpoint_dir:
        check_output_dir("--checkpoint-dir", plan.training.checkpoint_dir)
    files = [("--log-json", log_json), ("--summary-json", summary_json)]
    if run_dir is not None:
        check_output_dir("--run-dir", run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        files += [("--run-dir", run_dir / name)
                  for name in ("plan.json", RECORD_FILE, TRACE_FILE, *([] if log_json else [LOG_FILE]))]
    for flag, path in files:
        if path:
            check_output_file(flag, path)


def log_file(path: str | Path | None, resumed_at: int | None):
    """The JSON-lines log of the run, or nothing; the loop flushes it after every record so a crash loses none.
    A resumed run keeps the records up to its checkpoint's step and appends from there."""
    if not path:
        return contextlib.nullcontext()
    path = Path(path)
    if resumed_at is not None and path.is_file():
        kept = [line for line in path.read_text().splitlines() if _logged_step(line) <= resumed_at]
        path.write_text("".join(line + "\n" for line in kept))
        return open(path, "a")
    return open(path, "w")


def _logged_step(line: str) -> float:
    """The step of a log line; infinity for a line that is not a record (the torn last line of a killed run)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def log_record(record: dict, log) -> None:
    """One JSON line per step, flushed at once so that a crash loses none."""
    if log:
        log.write(json.dumps(record) + "\n")
        log.flush()


def write_summary(summary: dict, path: str | Path | None) -> None:
    if path:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")


def write_run(run_dir: Path, plan: Plan, summary: dict, device: torch.device, console: Console) -> None:
    """The run's plan and record (fastml.record) into its directory."""
    save_plan(plan, run_dir / "plan.json")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else hwprofiles.cpu_model()
    machine = RunMachine(device=device.type, device_name=name, num_devices=plan.hardware.num_gpus,
                         host=socket.gethostname(), cpu_threads=torch.get_num_threads())
    measured = Measured(step_time_s=summary["step_time_s"], tokens_per_s=summary["tokens_per_s"], mfu=summary["mfu"],
                        peak_memory_bytes=summary["peak_gpu_memory_bytes"], memory_bytes=summary["memory_bytes"],
                        host_memory_bytes=summary["host_memory_bytes"],
                        node_host_memory_bytes=summary.get("node_host_memory_bytes"))
    save_record(RunRecord(plan=plan, machine=machine, steps=summary["steps"], measured=measured,
                          date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
                run_dir / RECORD_FILE)
    console.print(f"run record: {run_dir / RECORD_FILE} (for `fastml calibrate`)", highlight=False)


@contextlib.contextmanager
def profiled(trace: Path | None, device: torch.device):
    """Runs the body under torch's profiler and writes what it saw to `trace` (Chrome's trace format); nothing where
    `trace` is None. The step it traces is slower by the profiler's own work, and is logged as it ran, marked
    "traced"."""
    if trace is None:
        yield
        return
    # Kineto, under the profiler, prints a "USDT:" line as it starts and stops, at the top of its log levels: only a
    # level above them all leaves them out (its own errors too; a level the user sets wins).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's kernels end inside the trace
    profiler.export_chrome_trace(str(trace))
