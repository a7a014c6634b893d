"""One optimizer step as a task graph: ops on resources, scheduled, with its critical path, exposed time per
component and activation-memory timeline; exportable as a Chrome/Perfetto trace.

Resources work like CUDA streams and engines: each runs its ops one at a time in program order, and an op starts
when its inputs are ready and its resource is free. Resources: the compute stream, the host-to-device and
device-to-host copy engines (sharing the node's PCIe root: their rates are per-GPU shares, hardware.py), the
collective stream (NVLink, PCIe or NIC, by the collective's path) and the CPU.

Micro-batches after the third repeat the second exactly, so at most three are simulated and the middle one's
duration stands for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from fastml.plan import TIME_COMPONENTS, Knobs
from fastml.planner.costs import costs
from fastml.planner.hardware import Machine
from fastml.planner.memory import BF16_BYTES, layer_activation_bytes
from fastml.spec import ModelSpec

SIMULATED_MICRO_BATCHES = 3
# Where the compute stream waits on an op of this kind, the wait is charged to this component.
_WAIT_COMPONENT = {"comm": "exposed_comm", "offload": "exposed_offload", "optimizer": "optimizer"}


@dataclass
class Simulation:
    graph: nx.DiGraph
    step_time_s: float
    time_s: dict[str, float]
    critical_path: list[str]
    activation_peak_bytes: int
    memory_timeline: list[tuple[float, int]] = field(repr=False)


def simulate(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Simulation:
    graph = build_graph(spec, seq_len, knobs, machine)
    _schedule(graph)
    makespan = max(d["end"] for _, d in graph.nodes(data=True))
    time_s = _breakdown(graph, 0.0, makespan)
    extra = knobs.grad_accum_steps - SIMULATED_MICRO_BATCHES
    if extra > 0:
        ends = _micro_batch_ends(graph)
        middle = _breakdown(graph, ends[0], ends[1])
        time_s = {k: time_s[k] + extra * middle[k] for k in TIME_COMPONENTS}
    timeline = _memory_timeline(graph)
    return Simulation(graph=graph, step_time_s=sum(time_s.values()), time_s=time_s,
                      critical_path=_critical_path(graph), activation_peak_bytes=max(m for _, m in timeline),
                      memory_timeline=timeline)


class _Builder:
    """Adds ops in program order; each op depends on the ops named and, implicitly, on its resource."""

    def __init__(self):
        self.graph = nx.DiGraph()

    def add(self, name: str, resource: str, duration_s: float, category: str, deps=(), **attrs) -> str:
        self.graph.add_node(name, resource=resource, duration=duration_s, category=category, **attrs)
        for dep in deps:
            if dep is not None:
                self.graph.add_edge(dep, name)
        return name


def build_graph(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> nx.DiGraph:
    c = costs(spec, seq_len, knobs, machine)
    b = _Builder()
    n_layers = spec.num_layers
    streamed = set(range(round(knobs.offload_weights * n_layers)))
    offloaded_acts = set(range(round(knobs.offload_residuals * n_layers)))
    offloaded_grads = set(range(round(knobs.offload_gradients * n_layers)))
    cpu_adam = set(range(round(knobs.offload_optimizer * n_layers)))
    offloaded_master = set(range(round(knobs.offload_master * n_layers))) if knobs.master_dtype == "fp32" else set()
    act_bytes = layer_activation_bytes(spec, knobs.recompute, knobs.micro_batch_size * seq_len, BF16_BYTES,
                                       knobs.matmul_dtype)
    num_micro = min(knobs.grad_accum_steps, SIMULATED_MICRO_BATCHES)
    multi = machine.num_gpus > 1
    compute_ops: list[str] = []  # the compute stream in program order, for prefetch distances
    last_grad_ops: dict[int, str] = {}

    def compute(name, duration, category, deps=(), **attrs):
        op = b.add(name, "compute", duration, category, [compute_ops[-1] if compute_ops else None, *deps], **attrs)
        compute_ops.append(op)
        return op

    def prefetch_slot():  # a double buffer frees when the compute op two back is done
        return compute_ops[-2] if len(compute_ops) >= 2 else None

    def fetch_weights(layer, tag, backward):
        if layer in streamed or (backward and knobs.shard_weights and knobs.cache_weights_on_host):
            return b.add(f"h2d weights L{layer} {tag}", "h2d", c.layer_weights_h2d, "offload", [prefetch_slot()])
        if knobs.shard_weights and multi:
            return b.add(f"gather weights L{layer} {tag}", "comm", c.layer_weight_gather, "comm", [prefetch_slot()])
        return None

    for m in range(num_micro):
        for layer in range(n_layers):
            ready = fetch_weights(layer, f"mb{m} fwd", backward=False)
            fwd = compute(f"fwd L{layer} mb{m}", c.layer_forward, "compute", [ready],
                          alloc=(f"act {m} {layer}", act_bytes))
            if layer in offloaded_acts:
                b.add(f"d2h acts L{layer} mb{m}", "d2h", c.layer_activations_transfer, "offload", [fwd],
                      free=f"act {m} {layer}")
        compute(f"head mb{m}", c.head_forward_backward, "compute")
        for layer in reversed(range(n_layers)):
            deps = [fetch_weights(layer, f"mb{m} bwd", backward=True)]
            if layer in offloaded_acts:
                deps.append(b.add(f"h2d acts L{layer} mb{m}", "h2d", c.layer_activations_transfer, "offload",
                                  [f"d2h acts L{layer} mb{m}", prefetch_slot()], alloc=(f"act {m} {layer}", act_bytes)))
            if knobs.recompute:
                compute(f"recompute L{layer} mb{m}", c.layer_recompute, "recompute", deps)
                deps = []
            accumulate = c.grad_accumulate / n_layers if m > 0 and layer not in offloaded_grads else 0.0
            bwd = compute(f"bwd L{layer} mb{m}", c.layer_backward + accumulate, "compute", deps,
                          free=f"act {m} {layer}", micro_batch=m)
            grad = bwd
            if multi and (knobs.shard_gradients or m == num_micro - 1):
                grad = b.add(f"reduce grads L{layer} mb{m}", "comm", c.layer_grad_reduce, "comm", [bwd])
            if layer in offloaded_grads:
                grad = b.add(f"d2h grads L{layer} mb{m}", "d2h", c.layer_grads_d2h, "offload", [grad])
            last_grad_ops[layer] = grad
    # The optimizer step runs on the CPU for layers whose Adam states live there, on the GPU for the others;
    # master weights kept on the other side cross PCIe both ways.
    gpu_steps_with_host_master = offloaded_master - cpu_adam
    fetch = [b.add(f"h2d master L{layer}", "h2d", c.layer_master_transfer, "offload", [last_grad_ops[layer]])
             for layer in sorted(gpu_steps_with_host_master)]
    optimizer = compute("optimizer (GPU)", c.gpu_optimizer, "optimizer", [*last_grad_ops.values(), *fetch])
    for layer in sorted(gpu_steps_with_host_master):
        b.add(f"d2h master L{layer}", "d2h", c.layer_master_transfer, "offload", [optimizer])
    for layer in sorted(cpu_adam):
        deps = [last_grad_ops[layer]]
        if layer not in offloaded_master:
            deps.append(b.add(f"d2h master L{layer}", "d2h", c.layer_master_transfer, "offload", deps))
        step = b.add(f"cpu adam L{layer}", "cpu", c.cpu_optimizer_layer, "optimizer", deps)
        if layer not in offloaded_master:
            b.add(f"h2d master L{layer}", "h2d", c.layer_master_transfer, "offload", [step])
        if layer not in streamed:  # the updated bf16 weights go back to their GPU copy
            b.add(f"h2d new weights L{layer}", "h2d", c.layer_weights_h2d, "offload", [step])
    if multi and knobs.shard_optimizer and not knobs.shard_weights:
        b.add("gather updated weights", "comm", c.step_weight_gather, "comm", [optimizer])
    return b.graph


def _schedule(graph: nx.DiGraph) -> None:
    """In-order list scheduling: sets start, end and the op that held each op back ('blocker')."""
    resource_free: dict[str, tuple[float, str | None]] = {}
    for name, op in graph.nodes(data=True):  # insertion order is program order, hence topological
        start, blocker = resource_free.get(op["resource"], (0.0, None))
        for dep in graph.predecessors(name):
            if graph.nodes[dep]["end"] > start:
                start, blocker = graph.nodes[dep]["end"], dep
        op.update(start=start, end=start + op["duration"], blocker=blocker)
        resource_free[op["resource"]] = (op["end"], name)


def _breakdown(graph: nx.DiGraph, window_start: float, window_end: float) -> dict[str, float]:
    """Splits [window_start, window_end] by what the compute stream did: its own ops by their category, and
    its idle gaps by the kind of op it was waiting for."""
    time_s = dict.fromkeys(TIME_COMPONENTS, 0.0)
    cursor = window_start
    ops = sorted((d for _, d in graph.nodes(data=True) if d["resource"] == "compute"), key=lambda d: d["start"])
    for op in ops:
        start, end = max(op["start"], window_start), min(op["end"], window_end)
        if end <= start:
            continue
        if start > cursor:
            time_s[_waited_for(graph, op)] += start - cursor
        time_s[op["category"]] += end - start
        cursor = end
    if window_end > cursor:  # the step ends with work off the compute stream (CPU optimizer, transfers, comm)
        last = max((d for _, d in graph.nodes(data=True)), key=lambda d: d["end"])
        time_s[_WAIT_COMPONENT.get(last["category"], "other")] += window_end - cursor
    return time_s


def _waited_for(graph: nx.DiGraph, op: dict) -> str:
    blocker = op.get("blocker")
    if blocker is None:
        return "other"
    return _WAIT_COMPONENT.get(graph.nodes[blocker]["category"], "other")


def _micro_batch_ends(graph: nx.DiGraph) -> list[float]:
    ends: dict[int, float] = {}
    for _, d in graph.nodes(data=True):
        if "micro_batch" in d:
            ends[d["micro_batch"]] = max(ends.get(d["micro_batch"], 0.0), d["end"])
    return [ends[m] for m in sorted(ends)]


def _critical_path(graph: nx.DiGraph) -> list[str]:
    name = max(graph.nodes, key=lambda n: graph.nodes[n]["end"])
    path = [name]
    while graph.nodes[path[-1]]["blocker"] is not None:
        path.append(graph.nodes[path[-1]]["blocker"])
    return path[::-1]


def _memory_timeline(graph: nx.DiGraph) -> list[tuple[float, int]]:
    """Activation bytes resident on the GPU over the step: allocated when an op starts, freed when one ends."""
    sizes, events = {}, []
    for _, d in graph.nodes(data=True):
        if "alloc" in d:
            key, num_bytes = d["alloc"]
            sizes[key] = num_bytes
            events.append((d["start"], num_bytes))
    for _, d in graph.nodes(data=True):
        if "free" in d:
            events.append((d["end"], -sizes[d["free"]]))
    timeline, resident = [(0.0, 0)], 0
    for time, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees first at equal times
        resident += delta
        timeline.append((time, resident))
    return timeline


def chrome_trace(sim: Simulation) -> dict:
    """The simulated step in Chrome's trace format (open in Perfetto or chrome://tracing): one track per resource
    and a counter track of resident activation memory."""
    tracks = {}
    events = []
    for name, d in sim.graph.nodes(data=True):
        tid = tracks.setdefault(d["resource"], len(tracks))
        events.append({"name": name, "cat": d["category"], "ph": "X", "pid": 0, "tid": tid,
                       "ts": d["start"] * 1e6, "dur": d["duration"] * 1e6})
    for resource, tid in tracks.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": resource}})
    for time, resident in sim.memory_timeline:
        events.append({"name": "activations", "ph": "C", "pid": 0, "ts": time * 1e6,
                       "args": {"GiB": resident / 2**30}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}

