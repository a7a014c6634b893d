"""Hardware profiles shipped with fastml: one JSON file per machine kind, each citing its `source`."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

from fastml.config import fail

_HERE = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in _HERE.glob("*.json"))


@cache
def load(name: str) -> dict:
    path = _HERE / f"{name}.json"
    if not path.is_file():
        fail("hardware.profile", f"{name!r} is not a shipped profile; choose one of {', '.join(names())}")
    return json.loads(path.read_text())


def fingerprint(name: str) -> str:
    """A short hash of the profile's contents: plans record it to notice a profile that changed under them."""
    return fingerprint_of(load(name))


def fingerprint_of(profile: dict) -> str:
    return hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()[:16]


def for_device_name(device_name: str) -> str | None:
    """The profile whose `device_names` lists this GPU name (as torch or nvidia-smi report it), if any."""
    for name in names():
        if device_name in load(name)["device_names"]:
            return name
    return None


def peak_flops(name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of the profile for a matmul dtype; None where the profile has none."""
    return load(name)["gpu"]["peak_flops"].get(dtype)
