"""`fastml plan` as a function: a model, a sequence length and a batch, on a machine, to the fastest plan that fits."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass

from fastml import hwprofiles
from fastml.layout import interleaved_rounds
from fastml.config import UserError, as_type, check_range, fail, from_dict, gib, to_dict
from fastml.plan import (KNOBS, ZERO_STAGES, Hardware, Knobs, Plan, Predicted, Training, check_init_from, check_knob,
                         parse_assignment, with_overrides)
from fastml.hwprofiles.between_gpus import peer_access
from fastml.planner.calibrate import stale_calibration
from fastml.planner.costs import costs
from fastml.planner.explain import layout_reason, limit
from fastml.planner.hardware import Machine, check_cpu_options, load_machine, parse_bytes
from fastml.planner.memory import Memory, memory
from fastml.planner.parallel import view
from fastml.hwprofiles.profile import measure_on_first_use, this_cpu_profile
from fastml.planner.request import DEFAULT_MODEL, SEQUENCES_PER_STEP, PlanRequest
from fastml.planner.pins import Device, checked_pins, pinned_space
from fastml.planner.search import (HOST_USABLE_FRACTION, MAX_MICRO_BATCH, Candidate, Problem, evaluate, knob_space,
                                   make_knobs, rank, search, smallest_choice, space_size, tokens_per_s)
from fastml.spec import PRESETS, ModelSpec, resolve_model
from fastml.weights import check_same_model, spec_of_weights


class NoFeasiblePlan(UserError):
    """Nothing fits: the message says what does not fit, by how much, and what would make it fit."""


@dataclass
class Planned:
    plan: Plan
    runners_up: list[Plan]
    lower_precision: bool
    """Whether the plan needed the lower-precision knobs (fp8, bf16 optimizer states or master weights)."""
    limit: str
    """What limits the plan: compute, memory, PCIe or the network (planner/explain.py)."""
    stale_calibration: str | None = None
    """What to say where the profile's calibration was fitted to other models than this fastml's."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the request's flags mean on this hardware, where that is not what they say."""


# A CPU trains as the executor's CPU path does: fp32 parameters and matmuls, eager (pins of the user come first).
CPU_KNOBS = {"param_dtype": "fp32", "matmul_dtype": "fp32", "compile": False}
CPU_DTYPES = (CPU_KNOBS["matmul_dtype"],)
"""The matmul dtypes of a CPU profile (hwprofiles/profile.py measures its fp32 peak alone)."""


def make_plan(request: PlanRequest | None = None, /, on_trial=None, **fields) -> Planned:
    """The fastest plan that fits for `request` (or a PlanRequest of `fields`); `on_trial(done, trials, best)` is
    called after each search trial (`_search`: the trials done of the search's `trials`, and the best tokens/s so
    far, 0 while nothing fits; counted afresh where nothing fit and lower precision is searched). What the request
    asks is checked before this machine's CPU is measured or anything is searched."""
    r = dataclasses.replace(request or PlanRequest(), **fields)
    spec, init_from = requested_model(r)
    spec = reshaped_model(spec, r.overrides)
    seq_len = r.seq_len_for(spec.name)
    check_range("--seq", seq_len, 1)
    here = r.hw is None
    target = _this_machine(r, spec, seq_len) if here else _named_machine(r, spec, seq_len)
    device = target.device
    global_batch_tokens = _check_batch(r.global_batch_tokens or SEQUENCES_PER_STEP * seq_len * device.num_gpus,
                                       seq_len, device.num_gpus)
    sequences_per_gpu = global_batch_tokens // (seq_len * device.num_gpus)
    knob_pins, other = _split_overrides(r.overrides, sequences_per_gpu)
    cpu = device.kind == "cpu"
    fixed = checked_pins(knob_pins, spec, seq_len, device, CPU_KNOBS if cpu else {})
    _check_overrides(other, spec, seq_len, global_batch_tokens, device, r)
    notes = [*target.notes, *(["--lower-precision: a CPU trains in fp32 (the executor's CPU path), so there is "
                               "nothing lower to search"] if cpu and r.lower_precision else [])]
    machine = target.machine_for(sequences_per_gpu)
    problem = Problem(spec, seq_len, global_batch_tokens, machine, layouts=not here)
    attempts = [False] if cpu else [False, True] if r.lower_precision is None else [r.lower_precision]
    for lower in attempts:
        ranked, space = _search(problem, fixed, lower, r, on_trial)
        feasible = [c for c in ranked if c.feasible]
        if feasible:
            plans = [_assemble(problem, c, r.steps, r.data, init_from) for c in feasible[:4]]
            plan = with_overrides(plans[0], other)
            if plan.training.eval_tokens != plans[0].training.eval_tokens:  # --set it: priced again
                plan = dataclasses.replace(plan, predicted=dataclasses.replace(
                    plan.predicted, eval_time_s=eval_time_s(problem, plan.knobs, plan.training.eval_tokens)))
            check_init_from(plan)  # against the model as --set left it
            reason = layout_reason(problem, ranked)
            return Planned(plan, plans[1:], lower, limit(problem, feasible[0]),
                           stale_calibration(machine.calibration, machine.profile), notes + [reason] * bool(reason))
    raise NoFeasiblePlan(infeasible_message(problem, space))


LAYOUT_KNOBS = ("tensor_parallel", "sequence_parallel", "pipeline_parallel", "pipeline_schedule", "virtual_stages")
LAYOUT_SIZE_KNOBS = ("tensor_parallel", "pipeline_parallel")
DATA_PARALLEL_TRIALS = 0.5
"""The data-parallel search's trials, as a share of --trials (`_search`; all of them where they enumerate its space):
its space lacks the layout knobs. At half, the fastest plans found for the 8B on one node, the 70B on 1,024 GPUs and
the 72B on 32 were as fast as at the whole, and so were the data-parallel plans the 70B's and 72B's layouts were
weighed against (benchmarks/NOTES.md, issue 28 part 8); the two searches took a quarter less time."""


def _search(problem: Problem, fixed: dict, lower: bool, r: PlanRequest,
            on_trial) -> tuple[list[Candidate], dict[str, tuple]]:
    """The search's candidates, ranked, and its space. Where it weighs layouts and none is pinned, it searches data
    parallelism alone apart from them: the fastest data-parallel plans differ from the layouts' in most knobs (the
    recompute, offload and ZeRO stage a layout no longer needs), and the layouts' search, which starts from each
    layout's footholds (planner/search.py `_core_leaders`), seldom reaches them: without it, the plan's note priced
    a 72B's pipeline against data-parallel plans 1.2x slower than this search finds. That search takes
    DATA_PARALLEL_TRIALS of the trials. `on_trial` counts the trials of both as one search's (a search that
    enumerates its space runs no more trials than it has plans; a resumed --study enumerates only those it lacks, and
    the count then ends short of its total)."""
    space = whole_rounds(pinned_space(knob_space(problem, lower_precision=lower), fixed, problem.spec), problem)
    searches = [(space, "", r.trials)]
    if not set(fixed) & set(LAYOUT_KNOBS) and any(len(space.get(n, ())) > 1 for n in LAYOUT_SIZE_KNOBS):
        flat = {name: choices for name, choices in space.items() if name not in LAYOUT_KNOBS}
        flat_size = space_size(flat)
        flat_trials = flat_size if flat_size <= r.trials else math.ceil(r.trials * DATA_PARALLEL_TRIALS)
        searches = [(flat, "-data-parallel", flat_trials), (space, "-layouts", r.trials)]
    total = sum(min(trials, space_size(searched)) for searched, _, trials in searches)
    before, last, best, ranked = 0, 0, 0.0, []  # the trials of the searches before this one, this one's last

    def reported(trial: int, search_best: float) -> None:
        nonlocal last
        last = trial
        if on_trial:
            on_trial(before + trial, total, max(best, search_best))
    for searched, suffix, trials in searches:
        ranked += search(problem, searched, trials, storage=_storage(r.study), on_trial=reported,
                         study_name=_study_name(problem, r.hw is None, lower) + suffix)
        before, last, best = before + last, 0, max([best, *(tokens_per_s(problem, c) for c in ranked)])
    return rank(problem, list({c.knobs: c for c in ranked}.values())), space


def whole_rounds(space: dict[str, tuple], problem: Problem) -> dict[str, tuple]:
    """The micro-batch sizes whose micro-batches a pinned interleaved 1F1B runs in whole rounds (fastml.layout)."""
    if space.get("pipeline_schedule") != ("interleaved_1f1b",):
        return space
    pipeline = space["pipeline_parallel"][0]
    sequences = problem.sequences_per_gpu * space["tensor_parallel"][0] * pipeline

    def whole(micro: int) -> bool:
        micro_batches = sequences // micro
        return micro_batches % interleaved_rounds(pipeline, micro_batches) == 0
    sizes = tuple(m for m in space["micro_batch_size"] if whole(m))
    if not sizes:
        fail("knobs.pipeline_schedule", f"interleaved 1F1B runs whole rounds of micro-batches, and no micro-batch size "
                                        f"of the {sequences} sequences of a data-parallel rank makes them")
    return space | {"micro_batch_size": sizes}


def requested_model(r: PlanRequest) -> tuple[ModelSpec, str]:
    """The model to plan and the weights its run starts from (an absolute path; "" for random ones), checked against
    each other before any search: those of --init-from (or --set training.init_from), whose model is planned unless
    --model names one, which must be the same; else an HF model directory's own; else none."""
    init_from = next((value for section, name, value in map(parse_assignment, reversed(r.overrides))
                      if (section, name) == ("training", "init_from")), r.init_from)
    model = r.model or DEFAULT_MODEL
    if init_from is None:  # --model's own weights, where it names an HF model directory (the spec's name)
        spec = resolve_model(model)
        return spec, "" if model in PRESETS else os.path.abspath(spec.name)
    if not init_from:
        return resolve_model(model), ""
    held = spec_of_weights(init_from, "--init-from")
    if r.model is None:
        return held, os.path.abspath(init_from)
    spec = resolve_model(r.model)
    check_same_model(held, spec, init_from, "--init-from")
    return spec, os.path.abspath(init_from)


def reshaped_model(spec: ModelSpec, overrides: list[str]) -> ModelSpec:
    """`spec` with the request's `--set model.*` assignments: the model that is measured for, searched and priced,
    not only the one the plan names after the search (`--set model.num_layers=4` planned the whole 8B)."""
    data = to_dict(spec)
    for section, name, value in map(parse_assignment, overrides):
        if section == "model":
            data[name] = value
    return from_dict(ModelSpec, data, "model")


@dataclass(frozen=True)
class _Target:
    """The hardware a plan is asked for, known before this machine's CPU is measured (`device`), and how to get its
    `Machine` for the sequences one GPU (or CPU process) takes a step (`machine_for`: a CPU measures its GEMMs at the
    micro-batches they allow)."""

    device: Device
    machine_for: Callable[[int], Machine]
    notes: tuple[str, ...] = ()
    """What its flags mean on this hardware, where that is not what they say (a note to the user)."""


def _gpus(machine: Machine) -> _Target:
    return _Target(Device.of(machine), lambda sequences_per_gpu: machine)


def _check_overrides(other: list[str], spec: ModelSpec, seq_len: int, global_batch_tokens: int, device: Device,
                     r: PlanRequest) -> None:
    """The `--set` assignments of other sections than knobs, checked on a plan of this request before the search
    (the chosen plan takes them after it)."""
    sequences_per_gpu = global_batch_tokens // (seq_len * device.num_gpus)
    with_overrides(Plan(model=spec, training=_training(spec, seq_len, global_batch_tokens, r.steps, r.data, ""),
                        hardware=Hardware(device=device.kind, num_gpus=device.num_gpus,
                                          gpus_per_node=device.num_gpus // device.num_nodes),
                        knobs=Knobs(micro_batch_size=sequences_per_gpu, **CPU_KNOBS if device.kind == "cpu" else {})),
                   other)


class Replanned(typing.NamedTuple):
    candidate: Candidate
    problem: Problem
    changed: str | None
    """What to say where the profile the plan is explained with is not the one it was made with (a CPU measured
    again since, a machine profiled again, a shipped profile of another fastml)."""


def replan(plan: Plan, hw: str | None = None) -> Replanned:
    """The memory and simulation of an existing plan's knobs, on the hardware it names or the profile file `hw`
    (`fastml explain`): a plan for a CPU with this machine's CPU profile, one made with this machine's measured GPU
    profile with that profile, as they are now."""
    h, t = plan.hardware, plan.training
    cpu = h.device == "cpu"
    if hw in (None, "cpu") and cpu:  # this CPU, measured for the plan's model, sequence and processes
        hw = _this_cpu_profile(plan.model, t.seq_len, t.global_batch_tokens // (t.seq_len * h.num_gpus), h.num_gpus)
    elif hw is None and h.profile not in hwprofiles.names():
        hw = _measured_here()
        if hw is None:
            fail("hardware.profile", f"{h.profile!r} is neither a shipped profile nor this machine's measured one; "
                                     f"give the profile file the plan was made with: fastml explain PLAN --hw FILE")
    machine = load_machine(hw or h.profile, num_gpus=h.gpus_per_node,
                           num_nodes=None if cpu else max(1, h.num_gpus // h.gpus_per_node),
                           gpu_memory=h.gpu_memory_bytes or None, host_memory=h.host_memory_bytes or None)
    problem = Problem(plan.model, t.seq_len, t.global_batch_tokens, machine)
    changed = None
    if h.fingerprint and h.fingerprint != machine.fingerprint:
        again = "this CPU has been measured again" if cpu else "the profile has changed"
        changed = (f"the plan was made with {h.profile} as it was then (fingerprint {h.fingerprint}); {again} since "
                   f"({machine.fingerprint}), and the plan is simulated with it as it is now")
    return Replanned(evaluate(problem, plan.knobs), problem, changed)


def predicted(problem: Problem, candidate: Candidate, eval_tokens: int = Training().eval_tokens) -> Predicted:
    sim, machine = candidate.simulation, problem.machine
    tokens_per_s = problem.global_batch_tokens / sim.step_time_s
    peak = machine.gpu.peak_flops_for(candidate.knobs.matmul_dtype)
    hours_per_million = 1e6 / tokens_per_s / 3600
    return Predicted(
        step_time_s=sim.step_time_s, tokens_per_s=tokens_per_s,
        mfu=problem.spec.flops_per_token(problem.seq_len) * tokens_per_s / (peak * machine.num_gpus),
        peak_memory_bytes=candidate.memory.gpu_peak, memory_bytes=candidate.memory.gpu,
        host_memory_bytes=candidate.memory.host, time_s=sim.time_s,
        usd_per_million_tokens=machine.usd_per_gpu_hour * machine.num_gpus * hours_per_million,
        kwh_per_million_tokens=machine.watts_per_gpu * machine.num_gpus / 1000 * hours_per_million,
        eval_time_s=eval_time_s(problem, candidate.knobs, eval_tokens))


def eval_time_s(problem: Problem, knobs: Knobs, eval_tokens: int) -> float:
    """One evaluation of the validation loss: each rank's whole micro-batches of `eval_tokens`, at least one (as
    executor/loop/evaluate.py rounds), at the step's price of a forward pass (the blocks', and a third of the head's
    forward and backward). The planner does not read the data (fastml/ is all it shares with the executor): a
    validation split smaller than eval_tokens evaluates fewer. What a streamed or sharded plan's forward pass waits on
    copies and gathers is not counted; nor, with tensor or pipeline parallelism, their collectives and the pipeline's
    filling (a GPU's blocks are priced as its slice of the model: planner/parallel.py `view`)."""
    spec, machine = view(problem.spec, knobs, problem.machine)
    c = costs(spec, problem.seq_len, knobs, machine)
    per_round = knobs.micro_batch_size * problem.seq_len * machine.num_gpus
    micro_batches = max(1, eval_tokens // per_round)
    return micro_batches * (spec.num_layers * c.layer_forward + c.head_forward_backward / 3)


def infeasible_message(problem: Problem, space: dict) -> str:
    """What does not fit, by how much, and what would make it fit: judged on the plan that needs the least GPU
    memory (everything offloaded, sharded and recomputed that the space allows)."""
    m, spec = problem.machine, problem.spec
    smallest = evaluate(problem, make_knobs(problem, smallest_choice(space)))
    shorter = [f"a shorter sequence (--seq {problem.seq_len // 2})"] if problem.seq_len > 256 else []
    if m.shares_host_memory:
        return _cpu_memory_message(spec, problem.seq_len, smallest.memory, m.node.host_memory_bytes, m.num_gpus)
    parts = []
    if smallest.gpu_over_bytes > 0:
        parts.append(f"GPU memory: the smallest plan needs {gib(smallest.memory.gpu_peak)} per GPU, "
                     f"{gib(smallest.gpu_over_bytes)} more than the {gib(problem.gpu_budget())} usable on "
                     f"{m.profile}")
    if smallest.host_over_bytes > 0:
        parts.append(f"host memory: it needs {gib(smallest.memory.host_total)} per node, "
                     f"{gib(smallest.host_over_bytes)} more than the {gib(problem.host_budget())} usable")
    hints = [f"--host-mem {gib(smallest.memory.host_total / HOST_USABLE_FRACTION)}"] \
        if smallest.host_over_bytes > 0 else []
    hints += ["more GPUs (--gpus/--nodes: sharding spreads the model states)", *shorter]
    lower = " even with bf16 optimizer states and masters" if len(space.get("optimizer_dtype", ())) > 1 else ""
    if "bf16_kahan" in space.get("master_dtype", ()):
        # the searched bf16 masters keep a compensation; stochastic rounding keeps none, at some cost in loss
        hints.append("--set knobs.master_dtype=bf16 (bf16 masters without their compensation: 2 bytes a parameter "
                     "less, a few percent more loss, docs/precision.md)")
    return (f"no feasible plan for {spec.name} (seq {problem.seq_len}) on {m.num_gpus} x {m.profile}{lower}: "
            f"{'; '.join(parts)}. It might fit with: {', or '.join(hints)}")


def _cpu_memory_message(spec: ModelSpec, seq_len: int, smallest: Memory, pool_bytes: int, processes: int) -> str:
    needs, budget = processes * smallest.gpu_peak + smallest.host_total, int(pool_bytes * HOST_USABLE_FRACTION)
    hints = [f"a shorter sequence (--seq {seq_len // 2})"] if seq_len > 256 else []
    hints += ["a smaller model (--model)", "GPUs (plan for them with --hw)"]
    return (f"no feasible plan for {spec.name} (seq {seq_len}) on this CPU: the smallest plan needs {gib(needs)} "
            f"of memory, {gib(needs - budget)} more than the {gib(budget)} usable of its {gib(pool_bytes)}. It "
            f"might fit with: {', or '.join(hints)}")


def _check_cpu_memory(spec: ModelSpec, seq_len: int, sequences: int, pool_bytes: int, processes: int) -> None:
    """Before this CPU is measured for a model: whether its smallest plan (one sequence per micro-batch, blocks
    recomputed, the most LM-head chunks, the optimizer sharded over the processes) fits in the CPU's memory at all.
    The search checks every plan after."""
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=max(1, sequences // processes), recompute=("block",),
                  lm_head_chunks=max(KNOBS["lm_head_chunks"].choices),
                  **dict.fromkeys(ZERO_STAGES if processes > 1 else (), True), **CPU_KNOBS)
    smallest = memory(spec, seq_len, knobs, num_gpus=processes, gpus_per_node=processes, device="cpu")
    if processes * smallest.gpu_peak + smallest.host_total > pool_bytes * HOST_USABLE_FRACTION:
        raise NoFeasiblePlan(_cpu_memory_message(spec, seq_len, smallest, pool_bytes, processes))


def _this_cpu(r: PlanRequest, spec: ModelSpec, seq_len: int, notes: tuple[str, ...] = ()) -> _Target:
    """This machine's CPU, as one device or as `r.gpus` processes, measured for `spec` where the model can fit in its
    memory (`host_mem` caps it)."""
    check_cpu_options("detected-cpu", r.gpus, r.nodes, r.gpu_mem)
    pool = parse_bytes(r.host_mem, "--host-mem") if r.host_mem else hwprofiles.host_memory_bytes()
    processes = r.gpus or 1

    def measured(sequences_per_process: int) -> Machine:
        _check_cpu_memory(spec, seq_len, sequences_per_process * processes, pool, processes)
        return load_machine(_this_cpu_profile(spec, seq_len, sequences_per_process, processes),
                            num_gpus=processes, host_memory=pool)
    return _Target(Device("this CPU", "cpu", processes, 1, CPU_DTYPES), measured, notes)


def _this_machine(r: PlanRequest, spec: ModelSpec, seq_len: int) -> _Target:
    """This machine: its GPUs (all of them, or `r.gpus`), or its CPU, with its real memory and the links between its
    GPUs as they are (peer-to-peer access as CUDA reports it, and as NCCL_P2P_DISABLE leaves it)."""
    if r.device not in (None, "cpu", "cuda"):
        fail("--device", f"{r.device!r} is not allowed; choose one of 'cpu', 'cuda'")
    if r.nodes not in (None, 1):
        fail("--nodes", f"{r.nodes}: this machine is one node; plan for several with --hw PROFILE --nodes {r.nodes}")
    gpus_here = hwprofiles.local_gpus()
    if r.device == "cpu" or (r.device is None and gpus_here is None):
        if r.gpu_mem is not None:
            fail("--gpu-mem", "this machine has no GPU (or --device cpu): plan for other hardware with --hw")
        # Without a GPU, --gpus counts CPU processes, as with --device cpu: said, since it asked for GPUs.
        no_gpu = (f"--gpus {r.gpus}: this machine has no GPU, so the plan is for {r.gpus} CPU processes sharing its "
                  f"cores (say --device cpu to mean that; plan for GPUs with --hw PROFILE --gpus {r.gpus})",)
        return _this_cpu(r, spec, seq_len, no_gpu if r.device is None and r.gpus and r.gpus > 1 else ())
    if gpus_here is None:
        fail("--device", "'cuda' was asked for, but this machine has no CUDA GPU")
    name, present = gpus_here
    measured = hwprofiles.machine_profile(name, present)  # `fastml profile` on this machine, or its first use
    if measured is None and r.measure:
        measured = measure_on_first_use()
    profile = hwprofiles.for_device_name(name)
    if profile is None and measured is None:
        fail("--no-profile", f"no shipped profile for the GPU {name!r}: leave out --no-profile to measure this "
                             f"machine first, or pass --hw with the nearest of {', '.join(hwprofiles.names())}")
    gpus = r.gpus or present
    _check_gpu_count(gpus, present, profile or "PROFILE")
    machine = load_machine(measured or profile, gpus, None, r.gpu_mem, r.host_mem or hwprofiles.host_memory_bytes())
    p2p = machine.gpu.p2p and peer_access(gpus)
    return _gpus(dataclasses.replace(machine, gpu=dataclasses.replace(machine.gpu, p2p=p2p)))


def _measured_here() -> dict | None:
    """This machine's measured profile (`fastml profile`), if it has one."""
    gpus_here = hwprofiles.local_gpus()
    return hwprofiles.machine_profile(*gpus_here) if gpus_here is not None else None


def _check_gpu_count(gpus: int, present: int, profile: str) -> None:
    """Plans for this machine are plans it can run: more GPUs than it has are planned as other hardware (--hw),
    whose predictions need no run."""
    check_range("--gpus", gpus, 1)
    if gpus > present:
        fail("--gpus", f"{gpus}: this machine has {present} GPU(s); plan for more with --hw {profile} --gpus {gpus}")


def _named_machine(r: PlanRequest, spec: ModelSpec, seq_len: int) -> _Target:
    """A profile by name or file; "cpu" is this machine's CPU."""
    if r.hw == "cpu":
        return _this_cpu(r, spec, seq_len)
    return _gpus(load_machine(r.hw, r.gpus, r.nodes, r.gpu_mem, r.host_mem))


def cpu_profile_for(plans: list[Plan]) -> dict:
    """This CPU's profile as it is now for the shapes of `plans` (CPU plans of one process count: the shapes'
    efficiencies depend on it), to calibrate on the runs of those plans (`fastml calibrate`)."""
    counts = sorted({p.hardware.num_gpus for p in plans})
    if len(counts) > 1:
        fail("calibrate", f"the runs trained as {' and '.join(map(str, counts))} CPU processes, whose rates differ: "
                          "calibrate the runs of each count apart")
    profiles = [_this_cpu_profile(p.model, p.training.seq_len, p.training.global_batch_tokens //
                                  (p.training.seq_len * counts[0]), counts[0]) for p in plans]
    merged = profiles[-1]  # the latest measurements, with every plan's shapes (its elementwise rate the last model's)
    for table in ("gemm_shapes", "gemm_efficiency"):
        rows = {tuple(row[:-1]): row for profile in profiles for row in profile["gpu"][table]}
        merged["gpu"][table] = sorted(rows.values())
    return merged


def _this_cpu_profile(spec: ModelSpec, seq_len: int, sequences: int, processes: int) -> dict:
    """This CPU's profile for `processes` processes, with its GEMM curve over the micro-batches a plan may choose: 1
    sequence, powers of two, up to a process's whole step (or the search's largest micro-batch)."""
    largest = max(1, min(sequences, MAX_MICRO_BATCH))
    return this_cpu_profile(spec, seq_len, sorted({largest} | {2**i for i in range(7) if 2**i <= largest}),
                            processes=processes)


def _assemble(problem: Problem, candidate: Candidate, steps: int, data: str, init_from: str) -> Plan:
    m = problem.machine
    cpu = m.shares_host_memory
    hardware = Hardware(profile=m.profile, fingerprint=m.fingerprint, device=m.device, num_gpus=m.num_gpus,
                        gpus_per_node=m.gpus_per_node, gpu_memory_bytes=0 if cpu else m.gpu.memory_bytes,
                        host_memory_bytes=m.node.host_memory_bytes)
    training = _training(problem.spec, problem.seq_len, problem.global_batch_tokens, steps, data, init_from)
    return Plan(model=problem.spec, hardware=hardware, knobs=candidate.knobs, training=training,
                predicted=predicted(problem, candidate, training.eval_tokens))


def _training(spec: ModelSpec, seq_len: int, global_batch_tokens: int, steps: int, data: str,
              init_from: str) -> Training:
    return Training(seq_len=seq_len, global_batch_tokens=global_batch_tokens, steps=steps, data=data,
                    lr=1e-3 if spec.name == "tiny" else 3e-4, warmup_steps=min(10, steps), init_from=init_from)


def _check_batch(global_batch_tokens: int, seq_len: int, num_gpus: int) -> int:
    check_range("--global-batch-tokens", global_batch_tokens, 1)
    if global_batch_tokens % (seq_len * num_gpus):
        fail("--global-batch-tokens", f"{global_batch_tokens} must be a multiple of the sequence length {seq_len} "
                                      f"x {num_gpus} GPU(s) = {seq_len * num_gpus}")
    return global_batch_tokens


def _split_overrides(overrides, sequences_per_gpu: int) -> tuple[dict, list[str]]:
    """knobs.* pins, each of its knob's type (how they go together is checked with the hardware, `checked_pins`), and
    the other SECTION.FIELD=VALUE assignments."""
    pins, other = {}, []
    hints = typing.get_type_hints(Knobs)
    for assignment in overrides:
        section, name, value = parse_assignment(assignment)
        if section != "knobs":
            if (section, name) != ("training", "init_from"):  # requested_model's, made absolute
                other.append(assignment)
        elif name not in hints:
            fail(f"knobs.{name}", f"unknown key; allowed keys are {', '.join(hints)}")
        else:
            pins[name] = as_type(hints[name], value, f"knobs.{name}")
            check_knob(name, pins[name])
    if "grad_accum_steps" in pins:
        fail("knobs.grad_accum_steps", "follows from the batch and micro_batch_size; pin micro_batch_size instead")
    micro = pins.get("micro_batch_size", 1)
    if sequences_per_gpu % micro:
        fail("knobs.micro_batch_size", f"{micro} must divide the {sequences_per_gpu} sequences of a step (per GPU)")
    return pins, other


def _storage(study: str | None) -> str | None:
    return f"sqlite:///{study}" if study else None


def _study_name(problem: Problem, here: bool, lower: bool) -> str:
    m = problem.machine
    shape = hashlib.sha256(repr(problem.spec).encode()).hexdigest()[:12]  # a model cut by --set keeps its name
    return (f"{problem.spec.name}-{shape}|seq{problem.seq_len}|gbt{problem.global_batch_tokens}"
            f"|{m.num_gpus}x{m.profile}|{m.fingerprint}|{'runnable' if here else 'all'}|{'lower' if lower else 'full'}")
