"""The training loop: builds the model the plan describes, trains it, and reports measured against predicted."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fastml import hwprofiles
from fastml.config import check_range, fail
from fastml.plan import Plan
from fastml.executor import faults
from fastml.executor import snapshot
from fastml.executor.apply import apply_plan
from fastml.executor.data import TokenData
from fastml.executor.model import Transformer, build_model, materialize
from fastml.executor.optim import MasterWeightAdamW, lr_at


class TrainingStopped(Exception):
    """The run stopped before its last step, on purpose: the message says why and how to go on."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def train(plan: Plan, steps: int | None = None, log_json: str | Path | None = None, show_progress: bool = True,
          console: Console | None = None, resume: bool = False, keep_checkpoints: int = 3,
          max_nonfinite_steps: int = 5, strict: bool = False, start_over: bool = False) -> dict:
    """Runs `plan` for `steps` optimizer steps in all (default: the plan's) and returns the summary of the run.

    With `resume`, continues from the newest intact checkpoint in the plan's checkpoint_dir; without it, a directory
    holding checkpoints is refused unless `start_over` moves them aside (snapshot.open_run). SIGINT and SIGTERM
    finish the step, write a checkpoint and raise TrainingStopped; so do `max_nonfinite_steps` skipped steps in a
    row (without the checkpoint). `strict` refuses a plan made for other hardware instead of warning."""
    if steps is not None:
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, steps=steps))
    check_range("--keep-checkpoints", keep_checkpoints, 1)
    check_range("--max-nonfinite-steps", max_nonfinite_steps, 1)
    console = console or Console(stderr=True)
    device = _device(plan)
    _check_hardware(plan, device, strict, console)
    run = snapshot.open_run(plan, resume=resume, start_over=start_over, keep=keep_checkpoints,
                            say=lambda message: console.print(message, markup=False))
    torch.manual_seed(plan.training.seed)
    model = build_training_model(plan, device)
    data = TokenData.open(plan.training.data, plan.training.seq_len, plan.model.vocab_size)
    optimizer = MasterWeightAdamW(model, plan.training)
    checkpoint, position = run.restore(model, optimizer)
    if position.step >= plan.training.steps:
        console.print(f"already at step {position.step} of {plan.training.steps}: nothing to train")
        return {"steps": 0}
    micro = plan.knobs.micro_batch_size
    batches = data.batches(micro, plan.training.seed, start=position.sequences // micro)
    meter = _Meter(plan, device)
    with _log_file(log_json, position.step if resume else None) as log, _progress(console, show_progress) \
            as progress, _StopSignals() as stop:
        task = progress.add_task("training", total=plan.training.steps, completed=position.step, status="")
        bad_in_a_row = 0
        for step in range(position.step, plan.training.steps):
            record = meter.measure(train_step(model, optimizer, batches, plan, step, device))
            position = snapshot.Position(step + 1, position.sequences + micro * plan.knobs.grad_accum_steps)
            bad_in_a_row = bad_in_a_row + 1 if record["skipped"] else 0
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            progress.update(task, advance=1, status=_status(record))
            if bad_in_a_row >= max_nonfinite_steps:
                raise TrainingStopped(
                    f"step {step + 1}: loss or gradient norm not finite {bad_in_a_row} steps in a row; stopped. "
                    f"Last good checkpoint: {checkpoint or 'none'}", exit_code=3)
            if _checkpoint_due(plan, step + 1) or stop.signal:
                checkpoint = run.save(model, optimizer, position)
            if stop.signal:
                raise TrainingStopped(_stopped_message(plan, step + 1, stop.signal, checkpoint), 128 + stop.signal)
    summary = meter.summary()
    print_summary(console, plan, summary)
    return summary


def _checkpoint_due(plan: Plan, steps_done: int) -> bool:
    t = plan.training
    if not t.checkpoint_dir:
        return False
    return steps_done == t.steps or (t.checkpoint_interval > 0 and steps_done % t.checkpoint_interval == 0)


def _stopped_message(plan: Plan, step: int, signum: int, path: Path | None) -> str:
    name = signal.Signals(signum).name
    if path is None:
        return (f"stopped by {name} after step {step}; no checkpoint directory was set (--checkpoint-dir), so "
                f"nothing was saved")
    return (f"stopped by {name} after step {step}; checkpoint {path}. Resume with the same command and --resume "
            f"(with --checkpoint-dir {plan.training.checkpoint_dir} if it was given on the command line)")


class _StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the step it is in; a second one stops at once."""

    def __enter__(self):
        self.signal = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _check_hardware(plan: Plan, device: torch.device, strict: bool, console: Console) -> None:
    """A plan's predictions hold for the hardware it was made for: say so when this is other hardware."""
    here = "cpu" if device.type == "cpu" else hwprofiles.for_device_name(torch.cuda.get_device_name(device))
    planned = plan.hardware.profile.removeprefix("detected-")
    if here == planned and (not plan.hardware.fingerprint or planned != plan.hardware.profile
                            or plan.hardware.fingerprint == hwprofiles.fingerprint(here)):
        return
    message = (f"the plan was made for {plan.hardware.profile or 'an unknown GPU'} "
               f"(fingerprint {plan.hardware.fingerprint or '-'}) but runs on {here or 'an unknown GPU'}"
               f"{'' if here != planned else ' whose profile has changed since'}: its predictions do not apply")
    if strict:
        fail("hardware.profile", message)
    console.print(f"[yellow]warning:[/] {message} (--strict refuses such a plan)")


def build_training_model(plan: Plan, device: torch.device) -> Transformer:
    """Meta model, plan applied, then materialized: bf16 on GPU, fp32 on CPU."""
    model = apply_plan(build_model(plan.model), plan.knobs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return materialize(model, device, dtype, seed=plan.training.seed)


def train_step(model: Transformer, optimizer: MasterWeightAdamW, batches, plan: Plan, step: int,
               device: torch.device) -> dict:
    """One optimizer step over grad_accum_steps micro-batches; returns its loss, lr and gradient norm. A step whose
    loss or gradient norm is not finite leaves the weights and optimizer state as they were ("skipped")."""
    knobs = plan.knobs
    loss_sum = torch.zeros((), device=device)
    for micro in range(knobs.grad_accum_steps):
        inputs, targets = next(batches)
        loss = model.loss(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True),
                          knobs.lm_head_chunks)
        if faults.due("nan-loss", step + 1):
            loss = loss * float("nan")
        (loss / knobs.grad_accum_steps).backward()
        loss_sum += loss.detach()
        if micro == 0:
            faults.kill_if_due("kill-mid-step", step + 1)
    clip = plan.training.grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")).item()
    loss_value = loss_sum.item() / knobs.grad_accum_steps
    skipped = not (math.isfinite(loss_value) and math.isfinite(grad_norm))
    lr = lr_at(step, plan.training)
    if not skipped:
        optimizer.step(lr)
    optimizer.zero_grad()
    # JSON has no NaN or infinity: a non-finite figure is logged as null.
    return {"step": step + 1, "loss": loss_value if math.isfinite(loss_value) else None, "lr": lr,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None, "skipped": skipped}


class _Meter:
    """Times each step and turns it into throughput, MFU and memory figures."""

    def __init__(self, plan: Plan, device: torch.device):
        self.plan = plan
        self.device = device
        self.peak_flops, self.peak_name = _peak_flops(device)
        self.flops_per_token = plan.model.flops_per_token(plan.training.seq_len)
        self.records: list[dict] = []
        self.start = self.last = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def measure(self, record: dict) -> dict:
        """Adds the time since the last step, and the figures that follow from it, to the step's record."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        step_time_s, self.last = now - self.last, now
        tokens_per_s = self.plan.training.global_batch_tokens / step_time_s
        record.update(
            step_time_s=step_time_s, tokens_per_s=tokens_per_s, mfu=self._mfu(tokens_per_s),
            peak_gpu_memory_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None)
        self.records.append(record)
        return record

    def summary(self) -> dict:
        # The first step carries compilation and allocator warm-up; steady-state figures leave it out.
        steady = self.records[1:] or self.records
        step_time_s = statistics.median(r["step_time_s"] for r in steady)
        tokens_per_s = self.plan.training.global_batch_tokens / step_time_s
        return {
            "steps": len(self.records), "total_time_s": time.perf_counter() - self.start,
            "first_loss": self.records[0]["loss"], "last_loss": self.records[-1]["loss"],
            "skipped_steps": sum(r["skipped"] for r in self.records),
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "mfu": self._mfu(tokens_per_s),
            "mfu_peak": self.peak_name, "peak_gpu_memory_bytes": self.records[-1]["peak_gpu_memory_bytes"],
        }

    def _mfu(self, tokens_per_s: float) -> float | None:
        return self.flops_per_token * tokens_per_s / self.peak_flops if self.peak_flops else None


def _peak_flops(device: torch.device) -> tuple[float | None, str]:
    """The dense peak the MFU is measured against, and its description: device, dtype, FLOP/s."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile, dtype = hwprofiles.for_device_name(name), "bf16"
    else:
        name, profile, dtype = "cpu", "cpu", "fp32"
    peak = hwprofiles.peak_flops(profile, dtype) if profile else None
    return peak, f"{name} {dtype} {peak / 1e12:g} TFLOP/s" if peak else f"{name}: no profile, MFU unknown"


def _device(plan: Plan) -> torch.device:
    if plan.hardware.device == "cuda":
        # Segments that grow in place leave less memory stranded between differently sized blocks (read by the
        # allocator at its first use, so set before anything is allocated).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if not torch.cuda.is_available():
            fail("hardware.device", "the plan is for a GPU but none is available here; plan again on this "
                                    "machine (`fastml plan`)")
    if plan.hardware.num_gpus > 1:
        fail("hardware.num_gpus", f"{plan.hardware.num_gpus}: this executor trains on one device only so far")
    return torch.device("cuda" if plan.hardware.device == "cuda" else "cpu")


def _status(record: dict) -> str:
    memory = record["peak_gpu_memory_bytes"]
    mfu = record["mfu"]
    return (f"loss {_loss(record['loss'])}  {record['tokens_per_s']:,.0f} tok/s  "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}  "
            f"mem {'n/a' if memory is None else f'{memory / 2**30:.1f} GiB'}")


def _logged_step(line: str) -> float:
    """The step of a log line; infinity for a line that is not a record (the torn last line of a killed run)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _loss(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4f}"


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, disable=not enabled)


def _log_file(path: str | Path | None, resumed_at: int | None):
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


def print_summary(console: Console, plan: Plan, summary: dict) -> None:
    table = Table(title=f"fastml run: {plan.model.name}, {summary['steps']} steps")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    predicted = plan.predicted
    memory = summary["peak_gpu_memory_bytes"]
    rows = [
        ("loss, first -> last step", f"{_loss(summary['first_loss'])} -> {_loss(summary['last_loss'])}", None),
        ("steps skipped (loss or gradient not finite)", str(summary["skipped_steps"]), None),
        ("step time", f"{summary['step_time_s']:.3f} s", predicted and f"{predicted.step_time_s:.3f} s"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}", predicted and f"{predicted.tokens_per_s:,.0f}"),
        ("MFU", "n/a" if summary["mfu"] is None else f"{summary['mfu']:.1%}", predicted and f"{predicted.mfu:.1%}"),
        ("peak GPU memory", "n/a" if memory is None else f"{memory / 2**30:.2f} GiB",
         predicted and f"{predicted.peak_memory_bytes / 2**30:.2f} GiB"),
    ]
    for name, measured, expected in rows:
        table.add_row(name, measured, expected or "-")
    console.print(table)
    console.print(f"MFU against {summary['mfu_peak']}; steady state = median of steps after the first; "
                  f"total {summary['total_time_s']:.1f} s")
