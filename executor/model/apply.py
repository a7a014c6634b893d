"""Turns the plan's knobs into changes of the plain model, one function per concern, applied in torchtitan's order:
module conversions (fp8 linears, fp8.py), then recompute, then compile (`apply_plan`); then sharding and offload, as
the model is materialized (`build_training_model`).
Each keeps what the ones before it did: recompute wraps the forward of the modules a conversion has put in place,
and compile traces that wrapped forward. The model is still on the meta device throughout; `build_training_model`
materializes it last, in the plan's parameter dtype."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fastml.plan import Knobs, Plan, fp8_cached_blocks
from fastml.executor.model import fp8, fused
from fastml.executor import native
from fastml.executor.model.transformer import Transformer, build_model, materialize
from fastml.executor.memory.offload import HostOffload
from fastml.executor.memory.optim import DTYPES, layer_groups
from fastml.executor.parallel.shard import DataParallel
from fastml.executor.parallel.world import SINGLE, World

# Said once per process for every compiled checkpoint with a policy (`_recompute_everything`), to ask that it hold no
# in-place ops: the blocks hold none.
logging.getLogger("torch._higher_order_ops.wrap").addFilter(lambda record: "context_fn is passed" not in
                                                             record.getMessage())


def uses_cuda_ops(knobs: Knobs) -> bool:
    """Whether a GPU run of these knobs calls fastml's CUDA ops: fp8 casts, or the AdamW of bf16 masters or moments."""
    return knobs.matmul_dtype == "fp8" or knobs.stochastic_rounding


def build_training_model(plan: Plan, device: torch.device, world: World = SINGLE, comm=None) -> Transformer:
    """Meta model, plan applied, then materialized on `device` in the plan's parameter dtype (the matmuls compute in
    that dtype too, fp32 with fp32 parameters and bf16 with bf16, but the blocks' fp8 linears), streamed blocks'
    weights straight into host memory, sharded ones straight into this rank's shard. Its offload engine is
    `model.offload`, and in a world of several ranks its data-parallel engine `model.offload.parallel` (shard.py,
    over the collectives `comm`)."""
    if plan.knobs.matmul_dtype == "fp8":
        fp8.check_fp8(device)
    fused.require_triton(device)
    if device.type == "cuda" and uses_cuda_ops(plan.knobs):
        native.load_cuda()  # built now, before training starts (and before compile traces the ops)
    model = apply_plan(build_model(plan.model), plan.knobs)
    dtype = DTYPES[plan.knobs.param_dtype]
    parallel = None
    if world.distributed:
        shapes = {layer: {name: p.shape for name, p in named} for layer, named in layer_groups(model).items()}
        parallel = DataParallel(plan, world, device, comm, shapes, dtype)
    offload = HostOffload(model, plan, device, parallel)
    materialize(model, device, dtype, seed=plan.training.seed,
                keep=offload.keep if offload.places_parameters else None)
    offload.install(model, dtype)
    model.offload = offload
    fp8.cache_weights(model, fp8_cached_blocks(plan.knobs, plan.model.num_layers, world.size))
    return model


def apply_plan(model: Transformer, knobs: Knobs) -> Transformer:
    # Module conversions come first, so that recompute wraps the converted forward and not one a conversion would
    # then replace.
    if knobs.matmul_dtype == "fp8":
        fp8.convert_to_fp8(model)
    apply_recompute(model, knobs.recompute, compiled=knobs.compile)
    if knobs.compile:
        apply_compile(model)
    return model


def recompute_targets(block: nn.Module, part: str) -> list[nn.Module]:
    """The submodules of one block whose activations `part` recomputes in the backward pass."""
    attn, ffn = block.attn, block.ffn
    norms = [block.attn_norm, block.ffn_norm] + [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    return {"block": [block], "norm": norms, "ffn": [ffn], "qkv": [attn.qkv],
            "attention": [attn.core]}[part]


def apply_recompute(model: Transformer, parts: tuple[str, ...], *, compiled: bool) -> None:
    """Stores only the inputs of the chosen parts; their insides are recomputed when gradients are needed.
    `block` covers everything else, so with it the finer parts are redundant and skipped. `compiled`: the blocks
    will be compiled (apply_compile), so the checkpoints are traced into their graphs."""
    parts = ("block",) if "block" in parts else parts
    for block in model.blocks:
        for part in parts:
            for module in recompute_targets(block, part):
                _checkpoint_forward(module, compiled)


def _checkpoint_forward(module: nn.Module, compiled: bool) -> None:
    # Replacing the bound forward keeps parameter names (and so checkpoints) unchanged, unlike a wrapper module, and
    # survives what wraps the module's call later (compile, hooks of sharding): they all call `module.forward`.
    forward = module.forward
    # Traced by torch.compile (2.11), a plain checkpoint tags for recompute the ops it sees itself but not those inside
    # an autograd.Function (fp8.FP8Matmul): the partitioner then saved the fp8 linears' casts and GEMM outputs, 14 GiB
    # more than the inputs for Llama-3.2-3B (benchmarks/NOTES.md). A policy that recomputes every op tags those too.
    # Eager checkpoints need none, and skip the dispatch mode's cost per op.
    context = {"context_fn": _recompute_everything} if compiled else {}

    @functools.wraps(forward)
    def recomputed(*args):
        return checkpoint(forward, *args, use_reentrant=False, **context)

    module.forward = recomputed


def _recompute_everything():
    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE)


def apply_compile(model: Transformer) -> None:
    """Compiles each block alone: the blocks share one graph, so compile time does not grow with depth
    (torchtitan's per-block compile)."""
    for block in model.blocks:
        block.compile()
