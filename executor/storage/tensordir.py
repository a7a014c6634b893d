"""fastml's checkpoint format, shared by training checkpoints (checkpoints.py) and HF conversion (hf.py).

A fastml checkpoint is a directory: `model.safetensors` (our tensor names), any further safetensors or JSON files
the writer adds (optimizer state, RNG states, an HF config), and `fastml.json`, the `Manifest`: format, version, the
model spec, a SHA-256 per file and, in a training snapshot, the run it belongs to, its step and its plan. It is
written into a temporary sibling and renamed into place, so a crash never leaves half of one under the real name.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from fastml.config import UserError, fail, from_dict, to_dict
from fastml.plan import Plan
from fastml.spec import ModelSpec
from fastml.weights import MANIFEST_FILE, name_a_checkpoint
from fastml.executor.storage.files import (read_json_object, read_safetensors, sha256, write_dir_atomically, write_json,
                                   write_safetensors)
from fastml.executor.model.transformer import build_model

FORMAT = "fastml-checkpoint"
VERSION = 2
"""2: the run id in `training`; the HF config in a file of its own."""
MODEL_FILE = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """What a training snapshot adds to the manifest."""

    run_id: str
    """The run (a fresh start, and every resumption of it) that wrote the checkpoint."""
    step: int
    """Optimizer steps done."""
    sequences: int
    """Sequences of the data consumed, by all ranks together."""
    plan: Plan
    """The plan the run was following when it wrote the checkpoint."""
    world_size: int = 1
    """The ranks that wrote it (each its shard of the optimizer state, where it was sharded)."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """fastml.json."""

    format: Literal["fastml-checkpoint"]
    version: int
    model: ModelSpec
    files: dict[str, str]
    """Every other file of the checkpoint: name -> SHA-256 of its bytes."""
    training: TrainingState | None = None
    """Set in a training snapshot."""

    def __post_init__(self) -> None:
        if self.version != VERSION:
            fail("version", f"{self.version} is not supported; this fastml reads version {VERSION}")
        for name in self.files:
            if Path(name).name != name or name in ("", ".", "..", MANIFEST_FILE):
                fail(f"files[{name!r}]", "must name a file of the checkpoint directory")


# ---- our model's tensors ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def model_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Our tensor names and shapes, read off the model built on the meta device (so they cannot drift)."""
    return {name: tuple(t.shape) for name, t in build_model(spec).state_dict().items()}


def name_mismatch(names, expected) -> str | None:
    # Unknown names first: a missing tensor is often only the consequence of a misnamed one.
    for kind, bad in (("unknown", set(names) - set(expected)), ("missing", set(expected) - set(names))):
        if bad:
            return f"{kind} tensor {sorted(bad)[0]!r} ({len(bad)} {kind} in all)"
    return None


def check_state_dict(spec: ModelSpec, state_dict: dict, where: str) -> None:
    shapes = model_shapes(spec)
    if mismatch := name_mismatch(state_dict, shapes):
        fail(where, mismatch)
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            fail(where, f"tensor {name!r} has shape {tuple(state_dict[name].shape)}, the model needs {shape}")


# ---- writing ------------------------------------------------------------------------------------------------

def save_checkpoint(directory, spec: ModelSpec, state_dict: dict, *, training: TrainingState | None = None,
                    tensor_files: dict[str, dict[str, torch.Tensor]] | None = None,
                    json_files: dict[str, dict] | None = None, after_each_file=None,
                    metadata: dict[str, dict[str, str]] | None = None, others=None) -> None:
    """Writes a fastml checkpoint atomically: model.safetensors, the further `tensor_files` (name -> tensors, with
    the safetensors `metadata` of each where given) and `json_files` (name -> JSON object), and the manifest.
    `after_each_file()` runs after each file (fault tests). With several ranks, `others(tmp)` sets the other ranks
    writing their files into the temporary directory too, and returns a function that returns their checksums once
    they are written: the checkpoint appears under its name only once every rank's files are there and durable.

    An existing directory is replaced only if it is empty or a fastml checkpoint."""
    check_state_dict(spec, state_dict, "state_dict")
    tensor_files, json_files = {MODEL_FILE: state_dict, **(tensor_files or {})}, json_files or {}
    bad = [n for n in tensor_files if not n.endswith(".safetensors")] + [
        n for n in json_files if not n.endswith(".json") or n == MANIFEST_FILE]
    if bad:
        fail("save_checkpoint", f"file {bad[0]!r}: tensors go in .safetensors files, other data in .json files "
                                f"(not {MANIFEST_FILE})")
    json.dumps(json_files)  # before any file is written: a value that is not JSON fails here

    def write(tmp: Path) -> None:
        others_written = others(tmp) if others is not None else dict
        checksums = write_files(tmp, tensor_files, json_files, metadata, after_each_file)
        checksums |= others_written()
        manifest = Manifest(format=FORMAT, version=VERSION, model=spec, files=checksums, training=training)
        write_json(tmp / MANIFEST_FILE, to_dict(manifest))

    write_dir_atomically(directory, write, _is_checkpoint, "a fastml checkpoint")


def write_files(directory: Path, tensor_files: dict[str, dict[str, torch.Tensor]], json_files: dict[str, dict],
                metadata: dict[str, dict[str, str]] | None = None, after_each_file=None) -> dict[str, str]:
    """Writes and fsyncs the files of (part of) a checkpoint into `directory`; returns their checksums."""
    checksums = {}
    for name, content in {**tensor_files, **json_files}.items():
        if name.endswith(".json"):
            write_json(directory / name, content)
        else:
            write_safetensors(content, directory / name, (metadata or {}).get(name))
        checksums[name] = sha256(directory / name)
        if after_each_file:
            after_each_file()
    return checksums


def _is_checkpoint(directory: Path) -> bool:
    """One of ours, or what is left of one (a damaged checkpoint may be replaced): only our kinds of files, and JSON
    files only beside a manifest of ours (an HF model directory holds config.json and safetensors files too)."""
    entries = list(directory.iterdir())
    if not all(p.is_file() and p.suffix in (".json", ".safetensors") for p in entries):
        return False
    return all(p.suffix != ".json" for p in entries) or _has_our_manifest(directory)


def _has_our_manifest(directory: Path) -> bool:
    try:
        return read_json_object(directory / MANIFEST_FILE).get("format") == FORMAT
    except (UserError, OSError):
        return False


# ---- reading ------------------------------------------------------------------------------------------------

def read_manifest(directory) -> Manifest:
    """The validated fastml.json of a checkpoint (its files are not checked: see `verify_checkpoint`)."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.is_file():
        hint = name_a_checkpoint(directory)
        fail(str(directory), f"not a fastml checkpoint (no {MANIFEST_FILE})" + (
            f" but a run's checkpoint directory: {hint}" if hint else ""))
    try:
        return from_dict(Manifest, read_json_object(path))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def verify_checkpoint(directory, names: list[str] | None = None) -> Manifest:
    """The manifest, after checking that every file it lists (or those of `names` it lists) is there, whole and
    unchanged."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, digest in manifest.files.items():
        if names is not None and name not in names:
            continue
        if not (directory / name).is_file():
            fail(str(directory / name), "missing from the checkpoint")
        if sha256(directory / name) != digest:
            fail(str(directory / name), "checksum mismatch: the file was truncated or changed after it was written")
    if MODEL_FILE not in manifest.files:
        fail(str(directory / MANIFEST_FILE), f"lists no {MODEL_FILE}")
    return manifest


def load_checkpoint(directory) -> tuple[ModelSpec, dict, Manifest]:
    """(spec, state dict, manifest) of a checkpoint, verified first."""
    manifest = verify_checkpoint(directory)
    state = load_model_state(directory, manifest.model)
    return manifest.model, state, manifest


def load_model_state(directory, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """model.safetensors of a checkpoint already verified, checked against `spec`."""
    state = load_tensor_file(directory, MODEL_FILE)
    check_state_dict(spec, state, str(Path(directory) / MODEL_FILE))
    return state


def load_tensor_file(directory, name: str) -> dict[str, torch.Tensor]:
    """A safetensors file of a checkpoint already verified (`verify_checkpoint`)."""
    return read_safetensors(Path(directory) / name)


def load_json_file(directory, name: str) -> dict:
    """A JSON file of a checkpoint already verified (`verify_checkpoint`)."""
    return read_json_object(Path(directory) / name)
