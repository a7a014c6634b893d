"""The training loop: builds the model the plan describes, trains it, and reports measured against predicted."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fastml import hwprofiles
from fastml.config import fail
from fastml.plan import Plan
from fastml.executor.apply import apply_plan
from fastml.executor.data import TokenData
from fastml.executor.model import Transformer, build_model, materialize
from fastml.executor.optim import MasterWeightAdamW, lr_at


def train(plan: Plan, steps: int | None = None, log_json: str | Path | None = None, show_progress: bool = True,
          console: Console | None = None) -> dict:
    """Runs `plan` for `steps` optimizer steps (default: the plan's) and returns the summary of the run."""
    if steps is not None:
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, steps=steps))
    device = _device(plan)
    torch.manual_seed(plan.training.seed)
    model = build_training_model(plan, device)
    data = TokenData.open(plan.training.data, plan.training.seq_len, plan.model.vocab_size)
    optimizer = MasterWeightAdamW(model, plan.training)
    meter = _Meter(plan, device)
    console = console or Console(stderr=True)
    with _progress(console, show_progress) as progress, _log_file(log_json) as log:
        task = progress.add_task("training", total=plan.training.steps, status="")
        batches = data.batches(plan.knobs.micro_batch_size, plan.training.seed)
        for step in range(plan.training.steps):
            record = meter.measure(train_step(model, optimizer, batches, plan, step, device))
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            progress.update(task, advance=1, status=_status(record))
    summary = meter.summary()
    print_summary(console, plan, summary)
    return summary


def build_training_model(plan: Plan, device: torch.device) -> Transformer:
    """Meta model, plan applied, then materialized: bf16 on GPU, fp32 on CPU."""
    model = apply_plan(build_model(plan.model), plan.knobs)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return materialize(model, device, dtype, seed=plan.training.seed)


def train_step(model: Transformer, optimizer: MasterWeightAdamW, batches, plan: Plan, step: int,
               device: torch.device) -> dict:
    """One optimizer step over grad_accum_steps micro-batches; returns its loss, lr and gradient norm."""
    knobs = plan.knobs
    loss_sum = torch.zeros((), device=device)
    for _ in range(knobs.grad_accum_steps):
        inputs, targets = next(batches)
        loss = model.loss(inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True),
                          knobs.lm_head_chunks)
        (loss / knobs.grad_accum_steps).backward()
        loss_sum += loss.detach()
    clip = plan.training.grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    lr = lr_at(step, plan.training)
    optimizer.step(lr)
    optimizer.zero_grad()
    return {"step": step + 1, "loss": loss_sum.item() / knobs.grad_accum_steps, "lr": lr,
            "grad_norm": grad_norm.item()}


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
    return (f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}  "
            f"mem {'n/a' if memory is None else f'{memory / 2**30:.1f} GiB'}")


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, disable=not enabled)


def _log_file(path: str | Path | None):
    """The JSON-lines log of the run, or nothing; the loop flushes it after every record so a crash loses none."""
    return open(path, "w") if path else contextlib.nullcontext()


def print_summary(console: Console, plan: Plan, summary: dict) -> None:
    table = Table(title=f"fastml run: {plan.model.name}, {summary['steps']} steps")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    predicted = plan.predicted
    memory = summary["peak_gpu_memory_bytes"]
    rows = [
        ("loss, first -> last step", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}", None),
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
