"""Where a run's figures go besides its own log: TensorBoard event files (`fastml run --tensorboard DIR`, through the
`tensorboard` package) and Weights & Biases (`--wandb PROJECT`, through `wandb`; WANDB_MODE=offline keeps the run on
disk). Both are optional packages (pip install "fastml[logging]"): a run without either flag needs neither, and a flag
whose package is missing is one line before any work. Rank 0 writes; the other ranks' figures are the same."""

from __future__ import annotations

import importlib.util

from fastml.config import fail, to_dict
from fastml.plan import Plan

SCALARS = {  # the log record's key: the name it is written under
    "loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_time_s": "perf/step_time_s",
    "peak_gpu_memory_bytes": "memory/peak_gpu_bytes", "peak_host_memory_bytes": "memory/peak_host_bytes",
}
PREDICTED_STEP = "perf/predicted_step_time_s"
"""The plan's predicted step time, written beside the measured one at every step."""


def check_available(tensorboard: str | None, wandb: str | None) -> None:
    """Fails with what to install where a flag asks for a package this Python lacks (before any work)."""
    for flag, given, package in (("--tensorboard", tensorboard, "tensorboard"), ("--wandb", wandb, "wandb")):
        if given and importlib.util.find_spec(package) is None:
            fail(flag, f"needs the {package} package: pip install {package} (or fastml[logging])")


class Metrics:
    """The writers the flags ask for; `log(record)` writes a step's figures to each, `close()` flushes them."""

    def __init__(self, plan: Plan, tensorboard: str | None = None, wandb: str | None = None):
        check_available(tensorboard, wandb)
        self.predicted_step_s = plan.predicted.step_time_s if plan.predicted else None
        self.tensorboard = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=tensorboard)
        if wandb:
            import wandb as wandb_module

            self.wandb = wandb_module.init(project=wandb, config=to_dict(plan), name=plan.model.name)

    def log(self, record: dict) -> None:
        scalars = {name: record[key] for key, name in SCALARS.items() if record.get(key) is not None}
        if self.predicted_step_s is not None:
            scalars[PREDICTED_STEP] = self.predicted_step_s
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, float(value), global_step=record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
