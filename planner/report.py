"""Tables for people (rich) and JSON for programs: the chosen plan, its cost breakdown, the runners-up, and the
ranking of several machines."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fastml.plan import Plan, describe_knobs
from fastml.config import to_dict

GIB = 2**30


def print_plan(console: Console, plan: Plan, runners_up: list[Plan] = ()) -> None:
    h = plan.hardware
    console.print(f"[bold]{plan.model.name}[/] ({plan.model.num_params() / 1e9:.2f}B parameters), seq "
                  f"{plan.training.seq_len}, {plan.training.global_batch_tokens:,} tokens/step on {h.num_gpus} x "
                  f"{h.profile or h.device}")
    console.print(f"knobs: {describe_knobs(plan.knobs)}")
    if plan.predicted is None:
        console.print("no prediction: the CPU profile has no rates to simulate against")
        return
    print_breakdown(console, plan)
    if runners_up:
        table = Table(title="runners-up")
        for column in ("tokens/s", "step", "peak GPU mem", "knobs"):
            table.add_column(column, justify="left" if column == "knobs" else "right")
        for p in [plan, *runners_up]:
            table.add_row(f"{p.predicted.tokens_per_s:,.0f}", f"{p.predicted.step_time_s:.3f} s",
                          f"{p.predicted.peak_memory_bytes / GIB:.1f} GiB", describe_knobs(p.knobs))
        console.print(table)


def print_breakdown(console: Console, plan: Plan) -> None:
    p = plan.predicted
    dtype = plan.knobs.matmul_dtype
    console.print(f"predicted: {p.step_time_s:.3f} s/step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%} "
                  f"(model FLOPs over the dense {dtype} peak), ${p.usd_per_million_tokens:.3g} and "
                  f"{p.kwh_per_million_tokens:.3g} kWh (GPU power) per million tokens")
    time_table = Table(title="step time by component")
    time_table.add_column("component")
    time_table.add_column("seconds", justify="right")
    time_table.add_column("share", justify="right")
    for name, seconds in p.time_s.items():
        time_table.add_row(name, f"{seconds:.4f}", f"{seconds / p.step_time_s:.1%}")
    memory_table = Table(title="memory by category (GiB)")
    memory_table.add_column("category")
    memory_table.add_column("GPU (one)", justify="right")
    memory_table.add_column("host (node)", justify="right")
    for name in p.memory_bytes:
        memory_table.add_row(name, f"{p.memory_bytes[name] / GIB:.2f}", f"{p.host_memory_bytes[name] / GIB:.2f}")
    memory_table.add_row("total", f"{p.peak_memory_bytes / GIB:.2f}",
                         f"{sum(p.host_memory_bytes.values()) / GIB:.2f}")
    console.print(time_table)
    console.print(memory_table)


def print_ranking(console: Console, rows: list[tuple[str, Plan | None, str]]) -> None:
    """Machines side by side, cheapest per token first; rows are (hardware, plan or None, note)."""
    table = Table(title="hardware ranked by cost per million tokens")
    for column in ("hardware", "tokens/s", "MFU", "$/Mtok", "kWh/Mtok", "knobs"):
        table.add_column(column, justify="left" if column in ("hardware", "knobs") else "right")
    priced = sorted((r for r in rows if r[1] is not None and r[1].hardware.device != "cpu"),
                    key=lambda r: r[1].predicted.usd_per_million_tokens)
    for hw, plan, _ in priced:
        p = plan.predicted
        table.add_row(hw, f"{p.tokens_per_s:,.0f}", f"{p.mfu:.1%}", f"{p.usd_per_million_tokens:.3g}",
                      f"{p.kwh_per_million_tokens:.3g}", describe_knobs(plan.knobs))
    for hw, plan, note in (r for r in rows if r not in priced):
        if plan is None:
            table.add_row(hw, "-", "-", "-", "-", f"infeasible: {note}")
        else:  # a CPU's plans have no price or power in its measured profile
            table.add_row(hw, f"{plan.predicted.tokens_per_s:,.0f}", f"{plan.predicted.mfu:.1%}", "-", "-",
                          f"not priced (a CPU); {describe_knobs(plan.knobs)}")
    console.print(table)


def plan_json(plan: Plan, runners_up: list[Plan] = ()) -> dict:
    return {"plan": to_dict(plan), "runners_up": [to_dict(p) for p in runners_up]}
