"""Turns the plan's knobs into changes of the plain model, one function per concern, applied in torchtitan's order by
`apply_plan`: module conversions first (fp8 linears, fp8.py, their weight caches included; linears whose weight
gradients a zero-bubble schedule puts off, deferred.py), then recompute, then compile. Every conversion runs before
recompute, which wraps the forward of the module as it then is, so no later change of class can bypass it
(`check_recompute_intact` says so if one ever did); compile traces that wrapped forward. The model is still on the
meta device throughout; loop/build.py places and materializes it."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fastml.layout import splits_backward
from fastml.plan import Knobs, fp8_cached_blocks
from fastml.executor.model import deferred, fp8
from fastml.executor.model.transformer import Transformer

# Said once per process for every compiled checkpoint with a policy (`_recompute_everything`), to ask that it hold no
# in-place ops: the blocks hold none.
logging.getLogger("torch._higher_order_ops.wrap").addFilter(lambda record: "context_fn is passed" not in
                                                             record.getMessage())


def apply_plan(model: Transformer, knobs: Knobs, num_gpus: int = 1) -> Transformer:
    """The knobs that change the model's modules, on a meta model of a job of `num_gpus` ranks."""
    if knobs.matmul_dtype == "fp8":
        fp8.convert_to_fp8(model, fp8_cached_blocks(knobs, len(model.blocks), num_gpus), knobs.fp8_backward_fast_accum)
    if splits_backward(knobs.pipeline_schedule):
        deferred.convert(block for _, block in model.held_blocks())
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
    for _, block in model.held_blocks():
        for part in parts:
            for module in recompute_targets(block, part):
                _checkpoint_forward(module, compiled)


def _checkpoint_forward(module: nn.Module, compiled: bool) -> None:
    # The module's forward is wrapped where it is (not in a wrapper module), so parameter names, and with them
    # checkpoints, offload and sharding, are unchanged, and what wraps the module's call later (compile, the placement's
    # hooks) wraps the recomputed forward.
    forward = module.forward
    # Traced by torch.compile (2.11), a plain checkpoint tags for recompute the ops it sees itself but not those inside
    # an autograd.Function (fp8.FP8Matmul, fp8.FP8FeedForwardFunction): the partitioner then saved the fp8 linears'
    # casts and GEMM outputs, 14 GiB more than the inputs for Llama-3.2-3B (benchmarks/NOTES.md). A policy that
    # recomputes every op tags those too. Eager checkpoints need none, and skip the dispatch mode's cost per op.
    context = {"context_fn": _recompute_everything} if compiled else {}

    @functools.wraps(forward)
    def recomputed(*args):
        return checkpoint(forward, *args, use_reentrant=False, **context)

    recomputed.recomputes = type(module)  # the class whose forward it recomputes: check_recompute_intact
    module.forward = recomputed


def check_recompute_intact(model: nn.Module) -> None:
    """Every recomputed module still is of the class whose forward its recompute wraps: a change of class after
    recompute (a conversion out of apply_plan's order) would run the old forward, silently."""
    for name, module in model.named_modules():
        wrapped = getattr(module.__dict__.get("forward"), "recomputes", None)
        if wrapped is not None and wrapped is not type(module):
            raise RuntimeError(f"{name or 'the model'} became a {type(module).__name__} after its recompute wrapped a "
                               f"{wrapped.__name__}: conversions must come before recompute (apply_plan)")


def _recompute_everything():
    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE)


def apply_compile(model: Transformer) -> None:
    """Compiles each block alone: the blocks share one graph, so compile time does not grow with depth
    (torchtitan's per-block compile).

    The blocks of every model share one code object, the block's forward, and dynamo keeps at most
    `recompile_limit` (8) graphs for a code object; past that it runs the frame eager and only logs a warning. A
    process that builds many models (the GPU tests, a benchmark's plans) reached it: its later "compiled" blocks ran
    eager. So the graphs of models built before are dropped here (a model built again is traced again, its kernels
    taken from inductor's cache on disk), and reaching the limit with one model is an error, not a silent eager run."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for _, block in model.held_blocks():
        block.compile()
