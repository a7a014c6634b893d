"""Training checkpoints: written every few steps under `checkpoint_dir/step-NNNNNNNN`, the newest complete one
found again after a crash, and restored so that the resumed run takes exactly the steps the lost one would have.

Each is a fastml checkpoint (checkpoint.py: atomic, with a SHA-256 per file) holding the model, the optimizer
(fp32 masters, Adam m, v and step), the RNG states, and in fastml.json the step, the position in the data and the
plan. The data order needs no state of its own: it follows from the seed and the position (data.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from fastml.config import UserError, to_dict
from fastml.plan import Plan
from fastml.executor import faults
from fastml.executor.hf import load_checkpoint, load_tensor_file, save_checkpoint
from fastml.executor.model import Transformer
from fastml.executor.optim import AdamW

OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
PREFIX = "step-"


@dataclass(frozen=True)
class Position:
    step: int
    """Optimizer steps done."""
    sequences: int
    """Sequences of the data consumed by this process."""


def save(root: str | Path, model: Transformer, optimizer: AdamW, plan: Plan, position: Position,
         keep: int) -> Path:
    """Writes the checkpoint of `position` and deletes all but the newest `keep`."""
    path = Path(root) / f"{PREFIX}{position.step:08d}"
    extra = {"training": {"step": position.step, "sequences": position.sequences, "plan": to_dict(plan)}}
    save_checkpoint(path, plan.model, model.state_dict(), extra,
                    tensor_files={OPTIMIZER_FILE: optimizer.state_tensors(), RNG_FILE: _rng_tensors()},
                    after_each_file=lambda: faults.kill_if_due("kill-mid-checkpoint", position.step))
    for old in _checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def restore_newest(root: str | Path, model: Transformer, optimizer: AdamW, plan: Plan,
                   report) -> tuple[Path, Position] | None:
    """Loads the newest complete and intact checkpoint into `model` and `optimizer`; `report(message)` hears of
    each damaged one passed over. None when there is none."""
    for path in _checkpoints(root):
        try:
            loaded = load_checkpoint(path)  # checks every file's checksum
        except UserError as e:
            report(f"skipping checkpoint {path}: {e}")
            continue
        return path, _restore(path, *loaded, model, optimizer, plan)
    return None


def _restore(path: Path, spec, state: dict, meta: dict, model: Transformer, optimizer: AdamW,
             plan: Plan) -> Position:
    """Refuses a checkpoint made for another model or batch, else loads it."""
    saved = meta.get("training", {})
    if spec != plan.model:
        raise UserError(f"{path}: this checkpoint is of another model ({spec.name}) than the plan's "
                        f"({plan.model.name})")
    saved_plan = saved.get("plan", {}).get("training", {})
    for field in ("seq_len", "global_batch_tokens", "seed", "data"):
        if saved_plan.get(field) != getattr(plan.training, field):
            raise UserError(f"{path}: training.{field} was {saved_plan.get(field)!r} when this checkpoint was "
                            f"written and is {getattr(plan.training, field)!r} now; resuming would not continue "
                            f"the same run")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(state[name])
    optimizer.load_state_tensors(load_tensor_file(path, OPTIMIZER_FILE))
    _set_rng(load_tensor_file(path, RNG_FILE))
    return Position(step=int(saved["step"]), sequences=int(saved["sequences"]))


def _checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under `root`, newest first (hidden temporary siblings are not among them)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith(PREFIX) and p.is_dir()), reverse=True)


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return tensors


def _set_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["cpu"])
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
