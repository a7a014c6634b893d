"""Faults injected on purpose, for the reliability tests, and the announcement of every test hook a run is under: the environment variable FASTML_FAULTS lists them as
`kind@step` or `kind@first-last`, comma-separated, for example `kill-mid-step@5,nan-loss@3-4`; `kind@step:R` strikes
only the rank R of a job of several ranks (`kill-mid-checkpoint@4:1`).

Kinds: `kill-mid-step` (SIGKILL after the first micro-batch's backward pass), `kill-mid-checkpoint` (SIGKILL after
the first file of the step's checkpoint is written), `nan-loss` (the step's loss becomes NaN), `hang` (sleeps for
ever after the first micro-batch's backward pass: a rank that makes no progress), `sigterm` (the process sends itself
SIGTERM after the first micro-batch's backward pass, as a user's `kill` would, at a step known in advance). Steps
count from 1.
The step takes the first and last as hooks (`step_hooks`), the checkpoint writer calls `kill_if_due`. Unset,
nothing here does anything; set, every run says so first (train.py), so that no one runs under it unknowingly.
"""

from __future__ import annotations

import os
import signal
import time
from functools import cache

from rich.console import Console

from fastml.executor.loop.device import ONE_GPU_ENV
from fastml.executor.loop.step import StepHooks

ENV = "FASTML_FAULTS"


@cache
def _planned() -> dict[str, set[int]]:
    faults: dict[str, set[int]] = {}
    rank = os.environ.get("RANK", "0")
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        kind, _, when = item.strip().partition("@")
        steps, _, on_rank = when.partition(":")
        if on_rank and on_rank != rank:
            continue
        first, _, last = steps.partition("-")
        faults.setdefault(kind, set()).update(range(int(first), int(last or first) + 1))
    return faults


def due(kind: str, step: int) -> bool:
    return step in _planned().get(kind, ())


def kill_if_due(kind: str, step: int) -> None:
    if due(kind, step):
        os.kill(os.getpid(), signal.SIGKILL)


def step_hooks() -> StepHooks:
    """The faults of FASTML_FAULTS that strike inside a training step, as the step's hooks."""
    return StepHooks(after_loss=_nan_loss_if_due, after_first_backward=_after_first_backward)


def _after_first_backward(step: int) -> None:
    kill_if_due("kill-mid-step", step)
    if due("sigterm", step):
        os.kill(os.getpid(), signal.SIGTERM)
    while due("hang", step):
        time.sleep(3600)


def _nan_loss_if_due(step: int, loss):
    return loss * float("nan") if due("nan-loss", step) else loss


TEST_HOOKS = {ENV: "injects faults (kills, signals, NaN losses, hangs) into this run",
              ONE_GPU_ENV: "puts every rank of a node on GPU 0"}
"""The environment variables of fastml's tests that change a run, and what each does when set."""


def announce_test_hooks(console: Console) -> None:
    """One set by accident would change the run unseen: each run under one says so, first."""
    for name, effect in TEST_HOOKS.items():
        if os.environ.get(name):
            console.print(f"[yellow]warning:[/] {name}={os.environ[name]} is set: a hook of fastml's tests that "
                          f"{effect}; unset it unless you are testing fastml", highlight=False)
