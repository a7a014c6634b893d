"""One optimizer step as a task graph: ops on resources, scheduled, with its critical path, exposed time per
component and activation-memory timeline; exportable as a Chrome/Perfetto trace.

Resources work like CUDA streams and engines: each runs its ops one at a time in program order, and an op starts
when its inputs are ready and its resource is free. Resources: the compute stream, the host-to-device and
device-to-host copy engines (sharing the node's PCIe root: their rates are per-GPU shares, hardware.py), the
collective stream (NVLink, PCIe or NIC, by the collective's path) and the CPU.

Micro-batches after the third repeat the second exactly, so at most three are simulated and the middle one's
duration stands for the rest; the trace repeats the middle one's ops in their place, so it shows the whole step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import networkx as nx

from fastml.plan import TIME_COMPONENTS, Knobs
from fastml.planner.costs import costs
from fastml.planner.hardware import Machine
from fastml.planner.memory import has_fp32_masters, layer_activation_bytes
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
    repeated_window: tuple[float, float] | None = None
    """The simulated middle micro-batch, [start, end) on the graph's clock, where the step repeats it."""
    repeats: int = 0
    """How many more times the step runs that micro-batch than the graph does."""


def simulate(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Simulation:
    graph = build_graph(spec, seq_len, knobs, machine)
    _schedule(graph)
    makespan = max(d["end"] for _, d in graph.nodes(data=True))
    time_s = _breakdown(graph, 0.0, makespan)
    extra = max(0, knobs.grad_accum_steps - SIMULATED_MICRO_BATCHES)
    window = None
    if extra > 0:
        window = tuple(_micro_batch_ends(graph)[:2])
        middle = _breakdown(graph, *window)
        time_s = {k: time_s[k] + extra * middle[k] for k in TIME_COMPONENTS}
    timeline = _memory_timeline(graph)
    return Simulation(graph=graph, step_time_s=sum(time_s.values()), time_s=time_s,
                      critical_path=_critical_path(graph), activation_peak_bytes=max(m for _, m in timeline),
                      memory_timeline=timeline, repeated_window=window, repeats=extra)


def build_graph(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> nx.DiGraph:
    step = _StepGraph(spec, seq_len, knobs, machine)
    num_micro = min(knobs.grad_accum_steps, SIMULATED_MICRO_BATCHES)
    for m in range(num_micro):
        step.forward(m)
        step.compute(f"head mb{m}", step.c.head_forward_backward, "compute")
        step.backward(m, last=m == num_micro - 1)
    step.optimizer_step()
    return step.graph


class _StepGraph:
    """One optimizer step's ops, added in program order; each op depends on the ops named and, implicitly, on the
    ops added before it to its resource."""

    def __init__(self, spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine):
        self.graph = nx.DiGraph()
        self.c = costs(spec, seq_len, knobs, machine)
        self.knobs = knobs
        self.num_layers = spec.num_layers
        self.multi = machine.num_gpus > 1

        def layers(fraction: float) -> set[int]:
            return set(range(round(fraction * spec.num_layers)))
        self.streamed = layers(knobs.offload_weights)
        self.offloaded_acts = layers(knobs.offload_residuals)
        self.offloaded_grads = layers(knobs.offload_gradients)
        self.cpu_adam = layers(knobs.offload_optimizer)
        self.offloaded_master = layers(knobs.offload_master) if has_fp32_masters(knobs) else set()
        self.act_bytes = layer_activation_bytes(spec, knobs, knobs.micro_batch_size * seq_len, machine.device)
        self.compute_ops: list[str] = []  # the compute stream in program order, for prefetch distances
        self.last_grad: dict[int, str] = {}  # per layer, the op after which its gradient is ready for the optimizer

    def add(self, name: str, resource: str, duration_s: float, category: str, deps=(), **attrs) -> str:
        self.graph.add_node(name, resource=resource, duration=duration_s, category=category, **attrs)
        for dep in deps:
            if dep is not None:
                self.graph.add_edge(dep, name)
        return name

    def compute(self, name: str, duration_s: float, category: str, deps=(), **attrs) -> str:
        previous = self.compute_ops[-1] if self.compute_ops else None
        self.compute_ops.append(self.add(name, "compute", duration_s, category, [previous, *deps], **attrs))
        return name

    def prefetch_slot(self) -> str | None:
        """A double buffer frees when the compute op two back is done."""
        return self.compute_ops[-2] if len(self.compute_ops) >= 2 else None

    def fetch_weights(self, layer: int, tag: str, backward: bool) -> str | None:
        k, c = self.knobs, self.c
        if layer in self.streamed or (backward and k.shard_weights and k.cache_weights_on_host):
            return self.add(f"h2d weights L{layer} {tag}", "h2d", c.layer_weights_h2d, "offload",
                            [self.prefetch_slot()])
        if k.shard_weights and self.multi:
            return self.add(f"gather weights L{layer} {tag}", "comm", c.layer_weight_gather, "comm",
                            [self.prefetch_slot()])
        return None

    def forward(self, m: int) -> None:
        for layer in range(self.num_layers):
            ready = self.fetch_weights(layer, f"mb{m} fwd", backward=False)
            fwd = self.compute(f"fwd L{layer} mb{m}", self.c.layer_forward, "compute", [ready],
                               alloc=(f"act {m} {layer}", self.act_bytes))
            if layer in self.offloaded_acts:
                self.add(f"d2h acts L{layer} mb{m}", "d2h", self.c.layer_activations_transfer, "offload", [fwd],
                         free=f"act {m} {layer}")

    def backward(self, m: int, last: bool) -> None:
        c = self.c
        for layer in reversed(range(self.num_layers)):
            deps = [self.fetch_weights(layer, f"mb{m} bwd", backward=True)]
            if layer in self.offloaded_acts:
                deps.append(self.add(f"h2d acts L{layer} mb{m}", "h2d", c.layer_activations_transfer, "offload",
                                     [f"d2h acts L{layer} mb{m}", self.prefetch_slot()],
                                     alloc=(f"act {m} {layer}", self.act_bytes)))
            if self.knobs.recompute:
                self.compute(f"recompute L{layer} mb{m}", c.layer_recompute, "recompute", deps)
                deps = []
            accumulate = c.grad_accumulate / self.num_layers if m > 0 and layer not in self.offloaded_grads else 0.0
            grad = self.compute(f"bwd L{layer} mb{m}", c.layer_backward + accumulate, "compute", deps,
                                free=f"act {m} {layer}", micro_batch=m)
            if self.multi and (self.knobs.shard_gradients or last):
                grad = self.add(f"reduce grads L{layer} mb{m}", "comm", c.layer_grad_reduce, "comm", [grad])
            if layer in self.offloaded_grads:
                grad = self.add(f"d2h grads L{layer} mb{m}", "d2h", c.layer_grads_d2h, "offload", [grad])
            self.last_grad[layer] = grad

    def optimizer_step(self) -> None:
        """On the CPU for layers whose Adam states live there, on the GPU for the others; master weights kept on
        the other side cross PCIe both ways."""
        c = self.c
        gpu_steps_with_host_master = self.offloaded_master - self.cpu_adam
        fetch = [self.add(f"h2d master L{layer}", "h2d", c.layer_master_transfer, "offload", [self.last_grad[layer]])
                 for layer in sorted(gpu_steps_with_host_master)]
        optimizer = self.compute("optimizer (GPU)", c.gpu_optimizer, "optimizer", [*self.last_grad.values(), *fetch])
        for layer in sorted(gpu_steps_with_host_master):
            self.add(f"d2h master L{layer}", "d2h", c.layer_master_transfer, "offload", [optimizer])
        for layer in sorted(self.cpu_adam):
            self.cpu_adam_step(layer)
        if self.multi and self.knobs.shard_optimizer and not self.knobs.shard_weights:
            self.add("gather updated weights", "comm", c.step_weight_gather, "comm", [optimizer])

    def cpu_adam_step(self, layer: int) -> None:
        c = self.c
        deps = [self.last_grad[layer]]
        if layer not in self.offloaded_master:
            deps.append(self.add(f"d2h master L{layer}", "d2h", c.layer_master_transfer, "offload", deps))
        step = self.add(f"cpu adam L{layer}", "cpu", c.cpu_optimizer_layer, "optimizer", deps)
        if layer not in self.offloaded_master:
            self.add(f"h2d master L{layer}", "h2d", c.layer_master_transfer, "offload", [step])
        if layer not in self.streamed:  # the updated bf16 weights go back to their GPU copy
            self.add(f"h2d new weights L{layer}", "h2d", c.layer_weights_h2d, "offload", [step])


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
    and a counter track of resident activation memory. Where the step has more micro-batches than were simulated,
    the middle one's ops are repeated in its place and the later ops shifted, so the trace ends with the step."""
    tracks = {}
    events = []
    for name, d in sim.graph.nodes(data=True):
        tid = tracks.setdefault(d["resource"], len(tracks))
        for op_name, start_s in _op_placements(sim, name, d["start"]):
            events.append({"name": op_name, "cat": d["category"], "ph": "X", "pid": 0, "tid": tid,
                           "ts": start_s * 1e6, "dur": d["duration"] * 1e6})
    for resource, tid in tracks.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": resource}})
    for time, resident in sim.memory_timeline:
        for start_s in _counter_placements(sim, time):
            events.append({"name": "activations", "ph": "C", "pid": 0, "ts": start_s * 1e6,
                           "args": {"GiB": resident / 2**30}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


_MICRO_BATCH = re.compile(r" mb(\d+)\b")


def _op_placements(sim: Simulation, name: str, start_s: float) -> list[tuple[str, float]]:
    """An op's (name, start) in the whole step: the middle micro-batch's ops once per repeat, renumbered; the last
    micro-batch's ops, and the ops after the micro-batches, shifted by the repeats."""
    if not sim.repeats:
        return [(name, start_s)]
    begin, end = sim.repeated_window
    match = _MICRO_BATCH.search(name)
    micro_batch = int(match.group(1)) if match else None
    if micro_batch == 0 or (micro_batch is None and start_s < begin):
        return [(name, start_s)]
    if micro_batch == 1:
        return [(_MICRO_BATCH.sub(f" mb{1 + k}", name), start_s + k * (end - begin)) for k in range(sim.repeats + 1)]
    last = _MICRO_BATCH.sub(f" mb{2 + sim.repeats}", name)
    return [(last, start_s + sim.repeats * (end - begin))]


def _counter_placements(sim: Simulation, time_s: float) -> list[float]:
    if not sim.repeats:
        return [time_s]
    begin, end = sim.repeated_window
    if time_s < begin:
        return [time_s]
    if time_s >= end:
        return [time_s + sim.repeats * (end - begin)]
    return [time_s + k * (end - begin) for k in range(sim.repeats + 1)]
