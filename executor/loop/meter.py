"""Measures each training step: time, throughput, MFU against the dense peak of the plan's matmul dtype, and memory,
by the planner's categories, on the GPU and in host memory."""

from __future__ import annotations

import contextlib
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from fastml import hwprofiles
from fastml.plan import MEMORY_CATEGORIES, Plan
from fastml.executor.memory.shared import others_share_bytes, sharers
from fastml.executor.parallel.collectives import agree
from fastml.executor.model import fp8

TensorsByCategory = Callable[[], Mapping[str, Iterable[torch.Tensor | None]]]
# The categories whose bytes are tensors the executor holds and lists (`tensors_by_category`); activations only as
# host buffers (offloaded residuals): on the GPU they are what a forward pass leaves allocated (Meter.forward).
LISTED_CATEGORIES = tuple(name for name in MEMORY_CATEGORIES if name != "workspace")


class Meter:
    """Times each step and turns it into throughput, MFU and memory figures.

    Memory by category needs two calls from the step, both cheap: `with meter.forward():` around each micro-batch's
    forward pass (two reads of the allocator's counter), and `meter.sample_states()` once the step's gradients are
    complete, before the optimizer step (a walk over the tensors `tensors_by_category` lists). The latest of each
    counts; `gpu_memory` and `host_memory` say what each measured figure means."""

    def __init__(self, plan: Plan, device: torch.device, tensors_by_category: TensorsByCategory | None = None):
        self.plan = plan
        self.device = device
        self.tensors_by_category = tensors_by_category
        self.forward_kept_bytes: int | None = None
        self.state_bytes: tuple[dict[str, int], dict[str, int]] | None = None  # (GPU, host) by category
        # MFU is the job's: its tokens/s against all its GPUs' peaks, or the whole CPU's, which the ranks share.
        peak, self.peak_name = peak_flops(device, plan.knobs.matmul_dtype)
        self.peak_flops = peak * plan.hardware.num_gpus if peak and device.type == "cuda" else peak
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
        on_gpu = self.device.type == "cuda"
        peak_rss = peak_host_memory_bytes()
        gpu_memory, host_memory = self.memory_by_category(peak_rss)
        record.update(
            step_time_s=step_time_s, tokens_per_s=tokens_per_s, mfu=self._mfu(tokens_per_s),
            peak_gpu_memory_bytes=torch.cuda.max_memory_allocated(self.device) if on_gpu else None,
            peak_host_memory_bytes=peak_rss,
            # By category, as measured so far (the run's peaks): the log carries what the closing table shows.
            memory_bytes=gpu_memory if on_gpu else None, host_memory_bytes=host_memory)
        self.records.append(record)
        return record

    def restart_clock(self) -> None:
        """The time since the last step belongs to none (a trace being written): the next step's starts now."""
        self.last = time.perf_counter()

    @contextlib.contextmanager
    def forward(self):
        """Around a micro-batch's forward pass, up to its loss: on a GPU, the memory the pass leaves allocated for the
        backward pass is recorded (the latest pass counts, so the first step's one-time allocations do not)."""
        if self.device.type != "cuda":
            yield
            return
        before = torch.cuda.memory_allocated(self.device)  # the allocator's own count: no synchronization needed
        yield
        self.forward_kept_bytes = torch.cuda.memory_allocated(self.device) - before

    def sample_states(self) -> None:
        """Measures the tensors of `tensors_by_category` by category, on the GPU and on the host. Call it when they
        are all alive: after the last micro-batch's backward pass, before the optimizer step."""
        if self.tensors_by_category is not None:
            self.state_bytes = storage_bytes(self.tensors_by_category())

    def memory_by_category(self, peak_rss: int) -> tuple[dict[str, int | None], dict[str, int | None]]:
        """Measured memory by category, (GPU, host), with the process's peak resident memory `peak_rss`:
        `gpu_memory` and `host_memory` say what each figure is."""
        listed_gpu, listed_host = self.state_bytes or (None, None)
        if self.device.type != "cuda":
            return dict.fromkeys(MEMORY_CATEGORIES), host_memory(listed_host, peak_rss, on_gpu=False)
        return (gpu_memory(listed_gpu, self.forward_kept_bytes, torch.cuda.max_memory_allocated(self.device)),
                host_memory(listed_host, peak_rss, on_gpu=True))

    def summary(self) -> dict:
        # The first step carries compilation and allocator warm-up, a traced one the profiler's own work: steady-state
        # figures leave them out.
        steady = [r for r in self.records[1:] if not r.get("traced")] or self.records
        step_time_s = statistics.median(r["step_time_s"] for r in steady)
        tokens_per_s = self.plan.training.global_batch_tokens / step_time_s
        peak_rss = peak_host_memory_bytes()
        gpu_memory, host_memory = self.memory_by_category(peak_rss)
        on_gpu = self.device.type == "cuda"
        return {
            "steps": len(self.records), "total_time_s": time.perf_counter() - self.start,
            "first_loss": self.records[0]["loss"], "last_loss": self.records[-1]["loss"],
            "skipped_steps": sum(r["skipped"] for r in self.records),
            "step_time_s": step_time_s, "tokens_per_s": tokens_per_s, "mfu": self._mfu(tokens_per_s),
            "mfu_peak": self.peak_name, "peak_gpu_memory_bytes": self.records[-1]["peak_gpu_memory_bytes"],
            # What the allocator held at most, its cache included: the figure a GPU memory cap limits.
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(self.device) if on_gpu else None,
            "peak_host_memory_bytes": peak_rss,
            "memory_bytes": gpu_memory if on_gpu else None, "host_memory_bytes": host_memory,
        }

    def _mfu(self, tokens_per_s: float) -> float | None:
        """At most 1: a CPU's peak is the best rate measured on it, and a run can beat measurements taken under load."""
        if not self.peak_flops:
            return None
        mfu = self.flops_per_token * tokens_per_s / self.peak_flops
        if mfu > 1 and "beat" not in self.peak_name:
            self.peak_name += " (the run beat this peak, measured under load: `fastml profile` measures it again)"
        return min(1.0, mfu)


def peak_flops(device: torch.device, dtype: str) -> tuple[float | None, str]:
    """The peak of `dtype` matmuls that MFU is measured against (a GPU's dense peak from its shipped profile, a CPU's
    measured peak from its cached profile), and its description: device, dtype, FLOP/s (of one GPU)."""
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


def proportional_host_bytes() -> int | None:
    """This process's resident host memory now, each page it shares with other processes counted as its share (the
    kernel's proportional set size: memory the node's ranks share is counted once over them); None where the kernel
    does not say (not Linux)."""
    try:
        rollup = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    pss = re.search(r"^Pss:\s+(\d+) kB", rollup, re.MULTILINE)
    return int(pss[1]) * 1024 if pss else None


def node_host_memory_bytes(world) -> int | None:
    """The host memory of this rank's node now: the proportional set sizes of its ranks' processes, summed (every
    rank calls it: a collective). None where the kernel does not say."""
    rows = agree([float(proportional_host_bytes() or -1)])
    first = world.node * world.local_size  # a launcher numbers the ranks of a node one after another
    node = [row[0] for row in rows[first:first + world.local_size]]
    return None if min(node) < 0 else int(sum(node))


def gpu_memory(listed: dict[str, int] | None, forward_kept: int | None, peak: int) -> dict[str, int | None]:
    """GPU memory by category, None where not measured (a call of the step missing). weights, master_weights,
    gradients, optimizer_states and comm_buffers: the bytes of the distinct GPU storages listed under each
    (`Meter.sample_states`, `listed`); activations: what the last micro-batch's forward pass left allocated
    (`Meter.forward`, `forward_kept`: the tensors kept for the backward pass, and the loss with the head's gradients
    that its forward pass makes, executor/model/loss.py); workspace: the rest of the run's `peak`
    (torch.cuda.max_memory_allocated): the backward pass's and the optimizer's temporaries, library workspaces,
    allocator rounding. So they add up to the peak, unless the gradients and the activations were never all alive at
    once (gradients made by a backward pass that frees activations, none kept from an earlier micro-batch): then their
    sum exceeds the peak and workspace is 0. The planner predicts the same figures (planner/memory.py `Memory.gpu`)."""
    measured = dict.fromkeys(MEMORY_CATEGORIES)
    if listed is not None:
        measured.update({name: listed[name] for name in LISTED_CATEGORIES if name != "activations"})
    measured["activations"] = forward_kept
    known = [measured[name] for name in MEMORY_CATEGORIES if name != "workspace"]
    if None not in known:
        measured["workspace"] = max(0, peak - sum(known))
    return measured


def host_memory(listed: dict[str, int] | None, peak_rss: int, on_gpu: bool) -> dict[str, int | None]:
    """Host memory by category, None where not measured: the bytes of the distinct host storages listed under each
    category (pinned buffers included; of host memory the node's ranks share, this rank's share); workspace: the
    rest of the process's peak resident memory `peak_rss`, less the other ranks' shares of what they share (torch,
    the CUDA context, data; and training a CPU, its activations and temporaries, which are not listed)."""
    measured = dict.fromkeys(MEMORY_CATEGORIES)
    if listed is not None:
        measured.update(listed)
        if not on_gpu:
            measured["activations"] = None
        # the other ranks' shares of the memory the node's ranks share are in this process's resident set too
        measured["workspace"] = max(0, peak_rss - others_share_bytes() - sum(listed.values()))
    return measured


def storage_bytes(tensors_by_category: Mapping[str, Iterable[torch.Tensor | None]],
                  on_gpu: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda,
                  ) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of the listed tensors by category, (on the GPU, on the host), counting each storage once and whole: the
    views of one flat buffer count as the buffer; a tensor listed under two categories counts under the first in
    MEMORY_CATEGORIES order (fp32 parameters that are their own masters are weights). None entries (a parameter
    without a gradient) are passed over."""
    unknown = set(tensors_by_category) - set(LISTED_CATEGORIES)
    if unknown:
        raise ValueError(f"not measured by listing tensors: {', '.join(sorted(unknown))}; list only "
                         f"{', '.join(LISTED_CATEGORIES)}")
    gpu, host = dict.fromkeys(LISTED_CATEGORIES, 0), dict.fromkeys(LISTED_CATEGORIES, 0)
    seen = set()
    for name in LISTED_CATEGORIES:
        for tensor in tensors_by_category.get(name, ()):
            if tensor is None:
                continue
            storage, gpu_side = tensor.untyped_storage(), on_gpu(tensor)
            if gpu_side and name == "activations":
                raise ValueError("activations on the GPU are measured from the allocator (Meter.forward): list only "
                                 "host buffers under activations")
            key = (tensor.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                # a segment the node's ranks share: this rank's share of it (memory/shared.py)
                (gpu if gpu_side else host)[name] += storage.nbytes() // (1 if gpu_side else sharers(tensor))
    return gpu, host


def memory_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors of each memory category, wherever they are (the meter tells GPU from host by their storage)."""
    params = list(model.parameters())
    states = [optimizer.state[p] for p in params if p in optimizer.state]
    tensors = {"weights": params + [b for m in fp8.cached_linears(model) for b in m.buffers()],
               "master_weights": [s.get("master") for s in states],
               "gradients": [p.grad for p in params],
               "optimizer_states": [s[k] for s in states for k in ("exp_avg", "exp_avg_sq", "master_low") if k in s]}
    for category, listed in model.placement.tensors_by_category().items():
        tensors[category] = tensors.get(category, []) + listed
    return tensors
