"""`fastml calibrate`: fits a hardware profile's `calibration` (hwprofiles/schema.py) to what runs on that machine
measured (their records, fastml.record), so that its plans predict what it does.

Step time. The simulator splits each step into components (plan.TIME_COMPONENTS); the blocks' forward passes
(recomputed ones too) scale with the `forward` term, the GPU's other work (backward, head, optimizer) with `compute`,
the CPU's optimizer steps with `cpu_optimizer`, what waits on copies and collectives with `transfer`, and each pass
of a block or of the head adds `layer_overhead_s`, each step `step_overhead_s`. That makes a record's step time
linear in the six terms at the uncalibrated prediction, and a bounded linear least-squares fit of the relative
errors (scipy's lsq_linear) gives them. The errors after are not the fit's: each record is simulated again with the
fitted profile, overlap and all.

Peak memory. What a compiled block keeps (`compiled_activations`, of the activations the model counts, which
Inductor does not keep all of) and the allocator's `fragmentation` (a fraction of the peak) are fitted the same way,
linear in both to first order.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from fastml.config import fail, to_dict
from fastml.hwprofiles.schema import Calibration, parse_profile
from fastml.plan import Plan, fp8_cached_blocks
from fastml.record import RunRecord
from fastml.planner.costs import costs
from fastml.planner.hardware import load_machine
from fastml.planner.memory import group_params, placement
from fastml.planner.search import Problem, evaluate
from fastml.planner.simulate import simulate

TIME_BOUNDS = {"forward": (0.3, 4.0), "compute": (0.5, 4.0), "cpu_optimizer": (0.5, 4.0), "transfer": (0.5, 8.0),
               "layer_overhead_s": (0.0, 0.05), "step_overhead_s": (0.0, 5.0)}
MEMORY_BOUNDS = {"compiled_activations": (0.2, 1.5), "fragmentation": (0.0, 0.5)}
FIT_ROUNDS = 3
MODEL_VERSION = 9
"""The version of the time and memory models (costs.py, memory.py, simulate.py) that a calibration is fitted to.
Bump it with any change that moves predictions (tests/test_calibrate.py pins this version's): a profile
calibrated before the change is then said to be stale, since its terms correct the old model's errors (issue 11:
an old fit's compiled_activations of 0.81 discounted FFN tensors the new model no longer counted, and the plan
made with it ran out of memory). Version 1 is the first kept: it calls every earlier calibration stale, though
some were fitted to the same models, since nothing tells them apart. Version 2: the host's time (a profile's
host_overhead) paces the passes where it is the longer, and the step's host work follows its optimizer step.
Version 3: a chunked LM head's matmuls at a chunk's tokens, its recomputed forward tensors, its weight gradient
added up chunk by chunk and the aten ops of each chunk; a GEMM takes at least the time of its operands' bytes.
Version 4: attention at few sequences slower (the profile's attention_half_rate_tiles); a gradient's accumulation
reads both operands. Version 5: a chunked LM head's backward pass holds three weight-sized gradients at once, a
block's backward pass the gradients it makes (memory.block_backward_workspace_bytes) rather than a layer's
activations, and the loss's phase not the buffers that stream gradients to the host. Version 6: the LM head makes its
gradients in its forward pass with a fused cross-entropy (executor/model/loss.py): three matmuls a slice, none
recomputed, three passes over a bf16 logit, and one weight gradient at its peak. Version 7: fp8's casts of
SwiGLU's output and of gate_up's output gradient skip their absolute maximum's read (SwiGLU's kernels take it).
Version 8: a CPU step's inputs on the GPU come down only once the CPU has stepped the group before (it waits for
each slice it copies), not all ahead of it. Version 9: the GPU's peak is that of the step's phase where its
tensors add up to most (the loss, a block's backward pass, the embedding's, the optimizer step), each holding what
the executor holds then, not every tensor of every phase at once (memory._phases)."""


@dataclass(frozen=True)
class Fit:
    """One record's step time and peak GPU memory: measured, and predicted before and after calibration."""

    name: str
    measured_step_s: float
    before_step_s: float
    after_step_s: float
    measured_peak_bytes: int | None
    before_peak_bytes: int
    after_peak_bytes: int

    @property
    def step_errors(self) -> tuple[float, float]:
        return self.before_step_s / self.measured_step_s - 1, self.after_step_s / self.measured_step_s - 1

    @property
    def peak_errors(self) -> tuple[float, float] | None:
        measured = self.measured_peak_bytes
        return (self.before_peak_bytes / measured - 1, self.after_peak_bytes / measured - 1) if measured else None


def check_machine(records: dict[str, RunRecord], profile: dict) -> None:
    """Every record ran on the machine `profile` describes: the GPU it names, or for a CPU profile its CPU."""
    parsed = parse_profile(profile, profile.get("name", "profile"))
    for name, record in records.items():
        m = record.machine
        if m.device != parsed.device:
            fail(name, f"ran on a {m.device.upper()}, but {parsed.name} is a {parsed.device.upper()} profile")
        known = parsed.device_names if parsed.device == "cuda" else [profile.get("measured", {}).get("key", {})
                                                                      .get("cpu")]
        if m.device_name not in known:
            fail(name, f"ran on {m.device_name!r} (host {m.host}), not on the machine of profile {parsed.name} "
                       f"({', '.join(filter(None, known)) or 'no device named'}); calibrate each machine's profile "
                       f"with its own runs")


def calibrate(records: dict[str, RunRecord], profile: dict,
              held: frozenset[str] = frozenset()) -> tuple[dict, list[Fit]]:
    """`profile` (a profile's JSON) with its calibration fitted to `records` (by name), and each record's fit; the
    time terms named in `held` stay at 1 (no correction)."""
    if not records:
        fail("calibrate", "give at least one run record")
    check_machine(records, profile)
    base = with_calibration(profile, Calibration())
    before = {name: _predict(r.plan, base) for name, r in records.items()}
    time_terms = {name: getattr(Calibration(), name) for name in TIME_BOUNDS}
    for _ in range(FIT_ROUNDS):  # overlap makes the waits on transfers change with the terms: linearize again
        now = with_calibration(profile, Calibration(**time_terms))
        time_terms = _fit_time(records, {name: _predict(r.plan, now) for name, r in records.items()}, time_terms,
                               held)
    terms = time_terms | _fit_memory(records, before)
    fitted = with_calibration(profile, Calibration(**terms, records=len(records), model_version=MODEL_VERSION))
    fits = []
    for name, record in records.items():
        after = _predict(record.plan, fitted)
        fits.append(Fit(name, record.measured.step_time_s, before[name].step_s, after.step_s,
                        record.measured.peak_memory_bytes, before[name].peak_bytes, after.peak_bytes))
    return fitted, fits


def stale_calibration(calibration: Calibration, profile: str) -> str | None:
    """What to say of a calibration fitted to another version of the models than this fastml's, else None."""
    if not calibration.records or calibration.model_version == MODEL_VERSION:
        return None
    fitted_by = f"version {calibration.model_version}" if calibration.model_version else "an unversioned one"
    return (f"{profile}'s calibration was fitted to {fitted_by} of the planner's models, this fastml's is version "
            f"{MODEL_VERSION}: its predictions may be off, and a plan near the memory limit may not fit; "
            f"`fastml calibrate` the run directories it was fitted to again (they need not run again)")


def with_calibration(profile: dict, calibration: Calibration) -> dict:
    data = copy.deepcopy(profile)
    data["calibration"] = to_dict(calibration)
    return data


@dataclass(frozen=True)
class _Prediction:
    step_s: float
    time_s: dict[str, float]
    peak_bytes: int
    activations_compiled: int
    """Activation bytes counted for compiled blocks (0 where the plan does not compile)."""
    passes: int
    """Passes of a block or the head in a step: what layer_overhead_s multiplies."""
    forward_s: float
    """The blocks' forward passes and recomputation in a step, as they were predicted."""
    forward_passes: int
    cpu_step_s: float
    """The CPU's optimizer steps, as they were predicted (they follow the backward pass, exposed; overlapped with the
    next step, the time the GPU waits for them, taken as proportional to them as well)."""


def _predict(plan: Plan, profile: dict) -> _Prediction:
    h, t, k = plan.hardware, plan.training, plan.knobs
    machine = load_machine(profile, num_gpus=h.gpus_per_node, num_nodes=max(1, h.num_gpus // h.gpus_per_node),
                           gpu_memory=h.gpu_memory_bytes or None, host_memory=h.host_memory_bytes or None)
    candidate = evaluate(Problem(plan.model, t.seq_len, t.global_batch_tokens, machine), k)
    # The plan ran: it is simulated even where the memory model (with terms being fitted) says it would not fit.
    simulation = candidate.simulation or simulate(plan.model, t.seq_len, k, machine)
    forward_passes = k.grad_accum_steps * plan.model.num_layers * (1 + bool(k.recompute))
    passes = forward_passes + k.grad_accum_steps * (plan.model.num_layers + 1)
    c = costs(plan.model, t.seq_len, k, machine)
    uncached = plan.model.num_layers - len(fp8_cached_blocks(k, plan.model.num_layers, h.num_gpus))
    forward_s = k.grad_accum_steps * (plan.model.num_layers * c.layer_forward +
                                      uncached * c.layer_weight_cast_forward) + simulation.time_s["recompute"]
    groups = group_params(plan.model)
    shard = h.num_gpus if k.shard_optimizer else 1
    cpu_step_s = sum(groups[g] for g in placement(plan.model, k).cpu_steps) / shard * c.cpu_adam_per_param
    if k.overlap_cpu_step:  # only what the GPU waits for is in the step: the step less that of an instant CPU step
        instant = dataclasses.replace(machine, node=dataclasses.replace(machine.node, cpu_adam_params_per_s=math.inf))
        cpu_step_s = simulation.step_time_s - simulate(plan.model, t.seq_len, k, instant).step_time_s
    compiled = candidate.memory.peak_phase["activations"] if k.compile else 0
    return _Prediction(simulation.step_time_s, simulation.time_s, candidate.memory.gpu_peak, compiled, passes,
                       forward_s, forward_passes, cpu_step_s)


def _fit_time(records: dict[str, RunRecord], predicted: dict[str, _Prediction], terms: dict[str, float],
              held: frozenset[str] = frozenset()) -> dict[str, float]:
    """Measured step = forward x (the blocks' forward passes) + compute x (the GPU's other work) + cpu_optimizer x
    (the CPU's optimizer steps) + transfer x (waits on copies and collectives) + layer_overhead_s x passes +
    step_overhead_s + the rest, in relative terms;
    the uncalibrated parts taken from a prediction made with `terms`."""
    from scipy.optimize import lsq_linear

    rows, target = [], []
    for name, record in records.items():
        p, measured = predicted[name], record.measured.step_time_s
        s, overhead = p.time_s, terms["layer_overhead_s"]
        forward = (p.forward_s - overhead * p.forward_passes) / terms["forward"]
        other_work = (s["compute"] + s["recompute"] + s["optimizer"] - p.forward_s - p.cpu_step_s -
                      overhead * (p.passes - p.forward_passes)) / terms["compute"]
        cpu_step = p.cpu_step_s / terms["cpu_optimizer"]
        waits = (s["exposed_comm"] + s["exposed_offload"]) / terms["transfer"]
        rest = s["other"] - terms["step_overhead_s"]
        rows.append(np.array([forward, other_work, cpu_step, waits, p.passes, 1.0]) / measured)
        target.append(1.0 - rest / measured)
    bounds = np.array([(terms[name], terms[name] + 1e-12) if name in held else TIME_BOUNDS[name]
                       for name in TIME_BOUNDS]).T
    matrix = np.array(rows)
    solution = lsq_linear(matrix, np.array(target), bounds=(bounds[0], bounds[1])).x
    # A term no record tells (no CPU optimizer step, no exposed copy among them) keeps the value it had.
    return {name: float(value) if matrix[:, i].any() else terms[name]
            for i, (name, value) in enumerate(zip(TIME_BOUNDS, solution))}


def _fit_memory(records: dict[str, RunRecord], before: dict[str, _Prediction]) -> dict[str, float]:
    """Measured peak = (predicted peak + (compiled_activations - 1) x compiled activations) x (1 + fragmentation)
    (memory.py), which is linear in 1 / (1 + fragmentation) and compiled_activations - 1 once divided by the
    latter factor. Fitted by least squares, then `fragmentation` raised until no record is predicted below its
    measured peak: a plan is fitted under a memory cap by this prediction, and one predicted low runs out of memory
    where one predicted high only leaves some of the cap unused. Records without a GPU peak (a CPU's) leave both
    terms as they are."""
    from scipy.optimize import lsq_linear

    rows, target = [], []
    for name, record in records.items():
        measured, p = record.measured.peak_memory_bytes, before[name]
        if measured:  # peak / measured = 1 / (1 + f) - (a - 1) x compiled / measured, relative to each record
            rows.append([1.0, -p.activations_compiled / measured])
            target.append(p.peak_bytes / measured)
    if not rows:
        return {name: getattr(Calibration(), name) for name in MEMORY_BOUNDS}
    rows, target = np.array(rows), np.array(target)
    (a_low, a_high), (f_low, f_high) = MEMORY_BOUNDS["compiled_activations"], MEMORY_BOUNDS["fragmentation"]
    inverse, a_less_1 = lsq_linear(rows, target, bounds=([1 / (1 + f_high), a_low - 1],
                                                         [1 / (1 + f_low), a_high - 1])).x
    a = a_less_1 + 1 if rows[:, 1].any() else Calibration().compiled_activations  # no record compiles: stays 1
    # Each record's prediction without fragmentation, over its measurement: the lowest sets it.
    unfragmented = target - (a - 1) * rows[:, 1]
    f = min(f_high, max(1 / inverse - 1, float(np.max(1 / unfragmented)) - 1))
    return {"compiled_activations": float(a), "fragmentation": float(f)}

