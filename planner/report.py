"""Tables for people (rich) and JSON for programs: the chosen plan, its cost breakdown, the runners-up, and the
ranking of several machines."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from fastml.config import GIB, gib, to_dict
from fastml.plan import Plan, describe_init, describe_knobs
from fastml.planner.explain import knob_differences, percent, versus



def print_plan(console: Console, plan: Plan, runners_up: list[Plan] = (), limit: str | None = None) -> None:
    """The plan, its cost breakdown and runners-up, then what limits it (`explain.limit`) and why it beats the
    first runner-up."""
    h = plan.hardware
    console.print(f"[bold]{plan.model.name}[/] ({human_count(plan.model.num_params())} parameters), seq "
                  f"{plan.training.seq_len}, {plan.training.global_batch_tokens:,} tokens/step on {h.num_gpus} x "
                  f"{h.profile or h.device}")
    console.print(f"weights: {describe_init(plan.training)}", highlight=False)
    console.print(f"knobs: {describe_knobs(plan.knobs)}")
    if plan.predicted is None:  # a plan written by hand; `fastml explain` simulates it
        return
    print_breakdown(console, plan)
    if runners_up:
        print_runners_up(console, plan, runners_up)
    for line in explanation(plan, runners_up, limit).values():
        console.print(line, highlight=False)


def print_runners_up(console: Console, plan: Plan, runners_up: list[Plan]) -> None:
    """The next best plans, each by the knobs where it differs from the chosen one."""
    table = Table(title="runners-up")
    for column in ("tokens/s", "vs chosen", "step", "peak memory", "differs from the chosen plan in"):
        table.add_column(column, justify="left" if column.startswith("differs") else "right")
    for p in runners_up:
        behind = p.predicted.tokens_per_s / plan.predicted.tokens_per_s - 1
        table.add_row(f"{p.predicted.tokens_per_s:,.0f}", percent(behind), f"{p.predicted.step_time_s:.3f} s",
                      gib(p.predicted.peak_memory_bytes), knob_differences(plan.knobs, p.knobs))
    console.print(table)


def explanation(plan: Plan, runners_up: list[Plan] = (), limit: str | None = None) -> dict[str, str]:
    """At most two lines: what limits the plan ("limit") and why it beats the first runner-up ("why")."""
    lines = {"limit": limit} if limit else {}
    if plan.predicted is not None and runners_up:
        lines["why"] = versus(plan, runners_up[0])
    return lines


def print_breakdown(console: Console, plan: Plan) -> None:
    p = plan.predicted
    dtype = plan.knobs.matmul_dtype
    on_gpu = plan.hardware.device == "cuda"
    price = (f", {usd(p.usd_per_million_tokens)} and {significant(p.kwh_per_million_tokens)} kWh (GPU power) per "
             f"million tokens" if on_gpu else "")  # a CPU's measured profile has no price or power
    console.print(f"predicted: {p.step_time_s:.3f} s/step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%} "
                  f"(model FLOPs over the {'dense' if on_gpu else 'measured'} {dtype} peak){price}")
    time_table = Table(title="step time by component")
    time_table.add_column("component")
    time_table.add_column("seconds", justify="right")
    time_table.add_column("share", justify="right")
    for name, seconds in p.time_s.items():
        time_table.add_row(name, f"{seconds:.4f}", f"{seconds / p.step_time_s:.1%}")
    caption = ("GPU: the categories as the run measures them (every gradient made, a forward pass's activations, "
               "the rest of the peak); its total: the peak") if on_gpu else None
    memory_table = Table(title="memory by category (GiB)", caption=caption)
    memory_table.add_column("category")
    # On a CPU the "device" and the host are the same memory: training tensors, and the rest of the process.
    memory_table.add_column("GPU (one)" if on_gpu else "training (RAM)", justify="right")
    memory_table.add_column("host (node)" if on_gpu else "process (RAM)", justify="right")
    for name in p.memory_bytes:
        memory_table.add_row(name, f"{p.memory_bytes[name] / GIB:.2f}", f"{p.host_memory_bytes[name] / GIB:.2f}")
    memory_table.add_row("total", f"{p.peak_memory_bytes / GIB:.2f}",
                         f"{sum(p.host_memory_bytes.values()) / GIB:.2f}")
    console.print(time_table)
    console.print(memory_table)


def print_ranking(console: Console, rows: list[tuple[str, Plan | None, str]]) -> None:
    """Machines side by side, cheapest per token first; rows are (hardware, plan or None, note)."""
    table = Table(title="hardware ranked by cost per million tokens")
    for column in ("hardware", "GPUs", "tokens/s", "MFU", "$/Mtok", "kWh/Mtok", "knobs"):
        table.add_column(column, justify="left" if column in ("hardware", "knobs") else "right",
                         no_wrap=column != "knobs")
    priced = sorted((r for r in rows if r[1] is not None and r[1].hardware.device != "cpu"),
                    key=lambda r: r[1].predicted.usd_per_million_tokens)
    for hw, plan, _ in priced:
        p = plan.predicted
        table.add_row(hw, gpu_count(plan), f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", usd(p.usd_per_million_tokens),
                      significant(p.kwh_per_million_tokens), describe_knobs(plan.knobs))
    for hw, plan, note in (r for r in rows if r not in priced):
        if plan is None:
            table.add_row(hw, "-", "-", "-", "-", "-", f"infeasible: {note}")
        else:
            table.add_row(hw, gpu_count(plan), f"{plan.predicted.tokens_per_s:,.0f}", f"{plan.predicted.mfu:.1%}",
                          "-", "-", describe_knobs(plan.knobs))
    console.print(table)
    if any(plan is not None and plan.hardware.device == "cpu" for _, plan, _ in rows):
        console.print("A CPU's plans are not priced: its measured profile has no price or power; they rank last.")


def gpu_count(plan: Plan) -> str:
    """"8", or "16 x 8" over nodes; a CPU's processes as "2 (CPU)"."""
    h = plan.hardware
    if h.device == "cpu":
        return f"{h.num_gpus} (CPU)"
    nodes = h.num_gpus // h.gpus_per_node
    return f"{nodes} x {h.gpus_per_node}" if nodes > 1 else str(h.num_gpus)


def plan_json(plan: Plan, runners_up: list[Plan] = (), limit: str | None = None) -> dict:
    return {"plan": to_dict(plan), "runners_up": [to_dict(p) for p in runners_up],
            **explanation(plan, runners_up, limit)}


def human_count(n: int) -> str:
    """3.2M, 1.10B: three significant digits and a suffix."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{significant(n / scale)}{suffix}"
    return str(n)


def usd(amount: float) -> str:
    """Dollars to three significant digits, never fewer than cents: $0.0720, $1.23, $12.30, $1234.00."""
    return "$" + significant(amount, min_decimals=2)


def significant(x: float, digits: int = 3, min_decimals: int = 0) -> str:
    """`x` with `digits` significant digits in plain notation (never 1.2e+03)."""
    decimals = digits - 1 - math.floor(math.log10(abs(x))) if x else 0
    return f"{x:.{max(decimals, min_decimals)}f}"


def print_calibration(console: Console, fits, calibration: dict) -> None:
    """Each record's step time and peak GPU memory, measured against predicted before and after calibration, the
    mean absolute errors, and the fitted terms."""
    table = Table(title="calibration: predicted against measured")
    table.add_column("record", no_wrap=True, min_width=max(len(fit.name) for fit in fits))  # whole, to find the run
    for column in ("step measured", "before", "after", "peak measured", "before", "after"):
        table.add_column(column, justify="right")
    for fit in fits:
        before, after = fit.step_errors
        peak = fit.peak_errors
        table.add_row(fit.name, f"{fit.measured_step_s:.3f} s", f"{before:+.1%}", f"{after:+.1%}",
                      gib(fit.measured_peak_bytes or None, 2),
                      f"{peak[0]:+.1%}" if peak else "-", f"{peak[1]:+.1%}" if peak else "-")
    console.print(table)
    steps = [fit.step_errors for fit in fits]
    peaks = [fit.peak_errors for fit in fits if fit.peak_errors]
    console.print(f"mean absolute error of step time: {_mean_abs(e[0] for e in steps):.1%} before, "
                  f"{_mean_abs(e[1] for e in steps):.1%} after" + (
                      f"; of peak GPU memory: {_mean_abs(e[0] for e in peaks):.1%} before, "
                      f"{_mean_abs(e[1] for e in peaks):.1%} after" if peaks else ""), highlight=False)
    console.print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in calibration.items() if k != "records"),
                  highlight=False)


def _mean_abs(errors) -> float:
    errors = [abs(e) for e in errors]
    return sum(errors) / len(errors) if errors else math.nan
