"""What a run shows: the knobs in effect, a progress line with each step's figures, and the closing table of measured
against predicted."""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from fastml.config import GIB, gib, plural
from fastml.plan import MEMORY_CATEGORIES, Plan, describe_knobs
from fastml.executor.loop.device import predicted_host_bytes


def print_knobs(console: Console, plan: Plan) -> None:
    h = plan.hardware
    if h.num_gpus > 1:
        units = "GPUs" if h.device == "cuda" else "CPU processes"
        nodes = f" on {h.num_gpus // h.gpus_per_node} nodes" if h.num_gpus > h.gpus_per_node else ""
        console.print(f"ranks: {h.num_gpus} {units}{nodes}, {collectives(plan)}; rank 0 reports, its own memory",
                      highlight=False)
    console.print(f"knobs: {describe_knobs(plan.knobs)}")


def collectives(plan: Plan) -> str:
    """What carries the plan's collectives: `comm = "nccl"` is torch.distributed's, which is NCCL between GPUs and
    gloo between CPU processes."""
    if plan.knobs.comm == "memcpy":
        return "memcpy collectives (through shared host memory)"
    return "NCCL collectives" if plan.hardware.device == "cuda" else "gloo collectives"


def blend_text(parts, shares: list[float]) -> str:
    """What a blend of datasets gives each (data.py's BlendedData)."""
    each = ", ".join(f"{part.path} {share:.1%}" for part, share in zip(parts, shares))
    return f"data: a blend, of each block of 1,024 sequences: {each}"


LOG_EVERY_S = 5.0
"""Where no live line can be drawn, the seconds between two plain progress lines (as `fastml plan`'s search)."""


@contextlib.contextmanager
def progress(console: Console, enabled: bool, total: int, done: int, clock=time.monotonic):
    """The run's progress from step `done` of `total`, as the callback `show(record)` to call after each step: a live
    line on a terminal; elsewhere (a pipe, a log file), where rich draws a live line only once it ends, a plain line
    every LOG_EVERY_S, as `fastml plan` shows its search there."""
    if not enabled:
        yield lambda record: None
    elif console.is_terminal and not console.is_dumb_terminal:
        with Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
                      TextColumn("ETA"), TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task("training", total=total, completed=done, status="")
            yield _LastValLoss(lambda record: bar.update(task, advance=1, status=status(record)))
    else:
        yield _LastValLoss(_StepLines(console, total, done, clock))


class _LastValLoss:
    """Passes each step's record on with the latest validation loss, which only some steps measure, in it."""

    def __init__(self, show):
        self.show, self.val_loss = show, None

    def __call__(self, record: dict) -> None:
        self.val_loss = record.get("val_loss", self.val_loss)
        self.show(record if self.val_loss is None else record | {"val_loss": self.val_loss})


class _StepLines:
    """`progress` where no live line can be drawn: a step's figures every LOG_EVERY_S, with the time so far."""

    def __init__(self, console: Console, total: int, done: int, clock):
        self.console, self.total, self.step, self.clock = console, total, done, clock
        self.started_s = self.shown_s = clock()

    def __call__(self, record: dict) -> None:
        self.step += 1
        now = self.clock()
        if now - self.shown_s >= LOG_EVERY_S:
            self.console.print(f"training: step {self.step}/{self.total}, {status(record)} "
                               f"({now - self.started_s:.0f} s)", highlight=False)
            self.shown_s = now


def status(record: dict) -> str:
    """One step's figures for the progress line; the memory is the figure the plan predicts as peak memory: the
    GPU's, or training on a CPU, the process's (the closing table's "peak host memory")."""
    memory = record["peak_gpu_memory_bytes"]
    validation = f"val {loss_text(record['val_loss'])}  " if "val_loss" in record else ""
    return (f"loss {loss_text(record['loss'])}  {validation}{record['tokens_per_s']:,.0f} tok/s  "
            f"MFU {_percent(record['mfu'])}  mem {gib(record['peak_host_memory_bytes'] if memory is None else memory)}")


def loss_text(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4f}"


def print_summary(console: Console, plan: Plan, summary: dict) -> None:
    table = Table(title=f"fastml run: {plan.model.name}, {plural(summary['steps'], 'step')}")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    p = plan.predicted
    rows = [
        ("loss, first -> last step", f"{loss_text(summary['first_loss'])} -> {loss_text(summary['last_loss'])}", None),
        *([("validation loss, last", loss_text(summary["val_loss"]), None),
           ("validation time (one evaluation)", f"{summary['val_time_s']:.3f} s", p and f"{p.eval_time_s:.3f} s")]
          if summary.get("val_time_s") is not None else []),
        ("steps skipped (loss or gradient not finite)", str(summary["skipped_steps"]), None),
        ("step time", f"{summary['step_time_s']:.3f} s", p and f"{p.step_time_s:.3f} s"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}", p and f"{p.tokens_per_s:,.0f}"),
        ("MFU", _percent(summary["mfu"]), p and _percent(p.mfu)),
    ]
    if plan.hardware.device == "cuda":
        rows.append(("peak GPU memory", gib(summary["peak_gpu_memory_bytes"], 2), p and gib(p.peak_memory_bytes, 2)))
    rows.append(("peak host memory (this process)", gib(summary["peak_host_memory_bytes"], 2),
                 p and gib(predicted_host_bytes(plan) / plan.hardware.gpus_per_node, 2)))
    if plan.hardware.gpus_per_node > 1 and summary.get("node_host_memory_bytes") is not None:
        # its ranks' proportional set sizes: what they share counted once
        rows.append(("host memory of the node, at the end", gib(summary["node_host_memory_bytes"], 2),
                     p and gib(predicted_host_bytes(plan), 2)))
    for name, measured, expected in rows:
        table.add_row(name, measured, expected or "-")
    console.print(table)
    if _measured_by_category(summary):
        console.print(memory_table(plan, summary))
    console.print(f"MFU against {summary['mfu_peak']}; steady state = median of steps after the first; "
                  f"total {summary['total_time_s']:.1f} s")


def memory_table(plan: Plan, summary: dict) -> Table:
    """Memory by the planner's categories, predicted beside measured (executor/loop/meter.py's `gpu_memory` and
    `host_memory` say what each measured figure is): GPU and host on a GPU; on a CPU, whose "GPU" is its host
    memory, host only. Of this process: with several ranks a node's predicted host memory is shared out among them."""
    p = plan.predicted
    on_gpu = plan.hardware.device == "cuda"
    table = Table(title="memory by category")
    table.add_column("")
    columns = [("GPU predicted", p and p.memory_bytes), ("GPU measured", summary["memory_bytes"])] if on_gpu else []
    ranks = plan.hardware.gpus_per_node  # the plan's host figures are a node's; the measured ones this process's
    host_predicted = p and ({name: p.host_memory_bytes[name] // ranks + (0 if on_gpu else p.memory_bytes[name])
                             for name in MEMORY_CATEGORIES})
    columns += [("host predicted", host_predicted), ("host measured", summary["host_memory_bytes"])]
    for title, _ in columns:
        table.add_column(title, justify="right")
    for name in MEMORY_CATEGORIES:
        table.add_row(name, *("-" if values is None else size_text(values[name]) for _, values in columns))
    return table


def _measured_by_category(summary: dict) -> bool:
    """Whether the run measured memory by category (the step calls the meter for it)."""
    measured = [summary.get("memory_bytes") or {}, summary.get("host_memory_bytes") or {}]
    return any(value is not None for values in measured for value in values.values())


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def size_text(num_bytes: int | None) -> str:
    """Bytes in GiB, or MiB below one GiB (a small model's figures), "n/a" where not measured."""
    if num_bytes is None:
        return "n/a"
    if num_bytes == 0:
        return "0"
    return gib(num_bytes, 2) if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"
