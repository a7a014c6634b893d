"""The device a plan trains on, and whether it is the hardware the plan was made for."""

from __future__ import annotations

import os

import torch
from rich.console import Console

from fastml import hwprofiles
from fastml.config import fail
from fastml.plan import Plan


def training_device(plan: Plan) -> torch.device:
    if plan.hardware.device == "cuda":
        # Segments that grow in place leave less memory stranded between differently sized blocks (read by the
        # allocator at its first use, so set before anything is allocated).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if not torch.cuda.is_available():
            fail("hardware.device", "the plan is for a GPU but none is available here; plan again on this "
                                    "machine (`fastml plan`)")
    if plan.hardware.num_gpus > 1:
        fail("hardware.num_gpus", f"{plan.hardware.num_gpus}: this executor trains on one device only so far")
    return torch.device("cuda" if plan.hardware.device == "cuda" else "cpu")


def check_hardware(plan: Plan, device: torch.device, strict: bool, console: Console) -> None:
    """A plan's predictions hold for the hardware it was made for: say so when this is other hardware."""
    here = "cpu" if device.type == "cpu" else hwprofiles.for_device_name(torch.cuda.get_device_name(device))
    planned = plan.hardware.profile.removeprefix("detected-")
    if here == planned and (not plan.hardware.fingerprint or planned != plan.hardware.profile
                            or plan.hardware.fingerprint == hwprofiles.fingerprint(here)):
        return
    message = (f"the plan was made for {plan.hardware.profile or 'an unknown GPU'} "
               f"(fingerprint {plan.hardware.fingerprint or '-'}) but runs on {here or 'an unknown GPU'}"
               f"{'' if here != planned else ' whose profile has changed since'}: its predictions do not apply")
    if strict:
        fail("hardware.profile", message)
    console.print(f"[yellow]warning:[/] {message} (--strict refuses such a plan)")
