"""Every result file in benchmarks/results/ opens with what produced it: the command, the git commit, the
machine and the date."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_result(filename: str, figures: dict, machine: str | None = None) -> Path:
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "git_commit": _commit(),
              "machine": machine or this_machine(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              **figures}
    path = RESULTS / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def this_machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def gpu_tag() -> str:
    """A short name of this GPU for file names: its shipped profile's ('h200' for 'NVIDIA H200', 'h100-sxm' for
    'NVIDIA H100 80GB HBM3'), else the name's last word; 'cpu' without one (dry runs)."""
    import torch

    from fastml import hwprofiles

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    return hwprofiles.for_device_name(name) or name.split()[-1].lower()


def machine_tag() -> str:
    """`gpu_tag`, with the number of GPUs where there are several ('h200x2'): what ran on two GPUs is kept apart
    from what ran on one."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return gpu_tag() + (f"x{count}" if count > 1 else "")


def _commit() -> str | None:
    """$GIT_COMMIT (the GPU machine's copy of the tree carries no trustworthy history), else HEAD, marked "+dirty"
    when tracked files differ from it: a figure is never credited to a commit whose code did not run."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "HEAD")
    if not head:
        return None
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
