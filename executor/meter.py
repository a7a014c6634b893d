"""Measures each training step: time, throughput, MFU against the dense peak of the plan's matmul dtype, memory."""

from __future__ import annotations

import resource
import statistics
import sys
import time

import torch

from fastml import hwprofiles
from fastml.plan import Plan


class Meter:
    """Times each step and turns it into throughput, MFU and memory figures."""

    def __init__(self, plan: Plan, device: torch.device):
        self.plan = plan
        self.device = device
        self.peak_flops, self.peak_name = peak_flops(device, plan.knobs.matmul_dtype)
        self.flops_per_token = plan.model.flops_per_token(plan.training.seq_len)
        self.records: list[dict] = []
        self.start = self.last = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def measure(self, record: dict) -> dict:
        """Adds the time since the last step, and the figures that follow from it, to the step's record."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        step_time_s, self.last = now - self.last, now
        tokens_per_s = self.plan.training.global_batch_tokens / step_time_s
        record.update(
            step_time_s=step_time_s, tokens_per_s=tokens_per_s, mfu=self._mfu(tokens_per_s),
            peak_gpu_memory_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None)
        self.records.append(record)
        return record

    def summary(self) -> dict:
        # The first step carries compilation and allocator warm-up; steady-state figures leave it out.
        steady = self.records[1:] or self.records
        step_time_s = statistics.median(r["step_time_s"] for r in steady)
        tokens_per_s = self.plan.training.global_batch_tokens / step_time_s
        return {
            "steps": len(self.records), "total_time_s": time.perf_counter() - self.start,
            "first_loss": self.records[0]["loss"], "last_loss": self.records[-1]["loss"],
            "skipped_steps": sum(r["skipped"] for r in self.records),
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "mfu": self._mfu(tokens_per_s),
            "mfu_peak": self.peak_name, "peak_gpu_memory_bytes": self.records[-1]["peak_gpu_memory_bytes"],
            "peak_host_memory_bytes": peak_host_memory_bytes(),
        }

    def _mfu(self, tokens_per_s: float) -> float | None:
        return self.flops_per_token * tokens_per_s / self.peak_flops if self.peak_flops else None


def peak_flops(device: torch.device, dtype: str) -> tuple[float | None, str]:
    """The peak of `dtype` matmuls that MFU is measured against (a GPU's dense peak from its shipped profile, a CPU's
    measured peak from its cached profile), and its description: device, dtype, FLOP/s."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = hwprofiles.for_device_name(name)
    else:
        name = profile = "cpu"
    peak = hwprofiles.peak_flops(profile, dtype) if profile else None
    if peak:
        kind = "dense" if device.type == "cuda" else "measured"
        return peak, f"{name} {kind} {dtype} {peak / 1e12:.3g} TFLOP/s"
    why = "no shipped profile" if profile is None else f"its profile has no {dtype} peak"
    return None, f"{name} {dtype}: {why}, MFU n/a"


def peak_host_memory_bytes() -> int:
    """The most host memory this process has held so far: its peak resident set (in KiB, but bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
