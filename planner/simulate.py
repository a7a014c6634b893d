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

import functools
import re
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastml.plan import TIME_COMPONENTS, Knobs, block_group, fp8_cached_blocks, overlapped_groups
from fastml.planner.costs import Collective, costs, recomputed_weight_share
from fastml.planner.hardware import Machine
from fastml.planner.memory import (STREAM_BUFFER_LAYERS, block_input_bytes, group_params, layer_activation_bytes,
                                   placement)
from fastml.spec import ModelSpec

if TYPE_CHECKING:
    import networkx as nx

SIMULATED_MICRO_BATCHES = 3
STAGING = " (cpu step)"
"""The copies of a CPU step that overlaps the next step (knobs.overlap_cpu_step) run on their own stream
(executor/memory/optim.py, `_Staging`), not in order with the step's other copies: their own resources. They share
the PCIe link with those copies, which this leaves out: they are a few (the gradients, masters and weights of
the groups whose weights stay on the GPU, fetched and written back a slice at a time) beside the streamed blocks'."""
# Where the compute stream waits on an op of this kind, the wait is charged to this component.
_WAIT_COMPONENT = {"comm": "exposed_comm", "offload": "exposed_offload", "optimizer": "optimizer"}


class Op:
    """One op of the step: what it runs on, for how long, after which ops, and when the schedule placed it."""

    __slots__ = ("resource", "duration", "category", "deps", "start", "end", "blocker", "alloc", "free", "micro_batch")

    def __init__(self, resource: str, duration: float, category: str, deps: tuple[str, ...], start: float,
                 blocker: str | None, alloc=(), free=(), micro_batch: int | None = None):
        self.resource, self.duration, self.category, self.deps = resource, duration, category, deps
        self.start, self.end, self.blocker = start, start + duration, blocker
        self.alloc, self.free, self.micro_batch = alloc, free, micro_batch


@dataclass
class Simulation:
    ops: dict[str, Op] = field(repr=False)
    """The step's ops by name, in program order (a topological order of the task graph)."""
    step_time_s: float
    time_s: dict[str, float]
    repeated_window: tuple[float, float] | None = None
    """The simulated middle micro-batch, [start, end) on the graph's clock, where the step repeats it."""
    repeats: int = 0
    """How many more times the step runs that micro-batch than the graph does."""

    # What the search does not need is worked out on demand.
    @functools.cached_property
    def critical_path(self) -> list[str]:
        """The ops that held each other back, from the step's first to its last."""
        path = [_last(self.ops)]
        while self.ops[path[-1]].blocker is not None:
            path.append(self.ops[path[-1]].blocker)
        return path[::-1]

    @functools.cached_property
    def memory_timeline(self) -> list[tuple[float, int]]:
        """Activation bytes resident on the GPU over the simulated ops: allocated when an op starts, freed when one
        ends."""
        sizes, events = {}, []
        for op in self.ops.values():
            for key, num_bytes in op.alloc:
                sizes[key] = num_bytes
                events.append((op.start, num_bytes))
        for op in self.ops.values():
            for key in op.free:
                events.append((op.end, -sizes[key]))
        timeline, resident = [(0.0, 0)], 0
        for time, delta in sorted(events):  # frees first at equal times
            resident += delta
            timeline.append((time, resident))
        return timeline

    @property
    def activation_peak_bytes(self) -> int:
        return max(resident for _, resident in self.memory_timeline)

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        """The ops as a networkx task graph: an edge from each op to the ops that wait for it; each node has its
        op's fields as attributes."""
        import networkx as nx

        graph = nx.DiGraph()
        for name, op in self.ops.items():
            graph.add_node(name, **{key: getattr(op, key) for key in Op.__slots__ if key != "deps"})
            graph.add_edges_from((dep, name) for dep in op.deps)
        return graph


def simulate(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> Simulation:
    ops = schedule(spec, seq_len, knobs, machine)
    last = _last(ops)
    time_s = _breakdown(ops, last, 0.0, ops[last].end)
    extra = max(0, knobs.grad_accum_steps - SIMULATED_MICRO_BATCHES)
    window = None
    if extra > 0:
        window = tuple(_micro_batch_ends(ops)[:2])
        middle = _breakdown(ops, last, *window)
        time_s = {k: time_s[k] + extra * middle[k] for k in TIME_COMPONENTS}
    return Simulation(ops=ops, step_time_s=sum(time_s.values()), time_s=time_s, repeated_window=window,
                      repeats=extra)


def schedule(spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine) -> dict[str, Op]:
    """The step's ops, each placed as it is added (`_StepGraph.add`)."""
    step = _StepGraph(spec, seq_len, knobs, machine)
    step.last_steps_cpu_work()
    num_micro = min(knobs.grad_accum_steps, SIMULATED_MICRO_BATCHES)
    for m in range(num_micro):
        step.forward(m)
        step.head(m, last=m == num_micro - 1)
        step.backward(m, last=m == num_micro - 1)
    step.optimizer_step()
    return step.ops


class _StepGraph:
    """One optimizer step's ops, added in program order; each op depends on the ops named and, implicitly, on the
    ops added before it to its resource, and is scheduled as it is added: in-order list scheduling, since program
    order is a topological order. What crosses PCIe follows `memory.Placement`, the executor's offload:
    streamed weights come up before each forward and backward pass of their block; an offloaded block input goes
    down after the block's forward pass and comes back before its backward pass; offloaded gradients go down after
    each backward pass and, from the second micro-batch on, come back before it to be added to. Each stream passes
    through STREAM_BUFFER_LAYERS GPU buffers, so a copy runs one block ahead of the compute using it."""

    def __init__(self, spec: ModelSpec, seq_len: int, knobs: Knobs, machine: Machine):
        self.ops: dict[str, Op] = {}
        self.resource_free: dict[str, tuple[float, str | None]] = {}  # when each resource is next free, after what
        self.c = costs(spec, seq_len, knobs, machine)
        self.step_overhead_s = machine.calibration.step_overhead_s + self.c.step_host_s
        self.knobs = knobs
        self.num_layers = spec.num_layers
        self.groups = [block_group(layer) for layer in range(spec.num_layers)]  # by block: its parameter group
        self.multi = machine.num_gpus > 1
        self.device = "CPU" if machine.device == "cpu" else "GPU"  # the device's optimizer step, by name
        self.place = placement(spec, knobs)
        self.fp8_cached = fp8_cached_blocks(knobs, spec.num_layers, machine.num_gpus)
        self.recomputed_weights = recomputed_weight_share(spec, knobs.recompute)
        self.cache_op: str | None = None
        self.group_params = group_params(spec)
        self.optimizer_shard = machine.num_gpus if knobs.shard_optimizer else 1
        tokens = knobs.micro_batch_size * seq_len
        self.act_bytes = layer_activation_bytes(spec, knobs, tokens, machine.device)
        self.input_bytes = block_input_bytes(spec, knobs, tokens)
        self.compute_ops: list[str] = []  # the compute stream in program order, for prefetch distances
        self.streamed = {"weights": self.place.streamed_weights, "inputs": self.place.host_inputs,
                         "gradients": self.place.host_gradients}
        # Per stream, the op after which each GPU buffer's last block is done with it, oldest first.
        self.buffer_users = {kind: deque(maxlen=STREAM_BUFFER_LAYERS) for kind in self.streamed}
        self.last_grad: dict[int | str, str] = {}  # per group, the op after which its gradient is final (GPU or host)
        # knobs.overlap_cpu_step: the CPU steps its groups after this step's clipping, into the next step
        self.overlapped = overlapped_groups(knobs, spec.num_layers)
        self.stepped: dict[str, str] = {}  # per group, the op after which the last step's CPU work left its weights

    def add(self, name: str, resource: str, duration_s: float, category: str, deps=(), alloc=(), free=(),
            micro_batch: int | None = None) -> str:
        """Adds the op and places it: it starts when its resource is free and its inputs (`deps`, None for none)
        are ready; `blocker` is the op whose end it waited for last."""
        start, blocker = self.resource_free.get(resource, (0.0, None))
        ops = self.ops
        kept = []
        for dep in deps:
            if dep is not None:
                kept.append(dep)
                end = ops[dep].end
                if end > start:
                    start, blocker = end, dep
        op = ops[name] = Op(resource, duration_s, category, tuple(kept), start, blocker, alloc, free, micro_batch)
        self.resource_free[resource] = (op.end, name)
        return name

    def compute(self, name: str, duration_s: float, category: str, deps=(), alloc=(), free=(),
                micro_batch: int | None = None) -> str:
        previous = self.compute_ops[-1] if self.compute_ops else None
        self.compute_ops.append(self.add(name, "compute", duration_s, category, [previous, *deps], alloc, free,
                                         micro_batch))
        return name

    def prefetch_slot(self) -> str | None:
        """A double buffer frees when the compute op two back is done."""
        return self.compute_ops[-2] if len(self.compute_ops) >= 2 else None

    def buffer_free(self, kind: str, ahead: bool = False) -> str | None:
        """The op after which the GPU buffer the next block of stream `kind` takes is free: the one its block two
        back used, the buffers being taken in turn; `ahead`, asked for before the block in between computes: the
        last one used."""
        users = self.buffer_users[kind]
        if ahead:
            return users[-1] if users else None
        return users[0] if len(users) == STREAM_BUFFER_LAYERS else None

    def collective(self, name: str, c: Collective, deps) -> str:
        """A collective on NCCL's stream, or its copies down then up on the copy engines (the memcpy collectives,
        and NCCL through host memory)."""
        if c.comm_s or not (c.d2h_s or c.h2d_s):
            return self.add(name, "comm", c.comm_s, "comm", deps)
        down = self.add(f"{name} (down)", "d2h", c.d2h_s, "comm", deps)
        if not c.both_ways:
            return self.add(f"{name} (up)", "h2d", c.h2d_s, "comm", [down])
        up = self.add(f"{name} (up)", "h2d", c.h2d_s, "comm", deps)
        return self.add(name, "comm", 0.0, "comm", [down, up])

    def fetch_weights(self, layer: int, tag: str, backward: bool, ahead: bool = False) -> str | None:
        """What a block's computing waits for: its streamed weights up from the host, or its weight shards gathered
        (a streamed shard first up from the host), or in the backward pass their copy cached on the host; `ahead`:
        streamed weights asked for before the block above them computes (`buffer_free`)."""
        k, c = self.knobs, self.c
        sharded = k.shard_weights and self.multi
        streamed = self.groups[layer] in self.place.streamed_weights
        if streamed and not sharded:  # the copies wait for the compute queued before them (the fp8 cache's cast)
            masters = self.groups[layer] in self.place.master_streamed
            return self.add(f"h2d {'masters' if masters else 'weights'} L{layer} {tag}", "h2d",
                            c.layer_masters_h2d if masters else c.layer_weights_h2d, "offload",
                            [self.buffer_free("weights", ahead), self.cache_op, self.stepped.get(self.groups[layer])])
        if not sharded:
            return None
        if backward and k.cache_weights_on_host and not streamed:
            return self.add(f"h2d weights L{layer} {tag}", "h2d", c.layer_weights_h2d, "offload",
                            [self.prefetch_slot()])
        ready = self.prefetch_slot()
        if streamed:
            ready = self.add(f"h2d weight shard L{layer} {tag}", "h2d", c.shard_h2d, "offload", [ready])
        return self.collective(f"gather weights L{layer} {tag}", c.layer_weight_gather, [ready])

    def cache_weights(self, layer: int, forward_op: str) -> None:
        """ZeRO-3 with cache_weights_on_host: a block's gathered weights go to the host after its step's first forward
        pass."""
        k = self.knobs
        if self.multi and k.shard_weights and k.cache_weights_on_host and self.groups[layer] not in \
                self.place.streamed_weights:
            self.add(f"d2h cached weights L{layer} {forward_op.split()[-1]}", "d2h", self.c.layer_weights_h2d,
                     "offload", [forward_op])

    def weight_casts(self, layer: int, phase: str) -> float:
        """The casts of the block's weights to fp8 in a pass of `phase`, where the block does not cache them."""
        if self.groups[layer] in self.fp8_cached:
            return 0.0
        return self.c.layer_weight_cast_forward if phase == "forward" else self.c.layer_weight_cast_backward

    def release(self, kind: str, layer: int, op: str) -> None:
        """`op` is the last to use the block's GPU buffer of stream `kind`, if it has one: the buffer frees after it."""
        if self.groups[layer] in self.streamed[kind]:
            self.buffer_users[kind].append(op)

    def forward(self, m: int) -> None:
        c = self.c
        if m == 0 and self.fp8_cached:  # the step's one cast of the cached fp8 weights (executor/loop/step.py), of
            # every weight as the last step left it
            self.cache_op = self.compute("cache fp8 weights", len(self.fp8_cached) * c.layer_weight_cache, "compute",
                                         list(self.stepped.values()))
        if self.multi and self.knobs.shard_weights:  # gathered at the start of the pass, waited for at once
            self.compute(f"embed mb{m}", 0.0, "compute", [self.collective(f"gather embed mb{m}", c.embed_gather,
                                                                         [self.prefetch_slot()])])
        for layer in range(self.num_layers):
            ready = self.fetch_weights(layer, f"mb{m} fwd", backward=False)
            offloaded = self.groups[layer] in self.place.host_inputs
            kept = [(f"act {m} {layer}", self.act_bytes - offloaded * self.input_bytes)]
            if offloaded:
                kept.append((f"input {m} {layer}", self.input_bytes))
            # The executor's prefetch of a streamed next block waits for that block's step before this block runs
            following = self.groups[layer + 1] if layer + 1 < self.num_layers else None
            stepped = [self.stepped.get(self.groups[layer]), self.stepped.get("embed") if layer == 0 else None,
                       self.stepped.get(following) if following in self.place.streamed_weights else None]
            fwd = self.compute(f"fwd L{layer} mb{m}", c.layer_forward + self.weight_casts(layer, "forward"),
                               "compute", [ready, *stepped], alloc=kept)
            self.release("weights", layer, fwd)
            if m == 0:  # the step's first forward pass caches them for all its backward passes
                self.cache_weights(layer, fwd)
            if offloaded:
                self.add(f"d2h input L{layer} mb{m}", "d2h", c.layer_input_d2h, "offload", [fwd],
                         free=[f"input {m} {layer}"])

    def head(self, m: int, last: bool) -> None:
        """The final norm, the LM head and the loss, forward and backward; with ZeRO-3 their weights are gathered
        while the last block computes; then their gradients are reduced."""
        ready = None
        if self.multi and self.knobs.shard_weights:
            ready = self.collective(f"gather head mb{m}", self.c.head_gather, [self.prefetch_slot()])
        head = self.compute(f"head mb{m}", self.c.head_forward_backward, "compute", [ready, self.stepped.get("head")])
        if self.multi and (self.knobs.shard_gradients or last):
            self.last_grad["head"] = self.collective(f"reduce grads head mb{m}", self.c.head_grad_reduce, [head])

    def backward(self, m: int, last: bool) -> None:
        """Each block's backward pass (recompute first), its gradients then reduced and sent to the host as the plan
        says. As in the executor (memory/placement.py), what a block needs from the host (weights, input, gradient
        sums so far) is asked for as the backward pass of the block above it begins: ahead of that block's own
        gradients' copies on the same copy engines."""
        c = self.c
        ahead = self.fetch_for_backward(self.num_layers - 1, m, ahead=False)
        for layer in reversed(range(self.num_layers)):
            deps, freed = ahead, [f"act {m} {layer}"]
            if self.knobs.shard_weights and self.multi:  # gathered two compute ops ahead (`prefetch_slot`)
                deps[0] = self.fetch_weights(layer, f"mb{m} bwd", backward=True)
            if self.groups[layer] in self.place.host_inputs:
                freed.append(f"input {m} {layer}")
            if layer > 0:
                ahead = self.fetch_for_backward(layer - 1, m, ahead=True)
            if self.knobs.recompute:
                recast = self.weight_casts(layer, "forward") * self.recomputed_weights
                self.compute(f"recompute L{layer} mb{m}", c.layer_recompute + recast, "recompute",
                             deps[:2])
                deps = deps[2:]
            accumulate = c.grad_accumulate / self.num_layers if m > 0 else 0.0
            grad = self.compute(f"bwd L{layer} mb{m}", c.layer_backward + self.weight_casts(layer, "backward") +
                                accumulate, "compute", deps, free=freed, micro_batch=m)
            self.release("weights", layer, grad)
            self.release("inputs", layer, grad)
            if self.multi and (self.knobs.shard_gradients or last):
                grad = self.collective(f"reduce grads L{layer} mb{m}", c.layer_grad_reduce, [grad])
            if self.groups[layer] in self.place.host_gradients and not (last and self.reduced_on_gpu()):
                grad = self.gradients_down(layer, m, grad)
                self.release("gradients", layer, grad)
            self.last_grad[layer] = grad
        if self.multi and (self.knobs.shard_gradients or last):  # the embedding's, the last made
            self.last_grad["embed"] = self.collective(f"reduce grads embed mb{m}", c.embed_grad_reduce,
                                                      [self.compute_ops[-1]])

    def fetch_for_backward(self, layer: int, m: int, ahead: bool) -> list[str | None]:
        """What block `layer`'s backward pass waits for, asked for now: [its streamed weights, its input] (what its
        recompute needs), then its gradient sums so far."""
        c = self.c
        gathered = self.knobs.shard_weights and self.multi  # `backward` gathers them
        weights = None if gathered else self.fetch_weights(layer, f"mb{m} bwd", backward=True, ahead=ahead)
        block_input = None
        if self.groups[layer] in self.place.host_inputs:
            block_input = self.add(f"h2d input L{layer} mb{m}", "h2d", c.layer_input_h2d, "offload",
                                   [f"d2h input L{layer} mb{m}", self.buffer_free("inputs", ahead)],
                                   alloc=[(f"input {m} {layer}", self.input_bytes)])
        return [weights, block_input, *self.fetch_gradients(layer, m, ahead)]

    def reduced_on_gpu(self) -> bool:
        """ZeRO-1: the last micro-batch's reduce-scatter leaves a block's shard of the sums on the GPU, where offloaded
        gradients sent the others down."""
        return self.multi and self.knobs.shard_optimizer and not self.knobs.shard_gradients

    def sharded_host_gradients(self, layer: int) -> bool:
        """Whether the block's reduced gradient shard sums the micro-batches in host memory (executor/parallel/shard.py)."""
        return self.multi and self.knobs.shard_gradients and self.groups[layer] in self.place.host_gradients

    def gradients_down(self, layer: int, m: int, grad: str) -> str:
        """An offloaded block's gradients to the host after its backward pass (and reduction); a sharded one's sum
        so far first comes up to be added to, from the second micro-batch on."""
        c = self.c
        if not self.sharded_host_gradients(layer):
            return self.add(f"d2h grads L{layer} mb{m}", "d2h", c.layer_grads_d2h, "offload", [grad])
        shard = 1 / self.optimizer_shard
        if m > 0:
            grad = self.add(f"h2d grad shard L{layer} mb{m}", "h2d", c.layer_grads_h2d * shard, "offload",
                            [grad, f"d2h grad shard L{layer} mb{m - 1}"])
        return self.add(f"d2h grad shard L{layer} mb{m}", "d2h", c.layer_grads_d2h * shard, "offload", [grad])

    def fetch_gradients(self, layer: int, m: int, ahead: bool = False) -> list[str | None]:
        """What the backward pass of an offloaded-gradient block waits for: a free gradient buffer, and from the
        second micro-batch on the accumulated gradients, back from the host to be added to (unsharded: a sharded
        block adds to its shard after the reduction, `gradients_down`)."""
        if self.groups[layer] not in self.place.host_gradients:
            return []
        if self.sharded_host_gradients(layer):
            return [self.buffer_free("gradients", ahead)]
        free = self.buffer_free("gradients", ahead)
        if m == 0:
            return [free]
        return [self.add(f"h2d grads L{layer} mb{m}", "h2d", self.c.layer_grads_h2d, "offload",
                         [f"d2h grads L{layer} mb{m - 1}", free])]

    def last_steps_cpu_work(self) -> None:
        """knobs.overlap_cpu_step: the CPU steps of the step before, begun as its gradients were clipped (time 0 of
        this step, the steps being alike), run while this step starts; each group's first use waits for its own
        (`stepped`)."""
        if self.overlapped:
            tag = " (last step)"
            for group in self.group_params:
                if group in self.overlapped:
                    self.stepped[group] = self.cpu_step(group, None, self.cpu_inputs_down(group, None, tag), tag)

    def optimizer_step(self) -> None:
        """After the whole backward pass and gradient clipping (the global norm needs every gradient): the CPU
        steps the groups whose Adam states live on the host, one after another, each once its inputs on the GPU
        have come down (`cpu_inputs_down`), its results going up while the next one steps (with
        knobs.overlap_cpu_step it does so into the next step: `last_steps_cpu_work`); the GPU steps the others,
        fetching what they keep on the host into one group's workspace at a time."""
        clip = self.compute("clip gradients", self.c.grad_clip, "optimizer", list(self.last_grad.values()))
        on_cpu = [g for g in self.group_params if g in self.place.cpu_steps and g not in self.overlapped]
        on_gpu = [g for g in self.group_params if g not in self.place.cpu_steps]
        resident = [g for g in on_gpu if self.place.gpu_step_transfers(g) == (0, 0)]
        updated = []
        if resident:
            num_params = sum(self.share(g) for g in resident)
            updated.append(self.compute(f"optimizer ({self.device})", num_params * self.c.gpu_adam_per_param,
                                        "optimizer"))
        workspace_free = None
        for group in on_gpu:
            if group not in resident:
                workspace_free = self.gpu_step_from_host(group, clip, workspace_free)
                updated.append(workspace_free)
        updated += [self.cpu_step(group, clip, self.cpu_inputs_down(group, clip)) for group in on_cpu]
        if self.multi and self.knobs.shard_optimizer and not self.knobs.shard_weights:
            self.collective("gather updated weights", self.c.step_weight_gather, updated)
        if self.step_overhead_s:  # the host's own work of a step, after its optimizer steps (measured, calibrated)
            self.compute("step overhead", self.step_overhead_s, "other", updated)

    def share(self, group: str) -> float:
        """The parameters of `group` that this GPU's optimizer steps."""
        return self.group_params[group] / self.optimizer_shard

    def gpu_step_from_host(self, group: str, clip: str, workspace_free: str | None) -> str:
        c = self.c
        fetch_bytes, back_bytes = (n * self.share(group) for n in self.place.gpu_step_transfers(group))
        fetch = None
        if fetch_bytes:
            fetch = self.add(f"h2d optimizer inputs {group}", "h2d", fetch_bytes * c.h2d_per_byte, "offload",
                             [clip, workspace_free])
        step = self.compute(f"optimizer {group} ({self.device})", self.share(group) * c.gpu_adam_per_param, "optimizer",
                            [fetch, workspace_free])
        if not back_bytes:
            return step
        return self.add(f"d2h updated {group}", "d2h", back_bytes * c.d2h_per_byte, "offload", [step])

    def cpu_inputs_down(self, group: str, clip: str | None, tag: str = "") -> str | None:
        """What a CPU step of `group` reads from the GPU (its gradients, its master) coming down: after the CPU's
        step of the group before, since the CPU copies a slice and waits for it before stepping it
        (executor/memory/optim.py, `_Staging.fetch`): the copies do not run ahead of the CPU."""
        down_bytes = self.place.cpu_step_transfers(group)[0] * self.share(group)
        if not down_bytes:
            return None
        cpu_free = self.resource_free.get("cpu", (0.0, None))[1]
        return self.add(f"d2h optimizer inputs {group}{tag}", f"d2h{tag and STAGING}",
                        down_bytes * self.c.d2h_per_byte, "offload", [clip, cpu_free])

    def cpu_step(self, group: str, clip: str | None, inputs: str | None, tag: str = "") -> str:
        step = self.add(f"cpu adam {group}{tag}", "cpu", self.share(group) * self.c.cpu_adam_per_param, "optimizer",
                        [clip, inputs])
        up_bytes = self.place.cpu_step_transfers(group)[1] * self.share(group)
        if not up_bytes:
            return step
        return self.add(f"h2d updated {group}{tag}", f"h2d{tag and STAGING}", up_bytes * self.c.h2d_per_byte,
                        "offload", [step])


def _breakdown(ops: dict[str, Op], last: str, window_start: float, window_end: float) -> dict[str, float]:
    """Splits [window_start, window_end] by what the compute stream did: its own ops by their category, and
    its idle time by the kinds of op it was waiting for (`_charge_wait`); `last` is the op that ends the step."""
    time_s = dict.fromkeys(TIME_COMPONENTS, 0.0)
    cursor = window_start
    for op in ops.values():  # the compute stream's ops in program order, which is the order they start in
        if op.resource != "compute":
            continue
        start, end = max(op.start, window_start), min(op.end, window_end)
        if end <= start:
            continue
        if start > cursor:
            _charge_wait(ops, op.blocker, cursor, start, time_s)
        time_s[op.category] += end - start
        cursor = end
    if window_end > cursor:  # the step ends with work off the compute stream (CPU optimizer, transfers, comm)
        _charge_wait(ops, last, cursor, window_end, time_s)
    return time_s


def _charge_wait(ops: dict[str, Op], name: str | None, wait_start: float, wait_end: float,
                 time_s: dict[str, float]) -> None:
    """Charges the compute stream's wait [wait_start, wait_end), which op `name` ends, along the chain of ops that
    held each other back (each starts when its blocker ends): each op's part of the wait to the component of its
    kind, so a transfer that waited for the CPU's optimizer step counts as optimizer time."""
    while name is not None:
        op = ops[name]
        start, end = max(op.start, wait_start), min(op.end, wait_end)
        if end > start:
            time_s[_WAIT_COMPONENT.get(op.category, "other")] += end - start
        if op.start <= wait_start:
            return
        name = op.blocker


def _last(ops: dict[str, Op]) -> str:
    """The op that ends the step (the first added, of those ending last)."""
    return max(ops, key=lambda n: ops[n].end)


def _micro_batch_ends(ops: dict[str, Op]) -> list[float]:
    ends: dict[int, float] = {}
    for op in ops.values():
        if op.micro_batch is not None:
            ends[op.micro_batch] = max(ends.get(op.micro_batch, 0.0), op.end)
    return [ends[m] for m in sorted(ends)]


def chrome_trace(sim: Simulation) -> dict:
    """The simulated step in Chrome's trace format (open in Perfetto or chrome://tracing): one track per resource
    and a counter track of resident activation memory. Where the step has more micro-batches than were simulated,
    the middle one's ops are repeated in its place and the later ops shifted, so the trace ends with the step."""
    tracks = {}
    events = []
    for name, op in sim.ops.items():
        tid = tracks.setdefault(op.resource, len(tracks))
        for op_name, start_s in _op_placements(sim, name, op.start):
            events.append({"name": op_name, "cat": op.category, "ph": "X", "pid": 0, "tid": tid,
                           "ts": start_s * 1e6, "dur": op.duration * 1e6})
    for resource, tid in tracks.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": resource}})
    for time, resident in sim.memory_timeline:
        for start_s in _counter_placements(sim, time):
            events.append({"name": "activations", "ph": "C", "pid": 0, "ts": start_s * 1e6,
                           "args": {"GiB": resident / 2**30}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def beside_measured(simulated: dict, measured: dict) -> dict:
    """One trace of both steps: the simulated one (`chrome_trace`) as process 0, named "simulated", and after it the
    processes of a measured one (torch's profiler's Chrome trace: the Python threads, each GPU's streams), their
    names prefixed "measured", their clock moved so that the measured step starts at 0 too."""
    events = [e for e in measured.get("traceEvents", []) if isinstance(e, dict)]
    start = min((float(e["ts"]) for e in events if e.get("ph") == "X" and "ts" in e), default=0.0)
    pids: dict = {}
    merged = [*simulated["traceEvents"], {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "simulated"}}]
    named = set()
    for event in events:
        event = dict(event)
        original = event.get("pid")
        if "pid" in event:
            event["pid"] = pids.setdefault(original, len(pids) + 1)
        if event.get("ph") == "M" and event.get("name") == "process_name":
            name = event.get("args", {}).get("name") or f"process {original}"  # the profiler leaves some unnamed
            event["args"] = {**event.get("args", {}), "name": f"measured: {name}"}
            named.add(event["pid"])
        elif "ts" in event and event.get("ph") != "M":
            event["ts"] = float(event["ts"]) - start
        merged.append(event)
    merged += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"measured: process {original}"}}
               for original, pid in pids.items() if pid not in named]  # noqa: E501
    return {"traceEvents": merged, "displayTimeUnit": "ms"}


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
