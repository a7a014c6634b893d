"""The training loop: builds the model the plan describes (build.py), trains it step by step (step.py) under the meter
(meter.py), checkpoints it, stops cleanly on a signal (signals.py), writes its log and record (outputs.py), and
reports measured against predicted (display.py). A plan
for several ranks runs one such loop per rank (world.py), started by launch.py or torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from fastml.config import check_range, fail
from fastml.plan import Plan
from fastml.record import TRACE_FILE
from fastml.executor.loop import display, faults, metrics, outputs
from fastml.executor.storage import checkpoints
from fastml.executor.loop.build import build_training_model
from fastml.executor.parallel.collectives import make_collectives
from fastml.executor.storage.data import BlendedData, open_training_data
from fastml.executor.loop.device import apply_memory_cap, check_hardware, check_host_memory, training_device
from fastml.executor.loop.evaluate import Validation
from fastml.executor.model.generate import Sampler
from fastml.executor.loop.meter import Meter, memory_tensors, node_host_memory_bytes
from fastml.executor.loop.signals import StopSignals, stopped_message
from fastml.executor.memory.optim import AdamW
from fastml.executor.loop.step import train_step
from fastml.executor.parallel.pipeline import PipelineParallel
from fastml.executor.parallel.tensor import TensorParallel
from fastml.executor.parallel.world import (SINGLE, Watchdog, World, check_world, groups, join, launched,
                                             pipeline_links, release)


class TrainingStopped(Exception):
    """The run stopped before its last step, on purpose: the message says why and how to go on."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


DEFAULT_TIMEOUT_S = 600
"""How long the ranks of a job wait for each other before it is stopped (`--timeout`); a first step that compiles
the model can take minutes."""


def train(plan: Plan, steps: int | None = None, log_json: str | Path | None = None, show_progress: bool = True,
          console: Console | None = None, resume: bool = False, keep_checkpoints: int = 3,
          max_nonfinite_steps: int = 5, strict: bool = False, start_over: bool = False,
          timeout_s: float = DEFAULT_TIMEOUT_S, summary_json: str | Path | None = None,
          run_dir: str | Path | None = None, trace_step: int | None = None,
          checkpoint_interval: int | None = None, tensorboard: str | None = None, wandb: str | None = None,
          sample_every: int | None = None, sample_prompt: str = "") -> dict:
    """Runs `plan` for `steps` optimizer steps in all (default: the plan's) and returns the summary of the run.

    With `resume`, continues from the newest intact checkpoint in the plan's checkpoint_dir, checkpointing as the run
    it resumes did unless `checkpoint_interval` is given (which replaces the plan's); without it, a directory
    holding checkpoints is refused unless `start_over` moves them aside (checkpoints.open_run). SIGINT and SIGTERM
    finish the step, write a checkpoint and raise TrainingStopped; so do `max_nonfinite_steps` skipped steps in a
    row (without the checkpoint). `strict` refuses a plan made for other hardware instead of warning.

    A plan for several GPUs (or CPU processes) of this node, called outside a launcher, starts one worker process
    per rank (launch.py) and returns rank 0's summary; under torchrun this process is one rank of the job, and
    ranks that wait more than `timeout_s` for the others stop the job. `summary_json` receives the summary.

    `run_dir` receives the run's log (`log.jsonl`, unless `log_json` names another file), its plan and its record
    (`record.json`: fastml.record, what `fastml calibrate` reads); with `trace_step`, also `trace.json`, rank 0's
    step of that number as torch's profiler saw it (`fastml explain RUN_DIR --trace` sets it beside the simulated
    one).

    `tensorboard` (a directory) and `wandb` (a project) receive each step's figures too (metrics.py); with
    `sample_every`, rank 0 prints a continuation of `sample_prompt` every that many steps (model/generate.py).

    Rank 0 prints its report (what is in effect, the closing tables, where the record went) on stdout and its
    progress, notes and warnings on stderr; `console` receives both instead."""
    world = launched()
    main = world is None or world.main
    run_dir = Path(run_dir) if run_dir is not None and main else None  # rank 0's alone
    outputs.prepare_outputs(plan, run_dir, log_json if main else None, summary_json if main else None)
    if run_dir is not None:
        log_json = log_json or run_dir / outputs.LOG_FILE
        if not resume:  # the directory describes this run: an earlier run's trace is not this one's
            (run_dir / TRACE_FILE).unlink(missing_ok=True)
    if steps is not None:
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, steps=steps))
    if checkpoint_interval is not None:
        check_range("--checkpoint-interval", checkpoint_interval, 0)
        plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training,
                                                                      checkpoint_interval=checkpoint_interval))
    metrics.check_available(tensorboard, wandb)
    if sample_every is not None:
        check_range("--sample-every", sample_every, 1)
    check_range("--keep-checkpoints", keep_checkpoints, 1)
    check_range("--max-nonfinite-steps", max_nonfinite_steps, 1)
    check_range("--timeout", timeout_s, 1)
    if trace_step is not None:
        check_range("--trace-step", trace_step, 1, plan.training.steps)
        if run_dir is None and (world is None or world.main):
            fail("--trace-step", "the trace is written into the run's directory: give --run-dir")
    options = dict(log_json=log_json, show_progress=show_progress, resume=resume, keep_checkpoints=keep_checkpoints,
                   max_nonfinite_steps=max_nonfinite_steps, strict=strict, start_over=start_over, timeout_s=timeout_s,
                   trace_step=trace_step, checkpoint_interval=checkpoint_interval, tensorboard=tensorboard,
                   wandb=wandb, sample_every=sample_every, sample_prompt=sample_prompt)
    if world is None and plan.hardware.num_gpus > 1:
        from fastml.executor.parallel.launch import train_in_workers

        summary = train_in_workers(plan, console or Console(stderr=True), run_dir=run_dir, **options)
        outputs.write_summary(summary, summary_json)
        return summary
    world = dataclasses.replace(world or SINGLE, tensor=plan.knobs.tensor_parallel,
                                pipeline=plan.knobs.pipeline_parallel)
    check_world(plan, world)
    err = console or Console(stderr=True, quiet=not world.main)
    # On one terminal the report goes through the console that draws the progress line, which keeps them apart.
    out = console or (err if err.is_terminal and sys.stdout.isatty() else Console(quiet=not world.main))
    faults.announce_test_hooks(err)
    device = training_device(plan, world)
    check_hardware(plan, device, strict, err)
    check_host_memory(plan)
    apply_memory_cap(plan, device, out)
    join(plan, world, device, timeout_s, CHECKPOINT_S)
    with Watchdog(world, timeout_s) as watchdog:
        tensor_group, data_group = groups(world)
        tp = TensorParallel(plan.model, world.tensor, world.rank % world.tensor, tensor_group,
                            plan.knobs.sequence_parallel)
        k = plan.knobs
        pp = PipelineParallel(plan.model.num_layers, world.pipeline, world.rank // world.stride, k.virtual_stages,
                              k.pipeline_schedule, world.stride, world.rank % world.stride, pipeline_links(world))
        comm = make_collectives(plan.knobs.comm, world.data, device, watchdog, data_group) \
            if world.data.distributed else None
        try:
            trace = run_dir / TRACE_FILE if run_dir is not None and world.main and trace_step else None
            summary = _train(plan, world, tp, pp, device, comm, watchdog, out, err, trace=trace, **options)
        finally:
            if comm is not None:
                comm.close()
            release(tensor_group, data_group, *pp.links.values())
    if world.main:
        outputs.write_summary(summary, summary_json)
        if run_dir is not None and summary.get("steps"):
            outputs.write_run(run_dir, plan, summary, device, out)
    return summary


def _train(plan: Plan, world: World, tp: TensorParallel, pp: PipelineParallel, device: torch.device, comm,
           watchdog: Watchdog, out: Console, err: Console, *,
           log_json, show_progress: bool, resume: bool, keep_checkpoints: int, max_nonfinite_steps: int,
           strict: bool, start_over: bool, timeout_s: float, trace_step: int | None, trace: Path | None,
           checkpoint_interval: int | None, tensorboard: str | None, wandb: str | None, sample_every: int | None,
           sample_prompt: str) -> dict:
    """The loop of one rank; `out` gets the report (the knobs, the closing tables), `err` the progress and notes."""
    run = checkpoints.open_run(plan, resume=resume, start_over=start_over, keep=keep_checkpoints,
                               say=lambda message: err.print(message, markup=False), world=world,
                               new_interval=checkpoint_interval is not None)
    plan = run.plan  # resumed: with the checkpoint interval of the run resumed
    data = open_training_data(plan.training.data, plan.training.seq_len, plan.model.vocab_size)  # before the weights
    if isinstance(data, BlendedData):
        out.print(display.blend_text(plan.training.data, data.shares), highlight=False)
    validation = Validation.open(plan, world.data, say=lambda message: err.print(message, markup=False))
    sampler = Sampler(plan, sample_every, sample_prompt) if sample_every and world.main else None
    model, optimizer = _model_and_optimizer(plan, device, world, tp, pp, comm, run)
    checkpoint, position = run.restore(model, optimizer)
    if position.step >= plan.training.steps:
        out.print(f"already at step {position.step} of {plan.training.steps}: nothing to train")
        return {"steps": 0}
    micro = plan.knobs.micro_batch_size
    # Every valid micro-batch (times the ranks) divides the sequences of a step, so it divides what a checkpoint has
    # consumed, at any number of ranks.
    ranks = world.data  # a tensor-parallel group's ranks take the same sequences
    batches = data.batches(micro, plan.training.seed, start=position.sequences // (micro * ranks.size),
                           rank=ranks.rank, world_size=ranks.size)
    sequences_per_step = micro * plan.knobs.grad_accum_steps * ranks.size
    meter = Meter(plan, device, tensors_by_category=lambda: memory_tensors(model, optimizer))
    hooks = faults.step_hooks()
    with outputs.log_file(log_json if world.main else None, position.step if resume else None) as log, \
            display.progress(err, show_progress and world.main, plan.training.steps, position.step) as show_step, \
            contextlib.closing(metrics.Metrics(plan, *((tensorboard, wandb) if world.main else ()))) as sink, \
            StopSignals() as stop:
        bad_in_a_row = 0
        first_step = position.step
        last_validation = {"val_loss": None, "val_time_s": None}
        for step in range(first_step, plan.training.steps):
            watchdog.tick(f"step {step + 1}")
            traced = step + 1 == trace_step
            with outputs.profiled(trace if traced else None, device):
                record = meter.measure(train_step(model, optimizer, batches, plan, step, device, hooks, meter, world,
                                                  stop_requested=lambda: stop.signal is not None))
            if traced:  # slower by the profiler's work (every rank waits for rank 0's): out of the steady figures
                record["traced"] = True
                meter.restart_clock()
            stopping = record.pop("stop")
            if validation is not None and validation.due(step + 1) and not stopping:
                watchdog.tick(f"the validation loss after step {step + 1}")
                started = time.perf_counter()
                record["val_loss"] = validation.loss(model, device)
                record["val_time_s"] = time.perf_counter() - started
                last_validation = {key: record[key] for key in ("val_loss", "val_time_s")}
                meter.restart_clock()  # the next step's time is its own
            if step == first_step:  # after the first batch was read: bad data is one line alone, never after it
                display.print_knobs(out, plan)
            position = checkpoints.Position(step + 1, position.sequences + sequences_per_step)
            bad_in_a_row = bad_in_a_row + 1 if record["skipped"] else 0
            if sampler is not None and sampler.due(step + 1):
                said = sampler.text(model)
                out.print(f"sample after step {step + 1}: " + (repr(said) if said is not None else
                          "none: the weights are not whole on rank 0 (streamed, sharded, or split over tensor-"
                          "parallel or pipeline ranks; `fastml generate` a checkpoint instead)"),
                          highlight=False, markup=False)
                sampler = sampler if said is not None else None
                meter.restart_clock()
            outputs.log_record(record, log)
            sink.log(record)
            show_step(record)
            if bad_in_a_row >= max_nonfinite_steps:
                raise TrainingStopped(
                    f"step {step + 1}: loss or gradient norm not finite {bad_in_a_row} steps in a row; stopped. "
                    f"Last good checkpoint: {checkpoint or 'none'}", exit_code=3)
            if _checkpoint_due(plan, step + 1) or stopping:
                watchdog.allow(timeout_s + CHECKPOINT_S)
                checkpoint = run.save(model, optimizer, position)
            if stopping:
                signum = stop.signal or signal.SIGTERM  # another rank's: this one was not signalled (yet)
                raise TrainingStopped(stopped_message(plan, step + 1, signum, checkpoint), 128 + signum)
    optimizer.close()
    summary = meter.summary() | last_validation | {"node_host_memory_bytes": node_host_memory_bytes(world)}
    if isinstance(data, BlendedData):
        summary["data_shares"] = {part.path: share for part, share in zip(plan.training.data, data.shares)}
    display.print_summary(out, plan, summary)
    return summary


CHECKPOINT_S = 3600
"""How much longer than --timeout the ranks may wait for each other while a checkpoint is written."""


def _model_and_optimizer(plan: Plan, device: torch.device, world: World, tp: TensorParallel, pp: PipelineParallel,
                         comm, run: checkpoints.Run) -> tuple[torch.nn.Module, AdamW]:
    checkpoints.seed_rng(plan.training.seed, world.rank)
    model = build_training_model(plan, device, world, comm, tp, pp)
    run.start(model)  # the weights a new run starts from, before the optimizer copies them into its masters
    return model, AdamW(model, plan.training, plan.knobs, model.placement)


def _checkpoint_due(plan: Plan, steps_done: int) -> bool:
    t = plan.training
    if not t.checkpoint_dir:
        return False
    return steps_done == t.steps or (t.checkpoint_interval > 0 and steps_done % t.checkpoint_interval == 0)


