"""Stopping a run cleanly: SIGINT or SIGTERM asks the loop to stop after the step in progress (a checkpoint is
written, and the message says how to resume); a second signal stops at once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from fastml.plan import Plan


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the step it is in; a second one stops at once."""

    def __enter__(self):
        self.signal = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def stopped_message(plan: Plan, step: int, signum: int, path: Path | None) -> str:
    name = signal.Signals(signum).name
    if path is None:
        return (f"stopped by {name} after step {step}; no checkpoint directory was set (--checkpoint-dir), so "
                f"nothing was saved")
    return (f"stopped by {name} after step {step}; checkpoint {path}. Resume with the same command and --resume "
            f"(with --checkpoint-dir {plan.training.checkpoint_dir} if it was given on the command line)")
