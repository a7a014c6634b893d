"""`--set knobs.NAME=VALUE`: a pinned knob keeps its value in every plan the search weighs, or the plan is refused.

A pin ties other knobs: ZeRO's stages build on each other, a host cache of gathered weights needs sharded weights,
cached fp8 weights need fp8 matmuls, and so on (`_ties`). Those the user left free are narrowed to what the pin
needs; one the user pinned otherwise, or a pin this hardware cannot apply (offload on a CPU, which trains in host
memory; sharding or collectives with one GPU; a dtype without a peak; an offload fraction that moves no whole layer),
is one `UserError` naming the knob, before anything is measured or searched.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastml.config import fail, from_dict
from fastml.layout import layout_problem
from fastml.plan import (KNOBS, OFFLOAD_FRACTIONS, STREAM_MASTERS_NEEDS, ZERO_BUBBLE_NEEDS, ZERO_STAGES, Knobs,
                         fp8_shape_problem, tensor_slice)
from fastml.spec import ModelSpec


@dataclass(frozen=True)
class Device:
    """What pins are checked against: the hardware of a plan, known before a CPU is measured."""

    name: str
    """For messages: "this CPU", or the profile's name."""
    kind: str
    """"cuda", or "cpu" (which trains in host memory)."""
    num_gpus: int
    num_nodes: int
    dtypes: tuple[str, ...]
    """The matmul dtypes it has a peak for."""

    @classmethod
    def of(cls, machine) -> Device:
        return cls(machine.profile, machine.device, machine.num_gpus, machine.num_nodes,
                   tuple(machine.gpu.peak_flops))


def checked_pins(pins: dict, spec: ModelSpec, seq_len: int, device: Device, device_knobs: dict | None = None) -> dict:
    """The knobs to fix for `pins` (`knobs.*` assignments, each of its knob's type) on `device`: the pins, the knobs
    the device trains with (`device_knobs`, where not pinned), and the values of other knobs the pins need
    (`_ties`). A pin that cannot hold is a UserError."""
    for name, value in pins.items():
        if reason := _not_on_device(name, value, spec, seq_len, device):
            fail(f"knobs.{name}", f"{value!r}: {reason}")
    device_knobs = device_knobs or {}
    fixed = {**device_knobs, **pins}
    pending = list(fixed)
    while pending:
        name = pending.pop()
        for other, needed in _ties(name, fixed[name], fixed).items():
            needs = f"{fixed[name]!r} needs knobs.{other} {needed!r}"
            if other not in fixed:
                if reason := _not_on_device(other, needed, spec, seq_len, device):
                    fail(f"knobs.{name}", f"{needs}, and {reason}")
                fixed[other] = needed
                pending.append(other)
            elif fixed[other] != needed:
                by = ("is pinned to" if other in pins else f"{device.name} trains with" if other in device_knobs
                      else "another pin sets it to")
                fail(f"knobs.{name}", f"{needs}, which {by} {fixed[other]!r}")
    cpu_steps_pinned_off = "offload_optimizer" in fixed and round(fixed["offload_optimizer"] * spec.num_layers) == 0
    if fixed.get("overlap_cpu_step") and cpu_steps_pinned_off:
        fail("knobs.overlap_cpu_step", "overlaps the CPU's optimizer step, and knobs.offload_optimizer "
                                       f"{fixed['offload_optimizer']} steps nothing on the CPU")
    if fixed.get("stream_masters"):
        for name in STREAM_MASTERS_NEEDS:
            if name in fixed and round(fixed[name] * spec.num_layers) == 0:
                fail("knobs.stream_masters", "streams the fp32 masters of blocks that are streamed and step on the "
                                             "CPU with their masters and gradients on the host, and "
                                             f"knobs.{name} {fixed[name]} leaves no such block")
    if fixed.get("share_host_weights") and round(fixed.get("offload_weights", 1.0) * spec.num_layers) == 0:
        fail("knobs.share_host_weights", "shares the host copy of streamed weights, and knobs.offload_weights "
                                         f"{fixed['offload_weights']} streams no block")
    streams_all = round(fixed.get("offload_weights", 0.0) * spec.num_layers) == spec.num_layers
    for name in ("cache_weights_on_host", "cache_fp8_weights"):
        if fixed.get(name) and streams_all:
            fail(f"knobs.{name}", "caches the weights of blocks that stay on the GPU, and knobs.offload_weights "
                                  f"{fixed['offload_weights']} streams every block from the host")
    knobs = from_dict(Knobs, fixed, "knobs")  # what else the plan's own rules refuse, before the search
    # the layout on this model and hardware (a pipeline's micro-batches are checked with the batch: make_plan)
    knob, why = layout_problem(knobs.tensor_parallel, knobs.sequence_parallel, knobs.pipeline_parallel,
                               knobs.virtual_stages, knobs.pipeline_parallel, spec.num_heads,
                               spec.num_kv_heads, spec.ffn_hidden_size, spec.vocab_size, spec.num_layers, seq_len,
                               device.num_gpus, -(-device.num_gpus // device.num_nodes))
    if knob:
        fail(f"knobs.{knob}", why)
    if knobs.matmul_dtype == "fp8" and knobs.tensor_parallel > 1:
        if why := fp8_shape_problem(tensor_slice(spec, knobs.tensor_parallel), seq_len):
            fail("knobs.tensor_parallel", f"{knobs.tensor_parallel} with fp8 matmuls, a rank's slices: {why}")
    return fixed


def pinned_space(space: dict[str, tuple], fixed: dict, spec: ModelSpec) -> dict[str, tuple]:
    """The search space with each knob of `fixed` (`checked_pins`) at its one value; where a pinned cache needs
    blocks whose weights stay on the GPU, offload_weights left below every block; where a pinned overlap needs a CPU
    step, offload_optimizer above none; where pinned streamed masters need a block to stream, the knobs that make one
    above none; where pinned shared host weights need streamed blocks the CPU steps, offload_weights above none and
    at most offload_optimizer."""
    space = {**space, **{name: (value,) for name, value in fixed.items()}}
    # a searched layout keeps to the pins it does not compose with (fastml.plan.Knobs)
    if fixed.get("comm") == "memcpy" or fixed.get("share_host_weights"):
        space |= {name: (1,) for name in ("tensor_parallel", "pipeline_parallel") if name in space}
    fractions = [fixed[name] for name in OFFLOAD_FRACTIONS if name in fixed]
    if any(0 < f < 1 for f in fractions) and "pipeline_parallel" in space:
        space["pipeline_parallel"] = (1,)
    # Knobs that must offload at least one block: a CPU step to overlap, a block to stream the masters of.
    needed = (("offload_optimizer",) if fixed.get("overlap_cpu_step") else ()) + \
        (STREAM_MASTERS_NEEDS if fixed.get("stream_masters") else ()) + \
        (("offload_weights",) if fixed.get("share_host_weights") else ())
    for name in (n for n in dict.fromkeys(needed) if n in space):
        space[name] = tuple(f for f in space[name] if round(f * spec.num_layers) > 0)
    if fixed.get("share_host_weights") and "offload_weights" in space:  # streamed blocks the CPU steps
        space["offload_weights"] = tuple(f for f in space["offload_weights"] if f <= fixed["offload_optimizer"])
    if (fixed.get("cache_weights_on_host") or fixed.get("cache_fp8_weights")) and "offload_weights" in space:
        space["offload_weights"] = tuple(f for f in space["offload_weights"]
                                         if round(f * spec.num_layers) < spec.num_layers)
    return space


def _ties(name: str, value, fixed: dict) -> dict[str, object]:
    """The values other knobs must take for knob `name` to hold `value` in a plan (beside the knobs `fixed` so far):
    what the plan's rules require (fastml.plan.Knobs) and what the search would otherwise undo as a no-op
    (planner/search.py `without_no_ops`)."""
    if name in ZERO_STAGES:  # ZeRO's stages build on each other: on needs the stages below, off the ones above
        stage = ZERO_STAGES.index(name)
        return dict.fromkeys(ZERO_STAGES[:stage] if value else ZERO_STAGES[stage + 1:], bool(value))
    if name == "cache_weights_on_host" and value:
        return {"shard_weights": True}
    if name == "cache_fp8_weights" and value:  # weights sharded over GPUs are cast as they are gathered
        return {"matmul_dtype": "fp8", "shard_weights": False}
    if name == "fp8_backward_fast_accum" and value:
        return {"matmul_dtype": "fp8"}
    if name == "overlap_cpu_step" and value and not fixed.get("share_host_weights"):  # sharded, the ranks gather
        return {"shard_optimizer": False}
    if name == "share_host_weights" and value:  # left free, every block stepped on the CPU covers what is streamed
        return {"shard_optimizer": True, "shard_weights": False,
                **({} if "offload_optimizer" in fixed else {"offload_optimizer": 1.0})}
    if name == "stream_masters" and value:
        return {"shard_optimizer": False, "master_dtype": "fp32", "param_dtype": "bf16"}
    if name == "offload_master" and value:  # bf16 masters are the weights themselves: no copy to move
        return {"master_dtype": "fp32"}
    if name == "master_dtype" and value != "fp32":
        return {"param_dtype": "bf16"}
    if name == "matmul_dtype":
        return {"param_dtype": "fp32" if value == "fp32" else "bf16"}
    if name == "pipeline_schedule" and value == "zero_bubble":  # what its split backward pass does not compose with
        return dict(ZERO_BUBBLE_NEEDS)
    if name in ("tensor_parallel", "pipeline_parallel") and value > 1:  # what a layout does not compose with (Knobs)
        return {"comm": "nccl", "share_host_weights": False}
    if name == "param_dtype" and value == "fp32":
        return {"matmul_dtype": "fp32"}
    return {}


def _not_on_device(name: str, value, spec: ModelSpec, seq_len: int, device: Device) -> str:
    """Why `device` cannot apply knob `name` at `value`, or "" where it can."""
    info, default = KNOBS[name], Knobs.__dataclass_fields__[name].default
    if name in ("matmul_dtype", "param_dtype"):  # fp32 parameters compute in fp32, bf16 ones in bf16 or fp8
        wanted = [value] if name == "matmul_dtype" else ["fp32"] if value == "fp32" else ["bf16", "fp8"]
        if not set(wanted) & set(device.dtypes):
            if device.kind == "cpu":
                return f"{device.name} computes in {' and '.join(device.dtypes)} only"
            return (f"{device.name} has no {wanted[0]} tensor cores (its profile has a peak for "
                    f"{' and '.join(device.dtypes)})")
        return fp8_shape_problem(spec, seq_len) if name == "matmul_dtype" and value == "fp8" else ""
    if value == default:
        return ""  # off, or the default, does nothing anywhere
    if name == "overlap_cpu_step" and device.kind == "cpu":
        return f"{device.name} trains in host memory: its optimizer step is the device's own, nothing to overlap"
    if info.kind == "offload" and device.kind == "cpu":
        return (f"{device.name} trains in host memory, so offload to host memory would move nothing; leave it at "
                f"{default}")
    if info.kind == "offload" and round(value * spec.num_layers) == 0:
        return (f"that is no whole layer of {spec.name}'s {spec.num_layers}: offload at least "
                f"{1 / spec.num_layers:.3g}")
    if info.multi_gpu and device.num_gpus == 1:
        return "it acts between GPUs (or CPU processes), and the plan has one: give --gpus N"
    if name == "comm" and device.num_nodes > 1:
        return "the memcpy collectives copy through one node's host memory; across nodes use 'nccl'"
    if name == "share_host_weights" and device.num_nodes > 1:
        return "the weights are shared in one node's host memory; a plan for several nodes cannot share them"
    return ""
