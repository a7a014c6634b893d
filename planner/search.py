"""The search over knobs: memory first (cheap, analytic), then the simulated step time of what fits.

Optuna's TPE sampler explores large spaces, and a climb from its best plans of a few micro-batch sizes finishes
the search (`_polish`); a space no larger than the trial budget is enumerated exhaustively (Optuna's brute-force
sampler), so small searches are exact. Studies can live in SQLite to resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

# At import, not in `search`: optuna keeps the error of an optional import it lacks (redis), and with it the frames
# that were running and their locals to the process's end, here those of whoever imports this module first (the
# CLI's `cmd_plan`: its plan), where a `search` that imported it kept every candidate it weighed alive.
import optuna

from fastml.plan import (KNOBS, OFFLOAD_FRACTIONS, ZERO_BUBBLE_NEEDS, ZERO_STAGES, Knobs, fp8_cached_blocks,
                         fp8_shape_problem, master_streamed_groups, tensor_slice)
from fastml.layout import interleaved_rounds, layout_problem
from fastml.planner.hardware import Machine
from fastml.planner.memory import Memory, has_fp32_masters
from fastml.planner.parallel import memory_any, simulate_any
from fastml.planner.simulate import Simulation
from fastml.spec import ModelSpec

MAX_MICRO_BATCH = 64
# Memory kept back from the plan: the CUDA context and allocator slack on the GPU, the OS and page cache on the
# host.
GPU_RESERVE_BYTES = 2**30
GPU_USABLE_FRACTION = 0.97
HOST_USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Candidate:
    knobs: Knobs
    memory: Memory
    simulation: Simulation | None
    """None when the knobs do not fit in memory."""
    gpu_over_bytes: int
    host_over_bytes: int

    @property
    def feasible(self) -> bool:
        return self.simulation is not None


@dataclass(frozen=True)
class Problem:
    spec: ModelSpec
    seq_len: int
    global_batch_tokens: int
    machine: Machine
    layouts: bool = False
    """Search tensor and pipeline parallelism too (`layout_choices`): plans for other hardware alone, while the
    executor's layouts have run on CPU processes only, not yet on GPUs (issue 28)."""
    # What this problem's plans were found to need and do, by knobs: the footholds' walks, the climbs and the
    # planner's searches weigh many plans more than once. Not copied by dataclasses.replace, which may change what
    # they depend on.
    _knobs: dict[tuple, Knobs] = field(default_factory=dict, init=False, repr=False, compare=False)
    _memory: dict[Knobs, Memory] = field(default_factory=dict, init=False, repr=False, compare=False)
    _evaluated: dict[Knobs, Candidate] = field(default_factory=dict, init=False, repr=False, compare=False)

    def memory(self, knobs: Knobs) -> Memory:
        if knobs not in self._memory:
            self._memory[knobs] = memory_any(self.spec, self.seq_len, knobs, self.machine)
        return self._memory[knobs]

    @property
    def sequences_per_gpu(self) -> int:
        return self.global_batch_tokens // (self.seq_len * self.machine.num_gpus)

    def gpu_budget(self) -> int:
        return int(self.machine.gpu.memory_bytes * GPU_USABLE_FRACTION) - GPU_RESERVE_BYTES

    def host_budget(self) -> int:
        return int(self.machine.node.host_memory_bytes * HOST_USABLE_FRACTION)


def knob_space(problem: Problem, lower_precision: bool) -> dict[str, tuple]:
    """The choices of each knob (fastml.plan.KNOBS); a knob with one choice is fixed."""
    space = {"micro_batch_size": micro_batch_choices(problem)}
    for name, info in KNOBS.items():
        if name == "overlap_cpu_step":  # not searched: the faster of on and off (`evaluate_choice`)
            continue
        choices = info.choices
        # fp8 where the GPU has fp8 tensor cores and the matmuls' shapes suit them at every micro-batch (a sequence
        # length that is a multiple of 16 makes every micro-batch's tokens one)
        if name == "matmul_dtype":
            choices = tuple(c for c in choices if c in problem.machine.gpu.peak_flops and not (
                c == "fp8" and fp8_shape_problem(problem.spec, problem.seq_len)))
        if name == "comm" and problem.machine.num_nodes > 1:  # host-routed copies stay within a node
            choices = ("nccl",)
        # On a CPU the "device" memory is the host's: offload would move tensors within one pool.
        on_host_already = info.kind == "offload" and problem.machine.shares_host_memory
        searched = len(choices) > 1 and (lower_precision or not info.lower_precision) and (
            problem.machine.num_gpus > 1 or not info.multi_gpu) and not on_host_already
        if searched:
            space[name] = choices
    if problem.layouts and problem.machine.num_gpus > 1:
        space |= {name: choices for name, choices in layout_choices(problem).items() if len(choices) > 1}
    return space


LAYOUT_SIZES = (1, 2, 4, 8, 16, 32, 64)
VIRTUAL_STAGES = (1, 2, 4)


def layout_choices(problem: Problem) -> dict[str, tuple]:
    """Tensor-parallel sizes that split this model within a node (into slices that suit fp8 GEMMs where the whole
    model does), pipeline sizes that divide the GPUs, sequence parallelism, and chunks per pipeline rank (interleaved
    1F1B where above 1; `with_layout` fixes a choice that does not go together). The zero-bubble schedule is priced
    where pinned, not searched: it cannot go with compile, which the searched layouts choose (and with its dimension
    the same trials found worse layouts for qwen2.5-72b)."""
    spec, machine = problem.spec, problem.machine

    def fits(tensor: int, pipeline: int) -> bool:
        return not layout_problem(tensor, False, pipeline, 1, 1, spec.num_heads, spec.num_kv_heads,
                                  spec.ffn_hidden_size, spec.vocab_size, spec.num_layers, problem.seq_len,
                                  machine.num_gpus, machine.gpus_per_node)[0]
    fp8_suits = not fp8_shape_problem(spec, problem.seq_len)
    tensor = tuple(t for t in LAYOUT_SIZES if fits(t, 1) and not (
        fp8_suits and fp8_shape_problem(tensor_slice(spec, t), problem.seq_len)))
    return {"tensor_parallel": tensor, "pipeline_parallel": tuple(p for p in LAYOUT_SIZES if fits(1, p)),
            "sequence_parallel": (False, True) if len(tensor) > 1 else (False,), "virtual_stages": VIRTUAL_STAGES}


def micro_batch_choices(problem: Problem) -> tuple[int, ...]:
    """Powers of two (and the whole step) that divide the sequences of a step on one GPU."""
    sequences = problem.sequences_per_gpu
    return tuple(m for m in range(1, min(sequences, MAX_MICRO_BATCH) + 1) if sequences % m == 0
                 and (m & (m - 1) == 0 or m == sequences))


def space_size(space: dict[str, tuple]) -> int:
    return math.prod(len(choices) for choices in space.values())


def make_knobs(problem: Problem, choice: dict) -> Knobs:
    key = tuple(choice.items())
    if key not in problem._knobs:
        defaults = {f.name: f.default for f in dataclasses.fields(Knobs)}
        values = with_zero_stages({**defaults, **choice})
        values = without_no_ops(problem.spec, with_layout(problem, values), problem.machine.num_gpus)
        problem._knobs[key] = Knobs(**values)
    return problem._knobs[key]


def with_layout(problem: Problem, values: dict) -> dict:
    """A drawn layout made one that goes together: the pipeline shortened until tensor x pipeline divides the GPUs;
    chunks per rank (interleaved schedules) only with a pipeline, at most a block each, and a whole number of rounds
    of micro-batches; zero bubble (pinned) with the knobs it composes with (fastml.plan.Knobs); sequence parallelism
    only with tensor parallelism; a drawn fp8 only where a rank's slices suit it; and the knobs a layout does
    not compose with at their defaults (fastml.plan.Knobs: the memcpy collectives and shared host weights), and with a
    pipeline, offload fractions made 0 or 1. With the grad_accum_steps of the data-parallel rank's sequences."""
    fixed = dict(values)
    tensor, pipeline, virtual = fixed["tensor_parallel"], fixed["pipeline_parallel"], fixed["virtual_stages"]
    while problem.machine.num_gpus % (tensor * pipeline):
        pipeline //= 2
    micro_batches = problem.sequences_per_gpu * tensor * pipeline // fixed["micro_batch_size"]
    if (pipeline == 1 or fixed["pipeline_schedule"] == "gpipe" or pipeline * virtual > problem.spec.num_layers or
            micro_batches % interleaved_rounds(pipeline, micro_batches)):
        virtual = 1
    schedule = fixed["pipeline_schedule"]
    if schedule == "zero_bubble" and pipeline > 1:  # pinned: with the knobs it goes with (fastml.plan.Knobs)
        fixed |= ZERO_BUBBLE_NEEDS
        if fixed["matmul_dtype"] == "fp8":
            fixed["matmul_dtype"] = "bf16"
    elif schedule != "gpipe":
        schedule = "interleaved_1f1b" if virtual > 1 else "1f1b"
    fixed |= {"pipeline_parallel": pipeline, "virtual_stages": virtual, "grad_accum_steps": micro_batches,
              "pipeline_schedule": schedule}
    fixed["sequence_parallel"] &= tensor > 1
    if tensor * pipeline > 1:
        fixed |= {"comm": "nccl", "share_host_weights": False}
    if fixed["matmul_dtype"] == "fp8" and fp8_shape_problem(tensor_slice(problem.spec, tensor), problem.seq_len):
        fixed["matmul_dtype"] = "bf16"  # a pinned tensor_parallel's slices (layout_choices offers none such)
    if pipeline > 1:
        fixed |= {name: float(fixed[name] > 0) for name in OFFLOAD_FRACTIONS}  # whole or none (fastml.plan.Knobs)
    return fixed


def with_zero_stages(values: dict) -> dict:
    """A drawn ZeRO stage with the stages below it (fastml.plan.ZERO_STAGES): sharded weights shard the gradients and
    optimizer states too, sharded gradients the optimizer states."""
    fixed = dict(values)
    for lower, higher in zip(ZERO_STAGES[-2::-1], ZERO_STAGES[:0:-1]):
        fixed[lower] = fixed[lower] or fixed[higher]
    return fixed


def without_no_ops(spec: ModelSpec, values: dict, num_gpus: int) -> dict:
    """`values` with the knobs that change nothing (in planner/memory.py and planner/simulate.py) at their
    defaults, so that plans differing only in them are one plan: an offload fraction that moves no whole layer,
    offloaded bf16 master weights (there are none: the weights are the masters), a host cache of gathered
    weights when the weights are not sharded or every layer is streamed from the host anyway, fast fp8 accumulation
    without fp8 matmuls, cached fp8 weights without them or without a block whose weights stay on the GPU, an
    overlapped CPU step without one, streamed masters where no block streams them, and shared host weights where
    no streamed block is stepped by a sharded optimizer on the CPU (which they need)."""
    fixed = dict(values)
    for name in OFFLOAD_FRACTIONS:
        if round(fixed[name] * spec.num_layers) == 0:
            fixed[name] = 0.0
    all_streamed = round(fixed["offload_weights"] * spec.num_layers) == spec.num_layers
    if not fixed["shard_weights"] or all_streamed:
        fixed["cache_weights_on_host"] = False
    fixed["cache_fp8_weights"] &= fixed["matmul_dtype"] == "fp8"
    fixed["fp8_backward_fast_accum"] &= fixed["matmul_dtype"] == "fp8"
    fixed["share_host_weights"] &= (fixed["offload_weights"] > 0 and fixed["shard_optimizer"] and
                                    not fixed["shard_weights"] and fixed["offload_optimizer"] >= fixed["offload_weights"])
    fixed["overlap_cpu_step"] &= fixed["offload_optimizer"] > 0 and (not fixed["shard_optimizer"] or
                                                                    fixed["share_host_weights"])
    knobs = Knobs(**{**{f.name: f.default for f in dataclasses.fields(Knobs)}, **fixed})
    if not has_fp32_masters(knobs):
        fixed["offload_master"] = 0.0
    if not fp8_cached_blocks(knobs, spec.num_layers, num_gpus):
        fixed["cache_fp8_weights"] = False
    if not master_streamed_groups(knobs, spec.num_layers):
        fixed["stream_masters"] = False
    return fixed


def evaluate(problem: Problem, knobs: Knobs) -> Candidate:
    """Memory first; only knobs that fit are simulated."""
    if knobs not in problem._evaluated:
        m = problem.memory(knobs)
        gpu_over, host_over = _over_bytes(problem, m)
        sim = None
        if gpu_over <= 0 and host_over <= 0:
            sim = simulate_any(problem.spec, problem.seq_len, knobs, problem.machine)
        problem._evaluated[knobs] = Candidate(knobs=knobs, memory=m, simulation=sim, gpu_over_bytes=gpu_over,
                                              host_over_bytes=host_over)
    return problem._evaluated[knobs]


def _over_bytes(problem: Problem, m: Memory) -> tuple[int, int]:
    """How far memory `m` is over the GPU's and the host's budget (0 or less where it fits)."""
    if problem.machine.shares_host_memory:  # a CPU: every process's device bytes and the host's fill one pool
        over = problem.machine.gpus_per_node * m.gpu_peak + m.host_total - problem.host_budget()
        return over, over
    return m.gpu_peak - problem.gpu_budget(), m.host_total - problem.host_budget()


def fits_in_memory(problem: Problem, knobs: Knobs) -> bool:
    """Whether the plan fits the GPU and the host, without simulating its step."""
    return max(_over_bytes(problem, problem.memory(knobs))) <= 0


def evaluate_choice(problem: Problem, choice: dict) -> Candidate:
    """`evaluate` of the knobs a choice of the searched ones makes; where the choice leaves knobs.overlap_cpu_step
    open (neither pinned nor searched), the faster of the plan with the CPU's step overlapped and without. The
    overlap needs no memory, and it wins where the CPU's step is the end of the step; where the GPU's own steps of
    the other groups already hid it, moving it before the forward pass exposes it instead. Deciding it here, not in
    the search, keeps the search's trials for the knobs that trade memory."""
    candidate = evaluate(problem, make_knobs(problem, choice))
    knobs = candidate.knobs
    if "overlap_cpu_step" in choice or not candidate.feasible:
        return candidate
    values = without_no_ops(problem.spec, {**dataclasses.asdict(knobs), "overlap_cpu_step": True},
                            problem.machine.num_gpus)
    if not values["overlap_cpu_step"]:  # nothing to overlap
        return candidate
    overlapped = evaluate(problem, Knobs(**values))
    if not overlapped.feasible or overlapped.simulation.step_time_s >= candidate.simulation.step_time_s:
        return candidate
    return overlapped


def tokens_per_s(problem: Problem, candidate: Candidate) -> float:
    return problem.global_batch_tokens / candidate.simulation.step_time_s if candidate.feasible else 0.0


def num_knobs_set(knobs: Knobs) -> int:
    """How many knobs (besides the batch split) differ from their defaults."""
    return sum(getattr(knobs, f.name) != f.default for f in dataclasses.fields(Knobs) if KNOBS[f.name].kind != "batch")


LEAN_MARGIN = 0.02
"""Plans predicted within this share of the fastest plan's tokens/s are as fast as far as the prediction can tell, and
the one that needs the least is chosen among them (`rank`). The prediction's step time errs by about 4% on average on
the H200 (benchmarks/results/fidelity.json), but much of that error is shared by neighbouring plans (rank correlation
0.99 over all plans). 2% is below that resolution, and is all the speed a lean choice may give up where the models
price what it costs: before model version 3 they priced a chunked LM head at 2% where it cost the 8B plans 6-13%."""


def rank(problem: Problem, candidates) -> list[Candidate]:
    """Best first: of the feasible candidates within LEAN_MARGIN of the fastest, the leanest (`leanest`); then the
    rest, fastest first, at equal speed the one with fewer knobs set, then the one with less GPU memory. Of feasible
    candidates with the same prediction (time by component, GPU and host memory by category) only the first is kept:
    whatever knob tells them apart changes nothing."""
    def key(c: Candidate):
        return -_nine_digits(tokens_per_s(problem, c)), num_knobs_set(c.knobs), c.memory.gpu_peak
    ranked, predictions = [], set()
    for candidate in sorted(candidates, key=key):
        prediction = _prediction(candidate)
        if prediction is None or prediction not in predictions:
            ranked.append(candidate)
            predictions.add(prediction)
    if ranked and ranked[0].feasible:
        fastest = tokens_per_s(problem, ranked[0])
        lean = leanest(problem, [c for c in ranked if tokens_per_s(problem, c) >= (1 - LEAN_MARGIN) * fastest])
        ranked.remove(lean)
        ranked.insert(0, lean)
    return ranked


SAME_MEMORY_SHARE = 0.01
"""Memory needs closer than this share of what the machine has count as the same (`leanest`)."""


def leanest(problem: Problem, candidates: list[Candidate]) -> Candidate:
    """Of feasible candidates (fastest first), the one that needs the least: the least host memory; of those within
    SAME_MEMORY_SHARE of the host's memory of it, the least GPU memory; of those within that share of a GPU's, the
    least traffic (the seconds the copy engines and collectives are busy, `traffic_s`); the fastest of equals."""
    m = problem.machine
    for need, tolerance in ((lambda c: c.memory.host_total, SAME_MEMORY_SHARE * m.node.host_memory_bytes),
                            (lambda c: c.memory.gpu_peak, SAME_MEMORY_SHARE * m.gpu.memory_bytes)):
        least = min(need(c) for c in candidates)
        candidates = [c for c in candidates if need(c) <= least + tolerance]
    least = min(traffic_s(c.simulation) for c in candidates)
    return next(c for c in candidates if traffic_s(c.simulation) <= least * (1 + 1e-9))


def traffic_s(sim: Simulation) -> float:
    """Seconds of the step's copies between host and GPU and of its collectives (busy time, overlapped or not)."""
    return sum(op.duration for op in sim.ops.values() if op.category in ("offload", "comm"))


def _prediction(candidate: Candidate) -> tuple | None:
    if not candidate.feasible:
        return None
    times = tuple(_nine_digits(t) for t in candidate.simulation.time_s.values())
    return times, candidate.memory.gpu_peak, tuple(candidate.memory.gpu.values()), tuple(candidate.memory.host.values())


def _nine_digits(x: float) -> float:
    """Equal up to float rounding: sums of the same durations in another order differ in the last bits."""
    return float(f"{x:.9g}")


def exhaustive(problem: Problem, space: dict[str, tuple]) -> list[Candidate]:
    """Every combination, best first: the reference the search is tested against."""
    return [candidate for _, candidate in _ranked_choices(problem, _combinations(space))]


def _combinations(space: dict[str, tuple]):
    names = list(space)
    return (dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names)))


def _ranked_choices(problem: Problem, choices, feasible_only: bool = False) -> list[tuple[dict, Candidate]]:
    """The distinct plans the choices make, ranked, each with the first choice that makes it: a seed of the study
    is enqueued as that choice, so the sampler learns the values drawn, not the no-ops' defaults they became."""
    first_choice: dict[Knobs, dict] = {}
    for choice in choices:
        first_choice.setdefault(make_knobs(problem, choice), choice)
    evaluated = {(c := evaluate_choice(problem, choice)).knobs: (choice, c) for choice in first_choice.values()}
    ranked = rank(problem, [c for _, c in evaluated.values() if c.feasible or not feasible_only])
    return [(evaluated[c.knobs][0], c) for c in ranked]


def search(problem: Problem, space: dict[str, tuple], num_trials: int, storage: str | None = None,
           study_name: str = "fastml", seed: int = 0,
           on_trial: Callable[[int, float], None] | None = None) -> list[Candidate]:
    """Runs the Optuna study; returns its distinct candidates ranked (`rank`), feasible ones first.
    `on_trial(trials_done, best_tokens_per_s)` is called after each trial (best 0 while nothing fits)."""
    # ERROR: a trial that raises is logged at WARNING with its traceback before the error propagates, and a user's
    # error is one line (the CLI prints it).
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    exhaustive_search = space_size(space) <= num_trials
    sampler = optuna.samplers.BruteForceSampler(seed=seed) if exhaustive_search else \
        optuna.samplers.TPESampler(seed=seed, multivariate=True)
    study = optuna.create_study(direction="maximize", sampler=sampler, storage=storage, study_name=study_name,
                                load_if_exists=storage is not None)
    encoded = {name: [_encode(v) for v in choices] for name, choices in space.items()}
    seen: dict[Knobs, Candidate] = {}
    if not exhaustive_search:
        # Footholds from the smallest plan only where no core plan fits: else the climbs reach that region.
        for choice, candidate in _core_leaders(problem, space) or _relaxations(problem, space):
            seen[candidate.knobs] = candidate
            study.enqueue_trial({n: _encode(v) for n, v in choice.items()}, skip_if_exists=True)

    trials_done, best = 0, 0.0

    def objective(trial) -> float:
        nonlocal trials_done, best
        choice = {name: _decode(name, trial.suggest_categorical(name, options)) for name, options in encoded.items()}
        knobs = make_knobs(problem, choice)
        if knobs not in seen:
            seen[knobs] = evaluate_choice(problem, choice)
        speed = tokens_per_s(problem, seen[knobs])
        trials_done, best = trials_done + 1, max(best, speed)
        if on_trial:
            on_trial(trials_done, best)
        return speed

    study.optimize(objective, n_trials=num_trials)
    for trial in study.get_trials(deepcopy=False):  # trials of an earlier session of a resumed study
        if trial.params and set(trial.params) == set(encoded):
            choice = {n: _decode(n, v) for n, v in trial.params.items()}
            knobs = make_knobs(problem, choice)
            if seen.get(knobs) is None:
                seen[knobs] = evaluate_choice(problem, choice)
    ranked = rank(problem, list(seen.values()))
    if exhaustive_search:
        return ranked
    leaders: dict[int, Candidate] = {}  # the fastest plan of each micro-batch size, fastest first
    for candidate in sorted((c for c in ranked if c.feasible), key=lambda c: -tokens_per_s(problem, c)):
        leaders.setdefault(candidate.knobs.micro_batch_size, candidate)
    budget = [CLIMB_EVALUATIONS_PER_TRIAL * num_trials]
    for start in list(leaders.values())[:POLISHED_STARTS]:
        _polish(problem, space, seen, start, budget)
    return rank(problem, list(seen.values()))


POLISHED_STARTS = 3
"""From how many plans the search climbs (`_polish`): the fastest of as many micro-batch sizes, since the best plans
of two sizes often differ in many knobs at once (a larger micro-batch recomputing, a smaller one not)."""
CLIMB_EVALUATIONS_PER_TRIAL = 3
"""The climbs weigh at most this many new plans per trial of the sampler, so that --trials sets the whole search's
work (the 8B on 8 H200s took 237 at the default 100 trials)."""


def _polish(problem: Problem, space: dict[str, tuple], seen: dict[Knobs, Candidate], start: Candidate,
            budget: list[int]) -> None:
    """Climbs from `start` to a plan no single change makes faster: each round weighs every plan one knob away, and
    where one does not fit, that change with one other knob a step toward less memory (trading memory between
    knobs, as offloading the optimizer to keep activations does, takes both at once); it moves to the fastest.
    The sampler finds the right region; this finds its best plan, which the sampler would need many more trials
    to land on. Every plan weighed goes into `seen`; `budget` holds how many new plans may still be weighed, and the
    climb stops where it runs out."""
    def speed(choice: dict) -> float:
        knobs = make_knobs(problem, choice)
        if seen.get(knobs) is None:
            if budget[0] <= 0:
                raise _OutOfBudget
            budget[0] -= 1
            seen[knobs] = evaluate_choice(problem, choice)
        return tokens_per_s(problem, seen[knobs])

    current, best = {name: getattr(start.knobs, name) for name in space}, tokens_per_s(problem, start)
    with contextlib.suppress(_OutOfBudget):
        _climb(space, current, best, speed)


class _OutOfBudget(Exception):
    pass


def _climb(space: dict[str, tuple], current: dict, best: float, speed: Callable[[dict], float]) -> None:
    """Moves from `current` (of speed `best`) to its fastest neighbour (`_polish`) while one is faster."""
    while True:
        moves = []
        for name, choices in space.items():
            for value in choices:
                if value == current[name]:
                    continue
                moved = {**current, name: value}
                moves.append((speed(moved), moved))
                if moves[-1][0] == 0:  # does not fit: with another knob a step toward less memory
                    for other, step in _steps_to_less_memory(space, current, skip=name):
                        repaired = {**moved, other: step}
                        moves.append((speed(repaired), repaired))
        fastest, choice = max(moves, key=lambda move: move[0])
        if fastest <= best * (1 + 1e-9):
            return
        best, current = fastest, choice


def _steps_to_less_memory(space: dict[str, tuple], current: dict, skip: str):
    """(knob, value): for each knob but `skip`, its neighbouring choice toward the one that needs the least memory
    (`smallest_choice`), where it is not there yet (nor at a value `with_layout` made of a choice, such as a pipeline
    shortened to divide the GPUs)."""
    least = smallest_choice(space)
    for name, choices in space.items():
        if name != skip and current[name] != least[name] and current[name] in choices:
            here, there = choices.index(current[name]), choices.index(least[name])
            yield name, choices[here + (1 if there > here else -1)]


def _core_leaders(problem: Problem, space: dict[str, tuple], count: int = 5) -> list[tuple[dict, Candidate]]:
    """Footholds for the sampler and the climbs (`search`): for each tensor x pipeline size and micro-batch size the
    space offers, the plans that offload and lower nothing (every knob but those, recompute and ZeRO at its first
    choice) and fit with the least ZeRO stage for their recompute (`_least_sharding`); of those, the first in `rank`'s
    order of each layout (of each micro-batch size where the space offers one layout), the first `count` of them.
    The sampler would seldom draw that many knobs at zero together, and the climbs move one knob at a time where
    changing the layout takes the batch, recompute and ZeRO knobs along (qwen2.5-72b on 32 H100s: the climbs from
    the sampler's best plans never reached the pipelines 1.14x faster than data parallelism)."""
    layouts = list(itertools.product(space.get("tensor_parallel", (1,)), space.get("pipeline_parallel", (1,))))
    first = {name: choices[0] for name, choices in space.items()}
    corners = []
    for tensor, pipeline in layouts:
        layout = {n: v for n, v in (("tensor_parallel", tensor), ("pipeline_parallel", pipeline)) if n in space}
        for micro in space["micro_batch_size"]:
            corners += _least_sharding(problem, space, {**first, **layout, "micro_batch_size": micro})
    leaders = {}
    for choice, candidate in _ranked_choices(problem, corners, feasible_only=True):
        k = candidate.knobs
        leaders.setdefault((k.tensor_parallel, k.pipeline_parallel) if len(layouts) > 1 else k.micro_batch_size,
                           (choice, candidate))
    return list(leaders.values())[:count]


FOOTHOLD_PIPELINE_PASSES = 8192
"""The most micro-batch chunks a step's pipeline ranks run together (ranks x micro-batches x chunks a rank) in a
foothold (`_core_leaders`). Pricing a step walks every pass (planner/pipeline.py), and 1,024 GPUs offer layouts of
a million (64 ranks, 8,192 micro-batches) whose bubble a shorter step already makes small; the sampler still draws
them."""


def _least_sharding(problem: Problem, space: dict[str, tuple], base: dict) -> list[dict]:
    """`base` with each recompute choice (in the space's order, which frees more memory as it goes) and the least ZeRO
    stage that fits with it, where that stage is less than the choice before needs (else the plan recomputes more for
    nothing): the corners of the plans that fit, found by walking their edge, one memory estimate a step. The walk
    takes more sharding to need no more memory, and more recompute no more either; where either does not hold
    (ZeRO's gathered head at two data-parallel ranks), it misses a corner, which only costs the search a foothold."""
    knobs = make_knobs(problem, base)
    if knobs.pipeline_parallel > 1 and \
            knobs.pipeline_parallel * knobs.grad_accum_steps * knobs.virtual_stages > FOOTHOLD_PIPELINE_PASSES:
        return []
    shards = [n for n in ZERO_STAGES if n in space]
    unsharded = {**dict.fromkeys(ZERO_STAGES, False), **base}
    levels = sorted({tuple(with_zero_stages({**unsharded, **dict(zip(shards, drawn))})[n] for n in shards)
                     for drawn in itertools.product(*(space[n] for n in shards))}, key=sum)
    recomputes = space.get("recompute", (None,))

    def plan(recompute_index: int, level_index: int) -> dict:
        return {**base, **dict(zip(shards, levels[level_index])),
                **({"recompute": recomputes[recompute_index]} if "recompute" in space else {})}

    def fits_at(recompute_index: int, level_index: int) -> bool:
        return fits_in_memory(problem, make_knobs(problem, plan(recompute_index, level_index)))
    corners, level, least_so_far = [], len(levels) - 1, len(levels)
    for recompute in range(len(recomputes)):
        if not fits_at(recompute, level):
            continue
        while level > 0 and fits_at(recompute, level - 1):
            level -= 1
        if level < least_so_far:
            corners.append(plan(recompute, level))
            least_so_far = level
    return corners


def smallest_choice(space: dict[str, tuple]) -> dict:
    """Per knob, the choice that needs the least GPU memory: offload and shard everything, recompute blocks,
    the smallest micro-batch, the most LM-head chunks, the narrowest dtypes."""
    def least(name, choices):
        if name == "micro_batch_size":
            return min(choices)
        return KNOBS[name].least_memory if KNOBS[name].least_memory in choices else choices[0]
    return {name: least(name, choices) for name, choices in space.items()}


def _relaxations(problem: Problem, space: dict[str, tuple]) -> list[tuple[dict, Candidate]]:
    """The smallest plan, then each single knob changed from it that still fits: feasible footholds in spaces
    where a random draw almost never fits (a large model on small GPUs)."""
    smallest = smallest_choice(space)
    changed = ({**smallest, name: value} for name, choices in space.items() for value in choices
               if value != smallest[name])
    return _ranked_choices(problem, [smallest, *changed], feasible_only=True)[:10]


def _encode(value):
    # Optuna's categorical choices must be None, bool, int, float or str: recompute sets travel as strings.
    return ",".join(value) if isinstance(value, tuple) else value


def _decode(name: str, value):
    return tuple(v for v in value.split(",") if v) if name == "recompute" else value

