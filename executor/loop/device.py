"""The device a plan trains on, whether it is the hardware the plan was made for, and the memory it may use: the
GPU memory cap (`--gpu-mem`) and the host memory the plan needs."""

from __future__ import annotations

import dataclasses
import os

import torch
from rich.console import Console

from fastml import hwprofiles
from fastml.config import fail, gib
from fastml.plan import Plan
from fastml.executor.parallel.world import SINGLE, World


ONE_GPU_ENV = "FASTML_TEST_ONE_GPU"
"""Tests only: set (to anything), every rank of a node trains on GPU 0, so that a machine with one GPU runs the
sharding engine and the memcpy collectives on CUDA (NCCL refuses two ranks on one GPU; tests/test_gpu_distributed.py).
Every run under it says so (train.py)."""


def training_device(plan: Plan, world: World = SINGLE) -> torch.device:
    """This rank's device: the GPU of its local rank, or the CPU. The ranks of a node share its cores for their CPU
    work (a CPU job's steps, a GPU job's C++ AdamW), each with `rank_cpu_threads` of torch's threads."""
    if world.distributed:
        torch.set_num_threads(rank_cpu_threads(world.local_size))
    if plan.hardware.device == "cuda":
        # Segments that grow in place leave less memory stranded between differently sized blocks (read by the
        # allocator at its first use, so set before anything is allocated).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        check_gpus(plan)
        if not world.distributed:
            return torch.device("cuda")
        return torch.device("cuda", 0 if os.environ.get(ONE_GPU_ENV) else world.local_rank)
    return torch.device("cpu")


def rank_cpu_threads(ranks_on_node: int) -> int:
    """The threads of each of `ranks_on_node` ranks that work on the node's CPU at once: its share of the cores, what
    the planner prices it at (planner/costs.py, cpu_adam_rate), whatever launched it (torchrun sets OMP_NUM_THREADS=1,
    torch's elastic launcher leaves each rank all the cores). The cores are those this process may run on (a job
    scheduler's or container's limit), not all the machine's."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_on_node)


def check_gpus(plan: Plan) -> None:
    """This node has the GPUs the plan gives it."""
    if not torch.cuda.is_available():
        fail("hardware.device", "the plan is for a GPU but none is available here; plan again on this machine "
                                "(`fastml plan`)")
    present = torch.cuda.device_count()
    if plan.hardware.gpus_per_node > present and not os.environ.get(ONE_GPU_ENV):
        fail("hardware.gpus_per_node", f"the plan is for {plan.hardware.gpus_per_node} GPUs per node but this one "
                                       f"has {present}; plan again on this machine (`fastml plan`)")


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


def with_gpu_memory_cap(plan: Plan, cap_bytes: int) -> Plan:
    """`plan` with its GPU memory capped at `cap_bytes` (`fastml run --gpu-mem`, which wins over the plan's own
    hardware.gpu_memory_bytes). Refused for a plan that trains on a CPU, and above the memory of this machine's GPU:
    a cap the GPU cannot give would promise memory that is not there."""
    if plan.hardware.device != "cuda":
        fail("--gpu-mem", "the plan trains on a CPU, which has no GPU memory to cap; plan for a GPU (`fastml plan "
                          "--device cuda --gpu-mem SIZE`), or cap host memory when planning (--host-mem)")
    device = training_device(plan)  # before CUDA starts: it sets the allocator's options
    total = gpu_total_bytes(device)
    if cap_bytes > total:
        fail("--gpu-mem", f"{gib(cap_bytes)} is more than the {gib(total)} of this GPU "
                          f"({torch.cuda.get_device_name(device)})")
    if plan.predicted is not None and plan.predicted.peak_memory_bytes > cap_bytes:
        fail("--gpu-mem", f"the plan needs {gib(plan.predicted.peak_memory_bytes)} of GPU memory at its peak, more "
                          f"than the {gib(cap_bytes)} cap; plan for the cap (`fastml plan --gpu-mem SIZE`)")
    return dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, gpu_memory_bytes=cap_bytes))


def apply_memory_cap(plan: Plan, device: torch.device, console: Console) -> int | None:
    """Limits this process's CUDA memory to the plan's hardware.gpu_memory_bytes (`--gpu-mem` of plan or run), so
    that a large GPU behaves like a small one, and says in one line what is in effect. Returns the cap, or None for
    the whole GPU. Call it before the first CUDA allocation.

    The limit holds everything torch's caching allocator reserves (its cache included); the CUDA context and
    memory that libraries take outside torch (NCCL) lie outside it. A plan's figure at or above this GPU's memory
    leaves the whole GPU: a plan made for this GPU names its profile's memory, which nvidia-smi counts a little
    higher than CUDA does (a plan for a larger GPU is check_hardware's warning). The limit is set in either case,
    so that a process training several plans in turn (tests, benchmarks) runs each under its own."""
    if device.type != "cuda":
        return None
    total, cap = gpu_total_bytes(device), plan.hardware.gpu_memory_bytes
    capped = 0 < cap < total
    # The allocator refuses to grow past fraction x the total that cudaMemGetInfo reports (gpu_total_bytes), but
    # serves from its cache whatever it holds: memory an earlier run of this process cached goes back first.
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total if capped else 1.0)  # of the current device
    name = torch.cuda.get_device_name(device)
    console.print(f"GPU memory: capped at {gib(cap)} of the {gib(total)} of the {name}" if capped
                  else f"GPU memory: all {gib(total)} of the {name} (no cap)", markup=False, highlight=False)
    return cap if capped else None


def gpu_total_bytes(device: torch.device) -> int:
    """The GPU's memory as CUDA counts it (cudaMemGetInfo), the total a memory fraction is taken of."""
    return torch.cuda.mem_get_info(device)[1]


def check_host_memory(plan: Plan) -> None:
    """Refuses, before training, a plan whose predicted host memory does not fit in this machine's: the pinned
    buffers of what it offloads and the process itself (planner/memory.py's `host` figures for its knobs, which the
    plan carries), and on a CPU the whole of training. A plan without predictions is not checked."""
    if plan.predicted is None:
        return
    needs, has = predicted_host_bytes(plan), hwprofiles.host_memory_bytes()
    if needs > has:
        fail("host memory", f"the plan needs {gib(needs)} ({_host_needs(plan)}) but this machine has {gib(has)}; "
                            f"plan again on this machine (`fastml plan`), which keeps within its memory")


def predicted_host_bytes(plan: Plan) -> int:
    """The host memory the plan predicts: its host total, plus on a CPU its "GPU" total (there the GPU is the host)."""
    p = plan.predicted
    host = sum(p.host_memory_bytes.values())
    return host + plan.hardware.gpus_per_node * p.peak_memory_bytes if plan.hardware.device == "cpu" else host


def _host_needs(plan: Plan) -> str:
    """What the plan's host memory holds, its largest parts first."""
    p = plan.predicted
    parts = dict(p.host_memory_bytes) | ({"training on the CPU": plan.hardware.gpus_per_node * p.peak_memory_bytes}
                                          if plan.hardware.device == "cpu" else {})
    ranked = sorted(((n, b) for n, b in parts.items() if b), key=lambda part: -part[1])
    return ", ".join(f"{name} {gib(num_bytes)}" for name, num_bytes in ranked)


