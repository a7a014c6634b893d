"""The directories a model's weights come from, as a plan names them (`training.init_from`): an HF model directory
(config.json beside safetensors files) or a fastml checkpoint (fastml.json: what `fastml convert --from-hf` writes, or
a training checkpoint `step-N` of a run); and a run's checkpoint directory, which holds training checkpoints. Read
here without a tensor, so that the planner knows the model a run starts from; the executor reads the weights
(executor/storage)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from fastml.config import fail, from_dict, read_json, show
from fastml.spec import ModelSpec, resolve_model

MANIFEST_FILE = "fastml.json"
"""A fastml checkpoint's manifest (executor/storage/tensordir.py): its model spec, files and training state."""
HF_MODEL_CONFIG = "config.json"
_TRAINING_CHECKPOINT = re.compile(r"step-(\d+)")


def training_checkpoints(root: str | Path) -> list[Path]:
    """The training checkpoint directories `step-N` under `root`, newest first (hidden temporary siblings are not
    among them, nor runs moved aside)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _TRAINING_CHECKPOINT.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=checkpoint_step, reverse=True)


def checkpoint_step(path: Path) -> int:
    """The step of a training checkpoint `step-N`."""
    return int(_TRAINING_CHECKPOINT.fullmatch(path.name)[1])


def is_fastml_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST_FILE).is_file()


def is_hf_model(directory: str | Path) -> bool:
    return (Path(directory) / HF_MODEL_CONFIG).is_file() and not is_fastml_checkpoint(directory)


def spec_of_weights(directory: str | Path, field: str) -> ModelSpec:
    """The model whose weights `directory` holds, from its fastml.json or its config.json; a UserError naming `field`
    where it holds none."""
    path = Path(directory)
    if is_fastml_checkpoint(path):
        manifest = read_json(path / MANIFEST_FILE, "a fastml checkpoint's manifest")
        model = manifest.get("model") if isinstance(manifest, dict) else None
        return from_dict(ModelSpec, model, f"{path / MANIFEST_FILE}: model")
    if is_hf_model(path):
        return resolve_model(str(path / HF_MODEL_CONFIG))  # a file path, so never mistaken for a preset name
    if not path.is_dir():
        fail(field, f"{path} is not a directory")
    if hint := name_a_checkpoint(path):
        fail(field, f"{path} is a run's checkpoint directory, not a checkpoint: {hint}")
    fail(field, f"{path} holds no model weights: it is neither a fastml checkpoint (no {MANIFEST_FILE}) nor an HF "
                f"model directory (no {HF_MODEL_CONFIG})")


def name_a_checkpoint(path: Path) -> str | None:
    """Where `path` is a run's checkpoint directory, the advice to name one of its checkpoints, the newest for one."""
    found = training_checkpoints(path)
    return f"name one of its training checkpoints, e.g. the newest, {found[0]}" if found else None


def check_same_model(held: ModelSpec, planned: ModelSpec, where: str, field: str) -> None:
    """`held`, the model of the weights at `where`, is the plan's `planned` but for its name (a preset or a
    directory, which computes nothing); else a UserError naming `field` and the first difference."""
    for f in dataclasses.fields(ModelSpec):
        theirs, ours = getattr(held, f.name), getattr(planned, f.name)
        if f.name != "name" and theirs != ours:
            fail(field, f"{where} holds the weights of another model than {planned.name}: its {f.name} is "
                        f"{show(theirs)}, not {show(ours)}; plan for its model with `fastml plan --init-from {where}` "
                        f"and no --model")
