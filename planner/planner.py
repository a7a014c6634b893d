"""`fastml plan` as a function: a model, a sequence length and a batch, on a machine, to the fastest plan that fits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastml import hwprofiles
from fastml.config import UserError, check_range, fail, from_dict
from fastml.plan import Hardware, Knobs, Plan, Predicted, Training, parse_assignment, with_overrides
from fastml.planner.hardware import has_gpu, load_machine
from fastml.planner.search import (HOST_USABLE_FRACTION, Candidate, Problem, evaluate, knob_space, make_knobs,
                                   pin, search, smallest_choice)
from fastml.spec import ModelSpec, resolve_model

TINY_SEQ_LEN = 256
DEFAULT_SEQ_LEN = 2048
SEQUENCES_PER_STEP = 16
DEFAULT_TRIALS = 300


class NoFeasiblePlan(UserError):
    """Nothing fits: the message says what does not fit, by how much, and what would make it fit."""


@dataclass
class Planned:
    plan: Plan
    runners_up: list[Plan]
    lower_precision: bool
    """Whether the plan needed the lower-precision knobs (fp8, bf16 optimizer states or master weights)."""


def make_plan(model: str = "tiny", seq_len: int | None = None, global_batch_tokens: int | None = None,
              steps: int = 100, data: str = "default", hw: str | None = None, gpus: int | None = None,
              nodes: int | None = None, gpu_mem: str | None = None, host_mem: str | None = None,
              device: str | None = None, trials: int = DEFAULT_TRIALS, study: str | None = None,
              lower_precision: bool | None = None, overrides: list[str] = (), on_trial=None) -> Planned:
    """Plans `model` on `hw` (a profile name or JSON file; default: this machine, whose plans keep to the knobs
    the executor runs). `overrides` are SECTION.FIELD=VALUE pins; lower_precision None tries full precision
    first and allows fp8 and bf16 states only if nothing fits without them."""
    spec = resolve_model(model)
    seq_len = seq_len or (TINY_SEQ_LEN if spec.name == "tiny" else DEFAULT_SEQ_LEN)
    check_range("--seq", seq_len, 1)
    here = hw is None
    if here:
        hw, gpus = _detect(device, gpus)
    if not has_gpu(hw):
        return Planned(_cpu_plan(spec, seq_len, global_batch_tokens, steps, data, overrides), [], False)
    machine = load_machine(hw, gpus, nodes, gpu_mem, host_mem)
    global_batch_tokens = global_batch_tokens or SEQUENCES_PER_STEP * seq_len * machine.num_gpus
    problem = Problem(spec, seq_len, _check_batch(global_batch_tokens, seq_len, machine.num_gpus), machine)
    knob_pins, other = _split_overrides(overrides, problem.sequences_per_gpu)
    attempts = [False, True] if lower_precision is None else [lower_precision]
    for lower in attempts:
        space = pin(knob_space(problem, runnable_only=here, lower_precision=lower), knob_pins)
        ranked = search(problem, space, trials, storage=_storage(study), on_trial=on_trial,
                        study_name=_study_name(problem, here, lower))
        feasible = [c for c in ranked if c.feasible]
        if feasible:
            plans = [_assemble(problem, c, steps, data) for c in feasible[:4]]
            return Planned(with_overrides(plans[0], other), plans[1:], lower)
    raise NoFeasiblePlan(infeasible_message(problem, space))


def replan(plan: Plan, hw: str | None = None) -> tuple[Candidate, Problem]:
    """The memory and simulation of an existing plan's knobs, on the hardware it names or the profile file `hw`
    (`fastml explain`)."""
    h = plan.hardware
    if hw is None and h.profile not in hwprofiles.names():
        fail("hardware.profile", f"{h.profile!r} is not a shipped profile; give the profile file the plan was made "
                                 f"with: fastml explain PLAN --hw FILE")
    machine = load_machine(hw or h.profile, num_gpus=h.gpus_per_node, num_nodes=max(1, h.num_gpus // h.gpus_per_node),
                           gpu_memory=h.gpu_memory_bytes or None, host_memory=h.host_memory_bytes or None)
    problem = Problem(plan.model, plan.training.seq_len, plan.training.global_batch_tokens, machine)
    return evaluate(problem, plan.knobs), problem


def predicted(problem: Problem, candidate: Candidate) -> Predicted:
    sim, machine = candidate.simulation, problem.machine
    tokens_per_s = problem.global_batch_tokens / sim.step_time_s
    peak = machine.gpu.peak_flops_for(candidate.knobs.matmul_dtype)
    hours_per_million = 1e6 / tokens_per_s / 3600
    return Predicted(
        step_time_s=sim.step_time_s, tokens_per_s=tokens_per_s,
        mfu=problem.spec.flops_per_token(problem.seq_len) * tokens_per_s / (peak * machine.num_gpus),
        peak_memory_bytes=candidate.memory.gpu_total, memory_bytes=candidate.memory.gpu,
        host_memory_bytes=candidate.memory.host, time_s=sim.time_s,
        usd_per_million_tokens=machine.usd_per_gpu_hour * machine.num_gpus * hours_per_million,
        kwh_per_million_tokens=machine.watts_per_gpu * machine.num_gpus / 1000 * hours_per_million)


def infeasible_message(problem: Problem, space: dict) -> str:
    """What does not fit, by how much, and what would make it fit: judged on the plan that needs the least GPU
    memory (everything offloaded, sharded and recomputed that the space allows)."""
    m, spec = problem.machine, problem.spec
    smallest = evaluate(problem, make_knobs(problem, smallest_choice(space)))
    parts = []
    if smallest.gpu_over_bytes > 0:
        parts.append(f"GPU memory: the smallest plan needs {_gib(smallest.memory.gpu_total)} per GPU, "
                     f"{_gib(smallest.gpu_over_bytes)} more than the {_gib(problem.gpu_budget())} usable on "
                     f"{m.profile}")
    if smallest.host_over_bytes > 0:
        parts.append(f"host memory: it needs {_gib(smallest.memory.host_total)} per node, "
                     f"{_gib(smallest.host_over_bytes)} more than the {_gib(problem.host_budget())} usable")
    hints = [f"--host-mem {_gib(smallest.memory.host_total / HOST_USABLE_FRACTION)}"] \
        if smallest.host_over_bytes > 0 else []
    hints.append("more GPUs (--gpus/--nodes: sharding spreads the model states)")
    if problem.seq_len > 256:
        hints.append(f"a shorter sequence (--seq {problem.seq_len // 2})")
    lower = " even with fp8 matmuls and bf16 optimizer states" if len(space.get("optimizer_dtype", ())) > 1 else ""
    return (f"no feasible plan for {spec.name} (seq {problem.seq_len}) on {m.num_gpus} x {m.profile}{lower}: "
            f"{'; '.join(parts)}. It might fit with: {', or '.join(hints)}")


def _detect(device: str | None, gpus: int | None) -> tuple[str, int | None]:
    """This machine's profile: the GPU's (all of them unless `gpus`), or the CPU."""
    if device not in (None, "cpu", "cuda"):
        fail("--device", f"{device!r} is not allowed; choose one of 'cpu', 'cuda'")
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        return "cpu", None
    if not torch.cuda.is_available():
        fail("--device", "'cuda' was asked for, but this machine has no CUDA GPU")
    name = torch.cuda.get_device_name(0)
    profile = hwprofiles.for_device_name(name)
    if profile is None:
        fail("--hw", f"no shipped profile for the GPU {name!r}; run `fastml profile -o my.json` and plan with "
                     f"--hw my.json, or pass --hw with the nearest of {', '.join(hwprofiles.names())}")
    return profile, gpus or 1  # the executor trains on one device so far


def _cpu_plan(spec: ModelSpec, seq_len: int, global_batch_tokens: int | None, steps: int, data: str,
              overrides: list[str]) -> Plan:
    """On a CPU there is no rate to simulate against: every sequence of a step goes into one micro-batch."""
    global_batch_tokens = _check_batch(global_batch_tokens or SEQUENCES_PER_STEP * seq_len, seq_len, 1)
    sequences = global_batch_tokens // seq_len
    knob_pins, other = _split_overrides(overrides, sequences)
    micro = knob_pins.pop("micro_batch_size", sequences)
    knobs = from_dict(Knobs, {**knob_pins, "micro_batch_size": micro, "grad_accum_steps": sequences // micro},
                      "knobs")
    plan = Plan(model=spec, hardware=Hardware(profile="cpu", fingerprint=hwprofiles.fingerprint("cpu")),
                training=_training(spec, seq_len, global_batch_tokens, steps, data), knobs=knobs)
    return with_overrides(plan, other)


def _assemble(problem: Problem, candidate: Candidate, steps: int, data: str) -> Plan:
    m = problem.machine
    hardware = Hardware(profile=m.profile, fingerprint=m.fingerprint, device="cuda", num_gpus=m.num_gpus,
                        gpus_per_node=m.gpus_per_node, gpu_memory_bytes=m.gpu.memory_bytes,
                        host_memory_bytes=m.node.host_memory_bytes)
    return Plan(model=problem.spec, hardware=hardware, knobs=candidate.knobs,
                training=_training(problem.spec, problem.seq_len, problem.global_batch_tokens, steps, data),
                predicted=predicted(problem, candidate))


def _training(spec: ModelSpec, seq_len: int, global_batch_tokens: int, steps: int, data: str) -> Training:
    return Training(seq_len=seq_len, global_batch_tokens=global_batch_tokens, steps=steps, data=data,
                    lr=1e-3 if spec.name == "tiny" else 3e-4, warmup_steps=min(10, steps))


def _check_batch(global_batch_tokens: int, seq_len: int, num_gpus: int) -> int:
    check_range("--global-batch-tokens", global_batch_tokens, 1)
    if global_batch_tokens % (seq_len * num_gpus):
        fail("--global-batch-tokens", f"{global_batch_tokens} must be a multiple of the sequence length {seq_len} "
                                      f"x {num_gpus} GPU(s) = {seq_len * num_gpus}")
    return global_batch_tokens


def _split_overrides(overrides, sequences_per_gpu: int) -> tuple[dict, list[str]]:
    """knobs.* pins, checked, and the other SECTION.FIELD=VALUE assignments."""
    pins, other = {}, []
    for assignment in overrides:
        section, name, value = parse_assignment(assignment)
        if section == "knobs":
            pins[name] = value
        else:
            other.append(assignment)
    if "grad_accum_steps" in pins:
        fail("knobs.grad_accum_steps", "follows from the batch and micro_batch_size; pin micro_batch_size instead")
    micro = from_dict(Knobs, pins, "knobs").micro_batch_size  # raises a UserError naming a bad knob
    if sequences_per_gpu % micro:
        fail("knobs.micro_batch_size", f"{micro} must divide the {sequences_per_gpu} sequences of a step (per GPU)")
    return pins, other


def _storage(study: str | None) -> str | None:
    return f"sqlite:///{study}" if study else None


def _study_name(problem: Problem, here: bool, lower: bool) -> str:
    m = problem.machine
    return (f"{problem.spec.name}|seq{problem.seq_len}|gbt{problem.global_batch_tokens}|{m.num_gpus}x{m.profile}"
            f"|{m.fingerprint}|{'runnable' if here else 'all'}|{'lower' if lower else 'full'}")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f}GiB"
