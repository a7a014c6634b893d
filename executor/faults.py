"""Faults injected on purpose, for the reliability tests: the environment variable FASTML_FAULTS lists them as
`kind@step` or `kind@first-last`, comma-separated, for example `kill-mid-step@5,nan-loss@3-4`.

Kinds: `kill-mid-step` (SIGKILL after the first micro-batch's backward pass), `kill-mid-checkpoint` (SIGKILL after
the first file of the step's checkpoint is written), `nan-loss` (the step's loss becomes NaN). Steps count from 1.
Unset, nothing here does anything.
"""

from __future__ import annotations

import os
import signal
from functools import cache

ENV = "FASTML_FAULTS"


@cache
def _planned() -> dict[str, set[int]]:
    faults: dict[str, set[int]] = {}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        kind, _, steps = item.strip().partition("@")
        first, _, last = steps.partition("-")
        faults.setdefault(kind, set()).update(range(int(first), int(last or first) + 1))
    return faults


def due(kind: str, step: int) -> bool:
    return step in _planned().get(kind, ())


def kill_if_due(kind: str, step: int) -> None:
    if due(kind, step):
        os.kill(os.getpid(), signal.SIGKILL)
