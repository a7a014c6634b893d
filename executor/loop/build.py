"""The model a plan trains: built on the meta device, the plan's module changes applied (model/apply.py), its groups
placed (memory/placement.py: offload, and with several ranks the sharding engine of parallel/shard.py), then
materialized on the device."""

from __future__ import annotations

import torch

from fastml.plan import Knobs, Plan
from fastml.executor import native
from fastml.executor.memory.optim import DTYPES
from fastml.executor.memory.placement import Placement
from fastml.executor.memory.streams import Copier
from fastml.executor.model import fp8, fused
from fastml.executor.model.apply import apply_plan, check_recompute_intact
from fastml.executor.model.transformer import Transformer, build_model, layer_groups, materialize
from fastml.executor.parallel.shard import DataParallel
from fastml.executor.parallel.pipeline import PipelineParallel
from fastml.executor.parallel.tensor import TensorParallel
from fastml.executor.parallel.world import SINGLE, World


def uses_cuda_ops(knobs: Knobs) -> bool:
    """Whether a GPU run of these knobs calls fastml's CUDA ops: fp8 casts, or the AdamW of bf16 masters or moments."""
    return knobs.matmul_dtype == "fp8" or knobs.uses_fastml_adamw


def build_training_model(plan: Plan, device: torch.device, world: World = SINGLE, comm=None,
                         tp: TensorParallel | None = None, pp: PipelineParallel | None = None) -> Transformer:
    """Meta model, plan applied, then materialized on `device` in the plan's parameter dtype (the matmuls compute in
    that dtype too, fp32 with fp32 parameters and bf16 with bf16, but the blocks' fp8 linears), streamed blocks'
    weights straight into host memory, sharded ones straight into this rank's shard. Its placement is
    `model.placement`, and with several data-parallel ranks that holds the sharding engine (`placement.parallel`, over
    the collectives `comm`). Under tensor parallelism (`tp`) the model is this rank's slice, under pipeline
    parallelism (`pp`) its stages' blocks, and all of this applies to what it holds."""
    if plan.knobs.matmul_dtype == "fp8":
        fp8.check_fp8(device)
    fused.require_triton(device)
    if device.type == "cuda" and uses_cuda_ops(plan.knobs):
        native.load_cuda()  # built now, before training starts (and before compile traces the ops)
    model = apply_plan(build_model(plan.model, tp, pp), plan.knobs, world.size)
    dtype = DTYPES[plan.knobs.param_dtype]
    shapes = {group: {name: p.shape for name, p in named} for group, named in layer_groups(model).items()}
    copier = Copier(device)
    parallel = DataParallel(plan, world.data, device, comm, shapes, dtype, copier) if world.data.distributed else None
    placement = Placement(plan, shapes, device, copier, dtype, parallel)
    materialize(model, device, dtype, seed=plan.training.seed,
                keep=placement.keep if placement.places_parameters else None)
    placement.install(model)
    model.placement = placement
    fp8.refresh_weight_caches(model)  # the cached blocks' weights in fp8, before the meter first counts them
    check_recompute_intact(model)
    return model
