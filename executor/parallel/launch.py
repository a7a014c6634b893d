"""`fastml run` of a plan for several GPUs (or CPU processes) of this node: one worker process per rank, started by
torch.distributed's elastic launcher as torchrun starts them, each running `fastml run` on the same plan (written to
a temporary file) with the same options. Rank 0 shows the progress and the summary; when a worker fails, the
launcher stops the others and says which rank failed and how. Ctrl-C (or SIGTERM) reaches the workers once: they
finish the step, write a checkpoint and stop, as one process would.

A plan for several nodes is started on each node with torchrun itself (README, "Several GPUs and nodes").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from rich.console import Console

from fastml.config import fail
from fastml.plan import Plan, save_plan
from fastml.executor.parallel.world import EXIT_OTHER_RANK

SHUTDOWN_S = 900
"""How long the workers may take to finish their step and write a checkpoint after a signal before they are
killed."""


class WorkersFailed(Exception):
    """A worker of the job stopped it: the message names the rank and how it ended."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def train_in_workers(plan: Plan, console: Console, *, log_json, show_progress: bool, resume: bool,
                     keep_checkpoints: int, max_nonfinite_steps: int, strict: bool, start_over: bool,
                     timeout_s: float, run_dir=None, trace_step: int | None = None,
                     checkpoint_interval: int | None = None, tensorboard: str | None = None,
                     wandb: str | None = None, sample_every: int | None = None, sample_prompt: str = "") -> dict:
    """Trains `plan` with one worker per rank of this node; returns rank 0's summary."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    check_single_node(plan)
    n = plan.hardware.gpus_per_node
    with tempfile.TemporaryDirectory(prefix="fastml-run-") as tmp:
        plan_file, summary_file = Path(tmp) / "plan.json", Path(tmp) / "summary.json"
        save_plan(plan, plan_file)
        args = ["-m", "fastml", "run", str(plan_file), "--summary-json", str(summary_file), "--timeout",
                str(timeout_s), "--keep-checkpoints", str(keep_checkpoints), "--max-nonfinite-steps",
                str(max_nonfinite_steps)]
        args += ["--log-json", str(Path(log_json).absolute())] if log_json else []
        args += ["--run-dir", str(Path(run_dir).absolute())] if run_dir else []
        args += ["--trace-step", str(trace_step)] if trace_step else []
        args += ["--checkpoint-interval", str(checkpoint_interval)] if checkpoint_interval is not None else []
        args += ["--tensorboard", str(Path(tensorboard).absolute())] if tensorboard else []
        args += ["--wandb", wandb] if wandb else []
        args += ["--sample-every", str(sample_every), f"--sample-prompt={sample_prompt}"] if sample_every else []
        args += [flag for flag, given in (("--no-progress", not show_progress), ("--resume", resume),
                                          ("--start-over", start_over), ("--strict", strict)) if given]
        console.print(f"starting {n} {'GPU' if plan.hardware.device == 'cuda' else 'CPU'} workers; rank 0 reports",
                      highlight=False)
        _quiet_launcher()
        try:
            elastic_launch(_launch_config(n), sys.executable)(*args)
        except ChildFailedError as e:
            if show_progress and console.is_terminal and _killed(e, rank=0):
                console.line()  # rank 0 died drawing its progress line: the message starts a line of its own
            raise _failure(e) from None
        except SignalException as e:
            raise WorkersFailed(f"stopped by {e.sigval.name}: the workers finished their step and stopped (see "
                                "rank 0's message above)", 128 + int(e.sigval)) from None
        return json.loads(summary_file.read_text())


def _quiet_launcher() -> None:
    """The launcher's own log lines say what the message of `_failure` says better, once: each of its modules sets
    its logger's level on import (torch.distributed.elastic.utils.logging), so each is quietened."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def check_single_node(plan: Plan) -> None:
    h = plan.hardware
    if h.num_gpus != h.gpus_per_node:
        fail("hardware.num_gpus", f"the plan is for {h.num_gpus // h.gpus_per_node} nodes of {h.gpus_per_node} "
                                  f"{'GPUs' if h.device == 'cuda' else 'processes'}: start it on every node with "
                                  f"torchrun (README, 'Several GPUs and nodes')")
    if h.device == "cuda":
        from fastml.executor.loop.device import check_gpus

        check_gpus(plan)


def _launch_config(num_workers: int):
    """torchrun --standalone's configuration: one node, a rendezvous on a free local port, no restarts."""
    from torch.distributed.launcher.api import LaunchConfig

    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_S))  # where the field is missing
    extra = {"shutdown_timeout": SHUTDOWN_S} if "shutdown_timeout" in fields else {}
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=num_workers, run_id=f"fastml-{uuid.uuid4().hex[:8]}",
                        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                        start_method="spawn", **extra)


def _killed(error, rank: int) -> bool:
    return rank in error.failures and error.failures[rank].exitcode < 0


def _failure(error) -> WorkersFailed:
    """The failure the others followed: a rank killed by a signal (but SIGTERM, which the launcher sends the others
    once one has failed), else one that said why it stopped (a user error, non-finite steps, a stop requested), else
    one that stopped for another rank (a hang the watchdog named, a lost connection), else any other; the lowest
    rank of the first kind found. The ranks that failed after it are listed."""
    def kind(failure) -> int:
        if failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:
            return 0
        if failure.exitcode in (2, 3) or failure.exitcode > 128:
            return 1
        return 2 if failure.exitcode == EXIT_OTHER_RANK else 3  # a hang it diagnosed, or lost contact
    rank, failure = min(error.failures.items(), key=lambda item: (kind(item[1]), item[0]))
    others = sorted(set(error.failures) - {rank})
    also = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped too" if others else ""
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        return WorkersFailed(f"rank {rank} (pid {failure.pid}) was killed by {name}; the job stopped{also}",
                             128 - failure.exitcode)
    return WorkersFailed(f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode} (its message is "
                         f"above){also}", failure.exitcode)
