"""Why the planner chose a plan, in a line or two: what limits it (compute, memory, PCIe or the network) and what it
gains over the runner-up, read from the simulated time by component and the memory model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastml.config import GIB, gib
from fastml.plan import TIME_COMPONENTS, Knobs, Plan, describe_knobs
from fastml.planner.search import (LEAN_MARGIN, Candidate, Problem, evaluate, make_knobs, micro_batch_choices,
                                   num_knobs_set)
from fastml.planner.parallel import is_layout, layout_of_knobs, layout_step, simulate_any

LIMIT_SHARE = 0.02
"""A plan that loses less than this share of its step (waiting on PCIe or collectives, or to a faster setting that
does not fit in memory) is compute-bound."""
COMPONENT_WORDS = {"compute": "compute", "recompute": "recompute", "exposed_comm": "waiting on collectives",
                   "exposed_offload": "waiting on PCIe copies", "optimizer": "optimizer step", "other": "other"}


@dataclass(frozen=True)
class Blocked:
    """A change to the plan that would make its step faster but does not fit in memory."""

    change: str
    step_time_s: float
    candidate: Candidate


def limit(problem: Problem, candidate: Candidate) -> str:
    """What limits a feasible candidate: what its step loses most time to, unless that is under LIMIT_SHARE."""
    sim = candidate.simulation
    step = sim.step_time_s
    blocked = faster_but_too_big(problem, candidate)
    links = collective_links(problem.machine)
    losses = {"PCIe": sim.time_s["exposed_offload"], links: sim.time_s["exposed_comm"],
              "memory": step - blocked.step_time_s if blocked else 0.0}
    kind = max(losses, key=losses.get)
    share = losses[kind] / step
    device = "GPU" if problem.machine.device == "cuda" else "CPU"
    if share < LIMIT_SHARE:
        busy = (sim.time_s["compute"] + sim.time_s["recompute"]) / step
        return f"limited by compute: the {device} computes {busy:.0%} of the step"
    if kind == "memory":
        return (f"limited by memory: {blocked.change} would save {share:.1%} of the step but "
                f"{shortfall(problem, blocked.candidate)}")
    waited_for = "host-GPU copies (offload)" if kind == "PCIe" else "collectives"
    return f"limited by {kind}: the {device} waits {duration(losses[kind])} ({share:.0%}) of the step on {waited_for}"


def collective_links(machine) -> str:
    """What the collectives between a machine's GPUs (or CPU processes) cross: the network between nodes, or within a
    node NVLink, PCIe peer to peer, or PCIe through host memory (GPUs without P2P), or a CPU's own memory."""
    if machine.num_nodes > 1:
        return "the network"
    if machine.device == "cpu":
        return "the collectives between processes"
    if machine.gpu.p2p:
        return "NVLink" if machine.gpu.nvlink_bytes_per_s else "PCIe peer-to-peer copies"
    return "PCIe through host memory (no P2P between the GPUs)"


def faster_but_too_big(problem: Problem, candidate: Candidate) -> Blocked | None:
    """The faster of the two settings that memory most often rules out, the next larger micro-batch and no
    recompute, where it is faster than the candidate and does not fit; None where there is none."""
    knobs = candidate.knobs
    changes = {}
    larger = [m for m in micro_batch_choices(problem) if m > knobs.micro_batch_size]
    if larger:
        changes[f"micro-batch {larger[0]}"] = {"micro_batch_size": larger[0]}
    if knobs.recompute:
        changes["no recompute"] = {"recompute": ()}
    blocked = []
    for change, values in changes.items():
        other = evaluate(problem, make_knobs(problem, {**_values(knobs), **values}))
        if other.feasible:
            continue  # it fits, so the search weighed it and it was no faster
        step_time_s = simulate_any(problem.spec, problem.seq_len, other.knobs, problem.machine).step_time_s
        if step_time_s < candidate.simulation.step_time_s:
            blocked.append(Blocked(change, step_time_s, other))
    return min(blocked, key=lambda b: b.step_time_s, default=None)


def shortfall(problem: Problem, candidate: Candidate) -> str:
    """Which memory an infeasible candidate lacks, and how much."""
    if candidate.gpu_over_bytes > 0:
        return (f"needs {gib(candidate.memory.gpu_peak)} of GPU memory, {gib(candidate.gpu_over_bytes)} more than "
                f"the {gib(problem.gpu_budget())} usable")
    return (f"needs {gib(candidate.memory.host_total)} of host memory, {gib(candidate.host_over_bytes)} more than "
            f"the {gib(problem.host_budget())} usable")


def versus(chosen: Plan, runner_up: Plan) -> str:
    """Why `chosen` ranks above `runner_up` (both with predictions): its lead, the two time components that differ
    most, and how much more or less GPU memory it needs. The runners-up table names the knobs that differ."""
    c, r = chosen.predicted, runner_up.predicted
    lead = r.step_time_s / c.step_time_s - 1  # = the chosen plan's tokens/s over the runner-up's, minus 1
    if lead < -1e-9:  # the leaner of plans the prediction cannot tell apart (search.rank)
        return (f"chosen over the first runner-up (predicted {percent(-lead / (1 + lead))} faster) for needing "
                f"{_what_less(chosen, runner_up)}: plans within {percent(LEAN_MARGIN)} of the fastest count as "
                f"equally fast (predicted step times err by about 5%), and the one that needs the least is chosen")
    memory = _memory_difference(chosen, runner_up)
    if abs(lead) < 1e-9:  # the search ranks equal speeds by fewer knobs set, then by less GPU memory
        fewer = num_knobs_set(chosen.knobs) < num_knobs_set(runner_up.knobs)
        return f"as fast as the first runner-up{' with fewer knobs set' if fewer else ''}{memory}"
    deltas = sorted(((r.time_s[k] - c.time_s[k], k) for k in TIME_COMPONENTS), key=lambda d: -abs(d[0]))
    reasons = [f"{duration(abs(d))} {'less' if d > 0 else 'more'} {COMPONENT_WORDS[k]}" for d, k in deltas[:2]
               if abs(d) > 1e-9 * c.step_time_s]
    return f"beats the first runner-up by {percent(lead)}: {', '.join(reasons)}{memory}"


def _memory_difference(chosen: Plan, runner_up: Plan) -> str:
    """'; needs 3.1 GiB more GPU memory (mostly activations)': the peak difference, and the category that makes most
    of it where one does (the categories are as a run measures them, not all alive at the peak: planner/memory.py)."""
    c, r = chosen.predicted, runner_up.predicted
    more = c.peak_memory_bytes - r.peak_memory_bytes
    if abs(more) < 0.05 * GIB:
        return ""
    category = max(c.memory_bytes, key=lambda k: abs(c.memory_bytes[k] - r.memory_bytes[k]))
    share = (c.memory_bytes[category] - r.memory_bytes[category]) / more
    mostly = f" (mostly {category})" if 0.5 <= share <= 1.5 else ""
    return f"; needs {gib(abs(more))} {'more' if more > 0 else 'less'} GPU memory{mostly}"


def _what_less(chosen: Plan, other: Plan) -> str:
    """What `chosen` needs less of than `other` (search.leanest's order: host memory, GPU memory, traffic)."""
    c, o = chosen.predicted, other.predicted
    host = sum(o.host_memory_bytes.values()) - sum(c.host_memory_bytes.values())
    gpu = o.peak_memory_bytes - c.peak_memory_bytes
    less = [f"{gib(host)} less host memory per node"] * (host >= 0.05 * GIB) + \
        [f"{gib(gpu)} less {'GPU ' * (chosen.hardware.device == 'cuda')}memory"] * (gpu >= 0.05 * GIB)
    return " and ".join(less) or "less traffic over PCIe and between GPUs"


def knob_differences(chosen: Knobs, other: Knobs) -> str:
    """`other`'s knobs where they differ from `chosen`'s: the micro-batch split, then each knob by name."""
    return describe_knobs(other, against=chosen)


def percent(fraction: float) -> str:
    """Two decimals below 1%, where runners-up often are: 0.03%, 1.2%."""
    return f"{fraction:.2%}" if abs(fraction) < 0.01 else f"{fraction:.1%}"


def duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _values(knobs: Knobs) -> dict:
    return {f.name: getattr(knobs, f.name) for f in dataclasses.fields(Knobs)}


def layout_reason(problem: Problem, ranked: list[Candidate]) -> str:
    """Why the chosen plan's layout won, against the fastest plan of the other kind the search found (tensor or
    pipeline parallelism against data parallelism alone): their speeds, and what the layout's collectives and
    pipeline bubble cost a step. "" where the search weighed no layouts or found only one kind."""
    feasible = [c for c in ranked if c.feasible]
    if not problem.layouts or not feasible:
        return ""
    chosen = feasible[0]
    other = next((c for c in feasible if is_layout(c.knobs) != is_layout(chosen.knobs)), None)
    if other is None:
        return ""
    layouts = [c for c in (chosen, other) if is_layout(c.knobs)]
    step = layout_step(problem.spec, problem.seq_len, layouts[0].knobs, problem.machine)
    ratio = other.simulation.step_time_s / chosen.simulation.step_time_s
    parts = [f"its tensor-parallel collectives take {duration(step.tensor_parallel_s)}"] * \
        bool(step.tensor_parallel_s) + \
        [f"its pipeline bubble {duration(step.bubble_s)}"] * (layouts[0].knobs.pipeline_parallel > 1)
    costs = f"{' and '.join(parts)} of a {duration(layouts[0].simulation.step_time_s)} step"
    if is_layout(chosen.knobs):
        waits = duration(other.simulation.time_s["exposed_comm"])
        return (f"layout {describe_layout(chosen.knobs, problem.machine.num_gpus)}: {ratio:.2f}x the tokens/s of the "
                f"fastest data-parallel plan found ({describe_knobs(other.knobs)}), which waits {waits} of its step on "
                f"collectives; {costs}")
    return (f"data parallel alone: {ratio:.2f}x the tokens/s of the fastest tensor- or pipeline-parallel layout "
            f"found, {describe_layout(other.knobs, problem.machine.num_gpus)}: {costs}")


def describe_layout(knobs: Knobs, num_gpus: int) -> str:
    """E.g. "tensor 4 x pipeline 4 x data 8 (sequence parallel, interleaved_1f1b with 4 chunks a rank)"."""
    layout = layout_of_knobs(knobs, num_gpus)
    extras = ["sequence parallel"] if knobs.sequence_parallel else []
    if layout.pipeline > 1:
        extras.append(knobs.pipeline_schedule + (f" with {layout.virtual} chunks a rank" if layout.virtual > 1 else ""))
    sizes = f"tensor {layout.tensor} x pipeline {layout.pipeline} x data {layout.data}"
    return f"{sizes} ({', '.join(extras)})" if extras else sizes
