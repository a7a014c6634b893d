"""The host's time in a step (the profile's `host_overhead`): fastml's own training loop, run here on the tiny preset
with one sequence per micro-batch, whose kernels take next to no time, so that its step time is the host's. On a CPU
the model is also narrowed and its sequences short: its arithmetic then takes next to no time either, and what is
left is the host's work per op, which there adds to the arithmetic (one thread of control runs both).

Steps at two depths and two micro-batch counts are fitted as
    step = step_s + blocks x optimizer_per_block_s + micro-batches x (head_s + blocks x block_pass_s),
the four figures of `HostOverhead` (planner/costs.py prices them).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

LAYERS = (2, 8)
MICRO_BATCHES = (1, 4)
STEPS = 28
SKIPPED_STEPS = 4
"""The first steps of a run warm up (allocator, autotuning, first launches); the median of the rest is the figure.
The host's speed wanders: on the H200's 16-core VM (2026-12-03) a point's steps spread by 20% and a stretch of a few
steps ran twice as slow, so that medians of 8 steps gave fits whose prediction of the main job ranged from 0.8 to
1.4 times its measured step; 24 steps a point cost about 2 s more there."""


def measure_host_overhead(device: str = "cuda") -> dict[str, float]:
    """The fitted figures of the training loop on this machine's GPU, or its CPU (profile field names, under
    host_overhead)."""
    rows = [(layers, micro, _step_time_s(layers, micro, device)) for layers in LAYERS for micro in MICRO_BATCHES]
    return fit(rows)


def op_counter():
    """A context that counts the aten ops dispatched inside it (its `ops`): what the host launches, one by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))
    return OpCounter()


def fit(rows: list[tuple[int, int, float]]) -> dict[str, float]:
    """Least squares of (blocks, micro-batches, step seconds) rows; a figure the noise makes negative is 0."""
    import numpy as np

    a = np.array([[1, layers, micro, layers * micro] for layers, micro, _ in rows], dtype=float)
    b = np.array([seconds for _, _, seconds in rows])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    names = ("step_s", "optimizer_per_block_s", "head_s", "block_pass_s")
    return {name: max(0.0, float(value)) for name, value in zip(names, coef)}


def _step_time_s(layers: int, micro_batches: int, device: str) -> float:
    from rich.console import Console

    from fastml.executor.loop.train import train

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        train(tiny_plan(layers, micro_batches, device), steps=STEPS, log_json=log, show_progress=False,
              console=Console(quiet=True))
        times = [json.loads(line)["step_time_s"] for line in log.read_text().splitlines()]
    return statistics.median(times[SKIPPED_STEPS:])


CPU_NARROWED = dict(hidden_size=32, num_heads=2, num_kv_heads=1, ffn_hidden_size=64)
CPU_SEQ_LEN = 16
"""On a CPU the tiny preset is narrowed to these and its sequences cut to this length: its GEMMs then take
microseconds, fewer than the ops' dispatch."""


def tiny_plan(layers: int, micro_batches: int, device: str = "cuda"):
    """The tiny preset cut to `layers` blocks, `micro_batches` micro-batches of one sequence (the plan's default
    length) a step, on one GPU with the default knobs; on the CPU narrowed (CPU_NARROWED, CPU_SEQ_LEN), in fp32 as
    the planner trains on a CPU."""
    import dataclasses

    from fastml.plan import Hardware, Knobs, Plan, Training
    from fastml.spec import PRESETS

    spec, seq_len = dataclasses.replace(PRESETS["tiny"], num_layers=layers), Training().seq_len
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=micro_batches)
    if device == "cpu":
        spec, seq_len = dataclasses.replace(spec, **CPU_NARROWED), CPU_SEQ_LEN
        knobs = dataclasses.replace(knobs, param_dtype="fp32", matmul_dtype="fp32")
    # One sequence of the validation loss the run evaluates at its end (the default corpus has a split): its
    # evaluation is no part of the steps timed, and a full one would double a CPU's first plan.
    training = Training(seq_len=seq_len, global_batch_tokens=seq_len * micro_batches, steps=STEPS,
                        eval_tokens=seq_len)
    return Plan(model=spec, training=training, hardware=Hardware(device=device, num_gpus=1, gpus_per_node=1),
                knobs=knobs)
