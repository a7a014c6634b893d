"""The contract between planner and executor: plan.json.

A plan says what to train (`model`, `training`), on what (`hardware`), how (`knobs`, the searched choices) and what
the planner expects of it (`predicted`). It is validated on load and read-only afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastml.config import UserError, check_range, fail, from_dict, read_json, show, to_dict
from fastml.layout import Layout, layout_of, layout_problem
from fastml.spec import MAX_SEQ_LEN, MAX_SIZES, ModelSpec
from fastml.weights import check_same_model, spec_of_weights

PLAN_VERSION = 1
RECOMPUTE_CHOICES = ("norm", "ffn", "qkv", "attention", "block")
MEMORY_CATEGORIES = ("weights", "master_weights", "gradients", "optimizer_states", "activations", "workspace",
                     "comm_buffers")
TIME_COMPONENTS = ("compute", "recompute", "exposed_comm", "exposed_offload", "optimizer", "other")
# Upper bounds far above any real run: an absurd plan is refused at load, before it can hang or exhaust memory.
MAX_STEPS = 10**9
MAX_GLOBAL_BATCH_TOKENS = 2**40
MAX_SEED = 2**63 - 1
MAX_MICRO_BATCH_SIZE = 2**16
MAX_LM_HEAD_CHUNKS = 4096
MAX_NUM_GPUS = 2**20
MAX_MEMORY_BYTES = 2**60
MAX_PLAN_FILE_BYTES = 2**24


@dataclass(frozen=True, kw_only=True)
class WeightedData:
    """One dataset of a blend (`Training.data`): a directory written by `fastml prepare`, or "default", and its share
    of the sequences (the weights of a blend are normalized to sum to 1)."""

    path: str
    weight: float

    def __post_init__(self) -> None:
        check_range("weight", self.weight, 0.0, low_open=True)


@dataclass(frozen=True, kw_only=True)
class Training:
    seq_len: int = 256
    global_batch_tokens: int = 8192
    """Tokens per optimizer step, over all GPUs: micro_batch_size * grad_accum_steps * seq_len * world_size."""
    steps: int = 100
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    data: str | tuple[WeightedData, ...] = "default"
    """A directory written by `fastml prepare`, or "default" for the corpus that ships with Python; or a blend of
    several, each with its weight (executor/storage/data.py's `BlendedData`: in every block of 1,024 sequences each
    dataset has its weight's share, in an order drawn from the seed)."""
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 0
    """Steps between checkpoints; 0 writes one only at the end (when checkpoint_dir is set)."""
    eval_interval: int = 0
    """Steps between evaluations of the validation loss, where the data has a validation split (`fastml prepare
    --validation-fraction`); 0 evaluates at the end only."""
    eval_tokens: int = 16384
    """Tokens each evaluation reads: the validation split's first sequences, the same every time (at most all of
    them, and whole micro-batches of every rank)."""
    init_from: str = ""
    """The weights a run starts from: an HF model directory, or a fastml checkpoint (what `fastml convert --from-hf`
    writes, or a training checkpoint `step-N` of an earlier run); "" for random weights from the seed. A resumed run
    continues from its checkpoint instead. Checked by `check_init_from`."""

    def __post_init__(self) -> None:
        check_range("training.seq_len", self.seq_len, 1, MAX_SEQ_LEN)
        check_range("training.global_batch_tokens", self.global_batch_tokens, 1, MAX_GLOBAL_BATCH_TOKENS)
        check_range("training.steps", self.steps, 1, MAX_STEPS)
        for name in ("warmup_steps", "checkpoint_interval", "eval_interval"):
            check_range(f"training.{name}", getattr(self, name), 0, MAX_STEPS)
        check_range("training.seed", self.seed, 0, MAX_SEED)
        check_range("training.eval_tokens", self.eval_tokens, 1, MAX_GLOBAL_BATCH_TOKENS)
        if isinstance(self.data, tuple):
            paths = [part.path for part in self.data]
            if not paths:
                fail("training.data", "a blend needs at least one dataset")
            if len(set(paths)) < len(paths):
                fail("training.data", f"{next(p for p in paths if paths.count(p) > 1)!r} is listed twice; give it "
                                      f"one weight")
        # AdamW's step is about lr per weight: above 1 it is a typo (3 for 3e-4), never a schedule.
        check_range("training.lr", self.lr, 0.0, 1.0)
        check_range("training.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range("training.weight_decay", self.weight_decay, 0.0)
        # Adam divides by 1 - beta**step: a beta of 1 divides by zero.
        check_range("training.beta1", self.beta1, 0.0, 1.0, high_open=True)
        check_range("training.beta2", self.beta2, 0.0, 1.0, high_open=True)
        check_range("training.grad_clip", self.grad_clip, 0.0)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    profile: str = "cpu"
    """Name of the hwprofile the plan was made for (fastml/hwprofiles)."""
    fingerprint: str = ""
    """Hash of that profile's contents, to notice a plan made for other hardware."""
    device: Literal["cpu", "cuda"] = "cpu"
    num_gpus: int = 1
    """World size: GPUs (or CPU processes) that train together."""
    gpus_per_node: int = 1
    gpu_memory_bytes: int = 0
    """GPU memory the plan may use (a user's --gpu-mem cap); 0 for the profile's."""
    host_memory_bytes: int = 0
    """Host memory the plan may use per node (--host-mem); 0 for the profile's."""

    def __post_init__(self) -> None:
        check_range("hardware.num_gpus", self.num_gpus, 1, MAX_NUM_GPUS)
        check_range("hardware.gpus_per_node", self.gpus_per_node, 1, self.num_gpus)
        if self.num_gpus % self.gpus_per_node:
            fail("hardware.gpus_per_node", f"{self.gpus_per_node} must divide num_gpus={self.num_gpus}")
        check_range("hardware.gpu_memory_bytes", self.gpu_memory_bytes, 0, MAX_MEMORY_BYTES)
        check_range("hardware.host_memory_bytes", self.host_memory_bytes, 0, MAX_MEMORY_BYTES)


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The searched choices. Fractions are of the layers (0 = none, 1 = all)."""

    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    recompute: tuple[str, ...] = ()
    """Parts recomputed in the backward pass instead of stored: any of norm, ffn, qkv, attention, block.
    SwiGLU is not a part: its fused op keeps only its input, so an eager block frees nothing by recomputing it (a
    compiled block would free the product the down projection keeps; not offered yet)."""
    offload_optimizer: float = 0.0
    offload_master: float = 0.0
    offload_gradients: float = 0.0
    offload_residuals: float = 0.0
    offload_weights: float = 0.0
    stream_masters: bool = False
    """Where a streamed block (offload_weights) steps on the CPU with its fp32 masters and gradients in host memory
    (offload_optimizer, offload_master, offload_gradients), its host copy is the fp32 master itself, not a bf16 copy
    beside it: the GPU fetches the fp32 weights and rounds them to bf16 as they arrive, to nearest as the CPU step
    would have. 2 bytes a parameter less host memory for twice the bytes over PCIe; the same arithmetic
    (`master_streamed_groups`). Elsewhere it does nothing."""
    shard_optimizer: bool = False
    shard_gradients: bool = False
    shard_weights: bool = False
    cache_weights_on_host: bool = False
    share_host_weights: bool = False
    """Streamed blocks (offload_weights) whose sharded optimizer steps on the CPU (shard_optimizer, offload_optimizer
    at least offload_weights): their weights live in host memory once a node, shared by its ranks' processes, instead
    of once a rank. Each rank's CPU step writes its shard of them in place, and a barrier between the node's ranks
    replaces the all-gather of the updated shards (executor/memory/shared.py). One node only; without streamed blocks
    it does nothing."""
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    """The dtype of the weights in the model (and of their gradients)."""
    matmul_dtype: Literal["fp32", "bf16", "fp8"] = "bf16"
    """The dtype the linear layers compute in: fp32 only with fp32 parameters (CPU training), fp8 with bf16 ones."""
    cache_fp8_weights: bool = False
    """fp8 matmuls only: the blocks' weights are cast to fp8 (and transposed) once per optimizer step and kept on the
    GPU, 2 bytes a weight, instead of cast again in every micro-batch's forward and backward pass. Blocks whose
    weights are streamed from the host or sharded are cast as they come (`fp8_cached_blocks`)."""
    fp8_backward_fast_accum: bool = False
    """fp8 matmuls only: the backward pass's GEMMs (the input's and the weight's gradients) accumulate in the tensor
    cores' fast mode too, as the forward pass's always do, instead of adding their partial sums into fp32 as they
    go: faster GEMMs (benchmarks/NOTES.md, issue 25 part 14), with less precise sums over long reductions (a weight
    gradient's sum runs over a micro-batch's tokens). Taken only when pinned until its loss is measured
    (docs/precision.md)."""
    optimizer_dtype: Literal["fp32", "bf16"] = "fp32"
    """Adam's m and v."""
    master_dtype: Literal["fp32", "bf16", "bf16_kahan"] = "fp32"
    """The weights the optimizer updates: fp32 copies of bf16 parameters, or the parameters themselves ("bf16",
    with stochastic rounding), or the parameters with a bf16 compensation beside Adam's m and v ("bf16_kahan": what
    rounding to the parameter dropped, so that the master is their sum, rounded to nearest; 2 bytes a parameter more
    than "bf16", 2 fewer than fp32 copies). The planner searches "fp32" and "bf16_kahan"; "bf16" trained a few
    percent worse (docs/precision.md) and is taken only when pinned. With fp32 parameters the parameters are the
    masters."""
    comm: Literal["nccl", "memcpy"] = "nccl"
    overlap_cpu_step: bool = False
    """With offload_optimizer: the CPU steps its groups on a worker thread once the gradients are clipped, in the
    order the next forward pass needs them (embedding, blocks, head), and that forward pass waits for each group's
    step only where it first uses the group's weights, not for the whole step. The same arithmetic in the same order:
    only when the waiting happens changes. Without offload_optimizer it does nothing. With sharded optimizer states
    only the blocks whose host weights the ranks share overlap, each rank's step of a block followed by a barrier
    between the node's ranks; the other groups step first, and their updated shards are gathered at once
    (`overlapped_groups`)."""
    lm_head_chunks: int = 1
    """The LM head and loss run over this many slices of the tokens, so the full logits never exist at once."""
    compile: bool = False
    tensor_parallel: int = 1
    """GPUs of a node that split each block's matmuls and attention heads, and the embedding and LM head by vocabulary
    (Megatron-LM's column- and row-parallel linears: two all-reduces a block each way). The GPUs left after tensor
    and pipeline parallelism are data parallel: ZeRO and the collectives' knobs act on them (fastml/layout.py).
    `fastml run` runs it (executor/parallel/tensor.py)."""
    sequence_parallel: bool = False
    """With tensor_parallel: the norms and residual adds work on a slice of the sequence each, so the activations
    outside the matmuls are split too (Korthikanti et al. 2022); the all-reduces become all-gathers and
    reduce-scatters of the same bytes."""
    pipeline_parallel: int = 1
    """Pipeline stages: consecutive blocks on other GPUs, micro-batches passed between them
    (`fastml.layout.stage_layers`). `fastml run` runs it (executor/parallel/pipeline.py)."""
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    """The order each stage runs its micro-batches' passes in (`fastml.layout.pipeline_order`)."""
    virtual_stages: int = 1
    """interleaved_1f1b and zero_bubble: chunks of blocks each pipeline rank holds (the bubble shrinks by as much,
    the sends between stages grow by as much)."""

    @property
    def uses_fastml_adamw(self) -> bool:
        """Whether the optimizer keeps bf16 masters or moments, which fastml's AdamW op steps (torch's AdamW keeps
        neither well: the op writes them with stochastic rounding, or bf16 masters with their compensation; bf16
        masters go with bf16 parameters only: see below)."""
        return self.optimizer_dtype == "bf16" or self.master_dtype != "fp32"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_knob(f.name, getattr(self, f.name))
        if (self.param_dtype == "fp32") != (self.matmul_dtype == "fp32"):
            fail("knobs.matmul_dtype", f"{self.matmul_dtype!r} with param_dtype {self.param_dtype!r}: fp32 matmuls "
                                       "go with fp32 parameters and only with them")
        if self.cache_fp8_weights and self.matmul_dtype != "fp8":
            fail("knobs.cache_fp8_weights", f"caches fp8 copies of the weights: it needs knobs.matmul_dtype 'fp8', not "
                                            f"{self.matmul_dtype!r}")
        if self.fp8_backward_fast_accum and self.matmul_dtype != "fp8":
            fail("knobs.fp8_backward_fast_accum", f"sets how fp8 GEMMs accumulate: it needs knobs.matmul_dtype 'fp8', "
                                                  f"not {self.matmul_dtype!r}")
        if self.param_dtype == "fp32" and self.master_dtype != "fp32":
            fail("knobs.master_dtype", "fp32 parameters are their own fp32 masters; master_dtype must be 'fp32'")
        if self.overlap_cpu_step and self.shard_optimizer and not self.share_host_weights:
            fail("knobs.overlap_cpu_step", "needs unsharded optimizer states (knobs.shard_optimizer false), or weights "
                                           "the ranks share in host memory (knobs.share_host_weights): the ranks "
                                           "gather their updated shards group by group as the step ends")
        if self.share_host_weights and not (self.shard_optimizer and not self.shard_weights and
                                            self.offload_weights <= self.offload_optimizer):
            fail("knobs.share_host_weights", "shares the host copy of streamed weights that a sharded optimizer steps "
                                             "on the CPU: it needs knobs.offload_optimizer at least as high as "
                                             "knobs.offload_weights, and knobs.shard_optimizer without "
                                             "knobs.shard_weights")
        self._check_layout()
        # ZeRO's stages build on each other (Rajbhandari et al. 2020, section 5): a GPU that keeps only a shard of
        # the gradients can step only that shard of the optimizer states, and one that keeps a shard of the weights
        # only reduces its shard of their gradients.
        for name, needs in (("shard_gradients", "shard_optimizer"), ("shard_weights", "shard_gradients")):
            if getattr(self, name) and not getattr(self, needs):
                fail(f"knobs.{name}", f"needs knobs.{needs} too (ZeRO stage {ZERO_STAGES.index(name) + 1} includes "
                                      f"stage {ZERO_STAGES.index(needs) + 1}): set both")

    def _check_layout(self) -> None:
        """How the layout knobs go together, and with the others: what cannot compose, or does not yet (the
        contract's refusals name which)."""
        if self.sequence_parallel and self.tensor_parallel == 1:
            fail("knobs.sequence_parallel", "splits the sequence among tensor-parallel GPUs: it needs "
                                            "knobs.tensor_parallel above 1")
        interleaved = self.pipeline_schedule == "interleaved_1f1b"
        if interleaved and (self.pipeline_parallel == 1 or self.virtual_stages == 1):
            fail("knobs.pipeline_schedule", "interleaved_1f1b needs knobs.pipeline_parallel and knobs.virtual_stages "
                                            "above 1")
        if self.virtual_stages > 1 and self.pipeline_schedule not in ("interleaved_1f1b", "zero_bubble"):
            fail("knobs.virtual_stages", f"chunks per pipeline rank are interleaved 1F1B's and zero bubble's: "
                                         f"knobs.pipeline_schedule {self.pipeline_schedule!r} runs one")
        if self.pipeline_schedule == "zero_bubble":
            self._check_zero_bubble()
        if self.tensor_parallel * self.pipeline_parallel == 1:
            return
        if self.comm == "memcpy":
            fail("knobs.comm", "the memcpy collectives serve one data-parallel group of a node's GPUs; with tensor or "
                               "pipeline parallelism use 'nccl'")
        if self.share_host_weights:
            fail("knobs.share_host_weights", "shares the host weights of data-parallel ranks that hold the same "
                                             "blocks; not with tensor or pipeline parallelism")
        if self.pipeline_parallel > 1:
            for name in OFFLOAD_FRACTIONS:
                if 0 < getattr(self, name) < 1:
                    fail(f"knobs.{name}", f"{getattr(self, name)}: a fraction counts the model's blocks from the "
                                          f"first, and a pipeline rank holds some of them (not yet the fraction of "
                                          f"its own); with pipeline_parallel {self.pipeline_parallel} it takes 0 or 1")

    def _check_zero_bubble(self) -> None:
        """A zero-bubble schedule makes a block's weights' gradients a pass after its backward pass (each linear
        keeping its input and its output's gradient for it: executor/model/deferred.py)."""
        if self.pipeline_parallel == 1:
            fail("knobs.pipeline_schedule", "zero_bubble orders a pipeline's passes: it needs knobs.pipeline_parallel "
                                            "above 1")
        if self.matmul_dtype == "fp8":
            fail("knobs.matmul_dtype", "fp8 linears make their weights' gradients in their own backward pass, which "
                                       "zero_bubble would split: use 'bf16', or pipeline_schedule '1f1b' or "
                                       "'interleaved_1f1b'")
        why = {"compile": "torch.compile traces a block's backward pass whole, with its weights' gradients (torch's "
                          "own zero-bubble schedules refuse it too)",
               "offload_weights": "a streamed block's weights go back to the host once its gradients are made, and "
                                  "its backward pass fetches the next block's meanwhile",
               "offload_gradients": "a block's gradient sums come back from the host for its backward pass and go "
                                    "again once its gradients are made",
               "shard_weights": "a block's gathered weights go back to their shards once its gradients are made: "
                                "they would stay whole from its backward pass to its weights' pass"}
        for name, needed in ZERO_BUBBLE_NEEDS.items():
            if getattr(self, name) != needed:
                fail(f"knobs.{name}", f"{why[name]}; zero_bubble makes the weights' gradients a pass later: use "
                                      f"pipeline_schedule '1f1b' or 'interleaved_1f1b', or {name} "
                                      f"{'false' if isinstance(needed, bool) else '0'}")


ZERO_BUBBLE_NEEDS = {"compile": False, "offload_weights": 0.0, "offload_gradients": 0.0, "shard_weights": False}
"""The knobs a zero-bubble pipeline schedule needs at these values (`Knobs._check_zero_bubble` says why): the
contract checks them, a pin of the schedule sets them (planner/pins.py), and so does the search (planner/search.py)."""


def check_knob(name: str, value) -> None:
    """One knob's own bounds (how knobs go together is Knobs' to check)."""
    bounds = {"micro_batch_size": MAX_MICRO_BATCH_SIZE, "grad_accum_steps": MAX_GLOBAL_BATCH_TOKENS,
              "lm_head_chunks": MAX_LM_HEAD_CHUNKS, "tensor_parallel": MAX_NUM_GPUS, "pipeline_parallel": MAX_NUM_GPUS,
              "virtual_stages": MAX_SIZES["num_layers"]}
    if name in bounds:
        check_range(f"knobs.{name}", value, 1, bounds[name])
    elif name in OFFLOAD_FRACTIONS:
        check_range(f"knobs.{name}", value, 0.0, 1.0)
    elif name == "recompute":
        for i, part in enumerate(value):
            if part not in RECOMPUTE_CHOICES:
                fail(f"knobs.recompute[{i}]", f"{part!r} is not allowed; choose from {', '.join(RECOMPUTE_CHOICES)}")
        if len(set(value)) != len(value):
            fail("knobs.recompute", "lists a part twice")


@dataclass(frozen=True)
class KnobInfo:
    """What the planner and executor need to know of one knob."""

    kind: Literal["batch", "recompute", "speed", "offload", "shard", "precision", "comm", "layout"]
    choices: tuple = ()
    """The values the planner searches; () where it derives them from the problem (micro-batch, accumulation)."""
    lower_precision: bool = False
    """Searched only where lower precision is allowed (--lower-precision, or nothing fits without it)."""
    multi_gpu: bool = False
    """Searched only for several GPUs."""
    least_memory: Any = None
    """The choice that needs the least memory (the planner starts there where nothing else fits): GPU memory, but
    for stream_masters, which frees far more host memory than the GPU staging it adds; None for the batch knobs,
    whose choices the planner derives."""


FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
OFFLOAD_FRACTIONS = ("offload_optimizer", "offload_master", "offload_gradients", "offload_residuals", "offload_weights")
"""The offload knobs that are fractions of the layers (`offloaded_groups`); stream_masters, the other offload knob,
says what the host keeps of the blocks they offload."""
ZERO_STAGES = ("shard_optimizer", "shard_gradients", "shard_weights")
"""ZeRO stages 1, 2 and 3: each shards one more model state across the GPUs, and needs the ones before it."""
# The one registry of knobs: the search space, the executor's support check, tests and benchmarks read it.
# Recompute sets worth searching: "norm" and "qkv" alone free (almost) nothing in this model (planner/memory.py).
KNOBS: dict[str, KnobInfo] = {
    "micro_batch_size": KnobInfo("batch"),
    "grad_accum_steps": KnobInfo("batch"),
    "recompute": KnobInfo("recompute", ((), ("attention",), ("ffn",), ("ffn", "attention"), ("block",)),
                          least_memory=("block",)),
    "lm_head_chunks": KnobInfo("speed", (1, 2, 4, 8, 16), least_memory=16),
    "compile": KnobInfo("speed", (False, True), least_memory=True),
    **{name: KnobInfo("offload", FRACTIONS, least_memory=1.0) for name in OFFLOAD_FRACTIONS},
    # 2 bytes a parameter of host memory less for one block's fp32 staging more on the GPU
    "stream_masters": KnobInfo("offload", (False, True), least_memory=True),
    **{name: KnobInfo("shard", (False, True), multi_gpu=True, least_memory=True) for name in ZERO_STAGES},
    "cache_weights_on_host": KnobInfo("shard", (False, True), multi_gpu=True, least_memory=False),
    # one host copy of the streamed weights a node: less host memory, no gather after the step
    "share_host_weights": KnobInfo("shard", (False, True), multi_gpu=True, least_memory=True),
    "param_dtype": KnobInfo("precision", ("bf16",), least_memory="bf16"),
    # fp8 matmuls save time, not memory: their casts and scales come on top of the bf16 weights (planner/memory.py)
    "matmul_dtype": KnobInfo("precision", ("bf16", "fp8"), lower_precision=True, least_memory="bf16"),
    "cache_fp8_weights": KnobInfo("speed", (False, True), lower_precision=True, least_memory=False),
    # pinned only until its loss is measured beside fp8's (docs/precision.md)
    "fp8_backward_fast_accum": KnobInfo("precision", (False,), lower_precision=True, least_memory=False),
    "overlap_cpu_step": KnobInfo("speed", (False, True), least_memory=False),
    "optimizer_dtype": KnobInfo("precision", ("fp32", "bf16"), lower_precision=True, least_memory="bf16"),
    # bf16 masters with a compensation, not with stochastic rounding ("bf16", pinned only): over three seeds of 500
    # steps the rounded ones trained up to 4% above fp32 masters, the compensated within 0.5% (docs/precision.md)
    "master_dtype": KnobInfo("precision", ("fp32", "bf16_kahan"), lower_precision=True, least_memory="bf16_kahan"),
    # The memcpy collectives add a GPU staging row to their buffers in host memory (planner/memory.py).
    "comm": KnobInfo("comm", ("nccl", "memcpy"), multi_gpu=True, least_memory="nccl"),
    # Tensor and pipeline parallelism: priced when pinned, searched for other hardware only (`fastml plan --hw`): the
    # executor runs them, but not yet on GPUs (issue 27).
    "tensor_parallel": KnobInfo("layout", (1,), multi_gpu=True, least_memory=1),
    "sequence_parallel": KnobInfo("layout", (False,), multi_gpu=True, least_memory=False),
    "pipeline_parallel": KnobInfo("layout", (1,), multi_gpu=True, least_memory=1),
    "pipeline_schedule": KnobInfo("layout", ("1f1b",), multi_gpu=True, least_memory="1f1b"),
    "virtual_stages": KnobInfo("layout", (1,), multi_gpu=True, least_memory=1),
}


def describe_knobs(knobs: Knobs, against: Knobs | None = None) -> str:
    """The knobs in a line: the micro-batch and accumulation, then every knob that differs from its default; or,
    given another plan's knobs `against`, only what differs from those."""
    same_batch = against is not None and against.micro_batch_size == knobs.micro_batch_size
    parts = [] if same_batch else [f"mb {knobs.micro_batch_size} x {knobs.grad_accum_steps}"]
    for f in dataclasses.fields(Knobs):
        value, base = getattr(knobs, f.name), f.default if against is None else getattr(against, f.name)
        if KNOBS[f.name].kind != "batch" and value != base:
            parts.append(f"{f.name}={(','.join(value) or 'none') if isinstance(value, tuple) else value}")
    return "  ".join(parts) or "the same knobs"


# The executor's CPU optimizer step moves a GPU-resident gradient, master or weight to and from host memory in
# slices of this many elements, through STAGING_SLOTS pinned buffers per dtype (executor/memory/optim.py), so that its host
# staging stays small (planner/memory.py).
CPU_STEP_CHUNK = 2**26
STAGING_SLOTS = 2

# The sharding engine (executor/parallel/shard.py) keeps at most this many gradient reductions in flight, each holding
# one parameter group's gradients as one flat vector (planner/memory.py counts them as comm buffers).
REDUCTIONS_IN_FLIGHT = 2

# The memcpy collectives (executor/parallel/hostcomm.py) move data through MEMCPY_SLOTS slots of pinned host memory shared by
# the ranks of a node, a row of MEMCPY_ROW_BYTES per rank in each (planner/memory.py counts them).
MEMCPY_SLOTS = 2
MEMCPY_ROW_BYTES = 2**25

def block_group(index: int) -> str:
    """The parameter group of block `index`, whose parameters are named `blocks.{index}.…` (the executor's model)."""
    return f"blocks.{index}"


def layer_of(name: str) -> str:
    """The parameter group of the parameter called `name`: "embed", a block's (`block_group`), or "head" for
    everything else (the final norm and an untied LM head). Offload, sharding and the optimizer place and step groups."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else "embed" if parts[0] == "embed" else "head"


# Which parameter groups ("embed", `block_group`, "head": `layer_of`) each offload knob moves
# to host memory. The fraction counts blocks from the first; the embedding and the LM head (with the final norm)
# follow the optimizer and master knobs at 1.0. Their weights and gradients stay on the GPU: streaming the
# embedding table for a lookup would move far more than it saves.
WHOLE_MODEL_OFFLOAD = ("offload_optimizer", "offload_master")


def offloaded_groups(knobs: Knobs, name: str, num_layers: int) -> frozenset[str]:
    """The parameter groups that offload knob `name` places in host memory (for offload_residuals: the blocks whose
    input activations go to the host; for offload_gradients with sharded gradients, the blocks whose reduced shard of
    the gradients sums the micro-batches in host memory)."""
    return _first_groups(getattr(knobs, name), name in WHOLE_MODEL_OFFLOAD, num_layers)


@functools.lru_cache(maxsize=1024)  # the planner asks for the same few sets for every plan it weighs
def _first_groups(fraction: float, whole_model: bool, num_layers: int) -> frozenset[str]:
    groups = {block_group(i) for i in range(round(fraction * num_layers))}
    if fraction == 1.0 and whole_model:
        groups |= {"embed", "head"}
    return frozenset(groups)


STREAM_MASTERS_NEEDS = ("offload_weights", "offload_optimizer", "offload_master", "offload_gradients")
"""knobs.stream_masters acts on the blocks that all four of these offload knobs offload."""


def master_streamed_groups(knobs: Knobs, num_layers: int) -> frozenset[str]:
    """The blocks whose host copy of the weights is their fp32 master (knobs.stream_masters): streamed blocks that
    step on the CPU with fp32 masters of bf16 parameters and gradients in host memory, on unsharded optimizer
    states."""
    if not knobs.stream_masters or knobs.shard_optimizer or knobs.param_dtype == "fp32" or knobs.master_dtype != "fp32":
        return frozenset()
    return frozenset.intersection(*(offloaded_groups(knobs, name, num_layers) for name in STREAM_MASTERS_NEEDS))


def shared_weight_groups(knobs: Knobs, num_layers: int) -> frozenset[str]:
    """The blocks whose host copy of the weights the node's ranks share (knobs.share_host_weights): the streamed
    ones."""
    return offloaded_groups(knobs, "offload_weights", num_layers) if knobs.share_host_weights else frozenset()


def overlapped_groups(knobs: Knobs, num_layers: int) -> frozenset[str]:
    """The groups whose CPU step runs into the next step (knobs.overlap_cpu_step): every group the CPU steps, or with
    sharded optimizer states the streamed blocks whose host copy the node's ranks share (the others' updated shards
    are gathered as the step ends)."""
    if not knobs.overlap_cpu_step:
        return frozenset()
    cpu_steps = offloaded_groups(knobs, "offload_optimizer", num_layers)
    if not knobs.shard_optimizer:
        return cpu_steps
    return cpu_steps & shared_weight_groups(knobs, num_layers)


def weights_sharded(knobs: Knobs, group: str) -> bool:
    """Whether ZeRO-3 shards the weights of parameter group `group`: every group's, gathered just before it computes
    (a block one block ahead, the head during the last block, the embedding at the start of each forward pass)."""
    return knobs.shard_weights


def fp8_cached_blocks(knobs: Knobs, num_layers: int, num_gpus: int) -> frozenset[str]:
    """The blocks whose fp8 weights are cast once per step and kept (knobs.cache_fp8_weights): those whose weights
    stay on the GPU (a rank's slices of them under tensor parallelism), neither streamed from the host nor sharded
    over several GPUs by ZeRO-3."""
    if not knobs.cache_fp8_weights or (knobs.shard_weights and num_gpus > 1):
        return frozenset()
    streamed = offloaded_groups(knobs, "offload_weights", num_layers)
    return frozenset(block_group(i) for i in range(num_layers)) - streamed


def tensor_slice(spec: ModelSpec, tensor_parallel: int) -> ModelSpec:
    """The model as one of `tensor_parallel` GPUs computes it: its share of the attention heads, of the FFN's width and
    of the vocabulary (the embedding's and LM head's rows); the hidden size whole."""
    if tensor_parallel == 1:
        return spec
    t = tensor_parallel
    return dataclasses.replace(spec, num_heads=spec.num_heads // t, num_kv_heads=spec.num_kv_heads // t,
                               ffn_hidden_size=spec.ffn_hidden_size // t, vocab_size=spec.vocab_size // t)


FP8_GEMM_MULTIPLE = 16
"""cuBLASLt's fp8 GEMMs need every dimension a multiple of 16, the tokens of a micro-batch too (the weight gradient
sums over them)."""


def fp8_shape_problem(spec: ModelSpec, tokens: int) -> str:
    """Why fp8 GEMMs cannot take this model's linear layers at `tokens` per micro-batch, or "" where they can."""
    dims = {f"{name}.{side}": d for name, shape in spec.block_linear_shapes().items()
            for side, d in zip(("out", "in"), shape)} | {"tokens per micro-batch": tokens}
    odd = [f"{name} {d}" for name, d in dims.items() if d % FP8_GEMM_MULTIPLE]
    return (f"'fp8' GEMMs need every matmul dimension a multiple of {FP8_GEMM_MULTIPLE}, and {', '.join(odd)} "
            f"{'is' if len(odd) == 1 else 'are'} not: use 'bf16'") if odd else ""


def knob_names(kind: str) -> tuple[str, ...]:
    return tuple(name for name, info in KNOBS.items() if info.kind == kind)


def pinned(**values) -> list[str]:
    """`--set` assignments that pin every searched knob but the precision ones (the planner's choice for the device)
    to `values` where given, else to the knob's default (the ZeRO stages below one given on, on): a plan made with
    them is the one named (tests, benchmarks)."""
    unknown = set(values) - set(KNOBS)
    if unknown:
        raise ValueError(f"not knobs: {', '.join(sorted(unknown))}")
    defaults = {f.name: f.default for f in dataclasses.fields(Knobs)}
    highest = max((ZERO_STAGES.index(n) for n in ZERO_STAGES if values.get(n)), default=-1)
    defaults |= dict.fromkeys(ZERO_STAGES[:highest + 1], True)  # a ZeRO stage pinned on, with the stages below it
    return [f"knobs.{name}={json.dumps(to_dict(values.get(name, defaults[name])))}" for name, info in KNOBS.items()
            if name in values or info.kind not in ("batch", "precision")] + (
        [] if "micro_batch_size" in values else ["knobs.micro_batch_size=1"])


@dataclass(frozen=True, kw_only=True)
class Predicted:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: int
    memory_bytes: dict[str, int]
    """GPU memory of one GPU by category (MEMORY_CATEGORIES), as the run's meter measures them: the model states
    with every gradient made, the activations a forward pass leaves, workspace the rest of peak_memory_bytes (0 where
    the others add up to more: not all alive at once). planner/memory.py `Memory.gpu`."""
    host_memory_bytes: dict[str, int]
    """Host memory of one node, by category."""
    time_s: dict[str, float]
    """The step time split by component (TIME_COMPONENTS); the parts add up to step_time_s."""
    usd_per_million_tokens: float
    kwh_per_million_tokens: float
    eval_time_s: float = 0.0
    """One evaluation of the validation loss (training.eval_tokens in the plan's micro-batches, forward passes only).
    Its memory is within the step's peak: it keeps no activations, and its loss's tensors are fewer than the
    backward pass's."""

    def __post_init__(self) -> None:
        check_range("predicted.step_time_s", self.step_time_s, 0.0, low_open=True)
        check_range("predicted.eval_time_s", self.eval_time_s, 0.0)
        for name in ("tokens_per_s", "mfu", "usd_per_million_tokens", "kwh_per_million_tokens"):
            check_range(f"predicted.{name}", getattr(self, name), 0.0)
        check_range("predicted.peak_memory_bytes", self.peak_memory_bytes, 0, MAX_MEMORY_BYTES)
        for name, keys, high in (("memory_bytes", MEMORY_CATEGORIES, MAX_MEMORY_BYTES),
                                 ("host_memory_bytes", MEMORY_CATEGORIES, MAX_MEMORY_BYTES),
                                 ("time_s", TIME_COMPONENTS, None)):
            values = getattr(self, name)
            if set(values) != set(keys):  # the reports index one by the other's keys
                fail(f"predicted.{name}", f"must have exactly the keys {', '.join(keys)}")
            for key, value in values.items():
                check_range(f"predicted.{name}.{key}", value, 0, high)


@dataclass(frozen=True, kw_only=True)
class Plan:
    version: int = PLAN_VERSION
    model: ModelSpec
    training: Training = field(default_factory=Training)
    hardware: Hardware = field(default_factory=Hardware)
    knobs: Knobs = field(default_factory=Knobs)
    predicted: Predicted | None = None

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            fail("version", f"plan version {self.version} is not supported by this fastml (it reads {PLAN_VERSION})")
        k, t, h, spec = self.knobs, self.training, self.hardware, self.model
        knob, why = layout_problem(k.tensor_parallel, k.sequence_parallel, k.pipeline_parallel, k.virtual_stages,
                                   k.grad_accum_steps, spec.num_heads, spec.num_kv_heads, spec.ffn_hidden_size,
                                   spec.vocab_size, spec.num_layers, t.seq_len, h.num_gpus, h.gpus_per_node)
        if knob:
            fail(f"knobs.{knob}", why)
        data = self.layout.data
        tokens = k.micro_batch_size * k.grad_accum_steps * t.seq_len * data
        if tokens != t.global_batch_tokens:
            ranks = (f"num_gpus {h.num_gpus}" if data == h.num_gpus else
                     f"{data} data-parallel ranks (num_gpus {h.num_gpus} / tensor_parallel {k.tensor_parallel} / "
                     f"pipeline_parallel {k.pipeline_parallel})")
            fail("training.global_batch_tokens",
                 f"{t.global_batch_tokens} must equal micro_batch_size {k.micro_batch_size} x grad_accum_steps "
                 f"{k.grad_accum_steps} x seq_len {t.seq_len} x {ranks} = {tokens}")
        problem = fp8_shape_problem(tensor_slice(spec, k.tensor_parallel), k.micro_batch_size * t.seq_len) \
            if k.matmul_dtype == "fp8" else ""
        if problem:
            fail("knobs.matmul_dtype", problem)

    @property
    def layout(self) -> Layout:
        return layout_of(self.knobs.tensor_parallel, self.knobs.pipeline_parallel, self.knobs.virtual_stages,
                         self.hardware.num_gpus)

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2) + "\n"


def check_init_from(plan: Plan) -> None:
    """The weights a new run of `plan` starts from are there and are its model's. Checked when a plan is made and when
    a run starts from them, not whenever a plan is read: a checkpoint's plan outlives the directories it names."""
    source = plan.training.init_from
    if source:
        check_same_model(spec_of_weights(source, "training.init_from"), plan.model, source, "training.init_from")


def describe_init(training: Training) -> str:
    """Where a run's weights come from, in words."""
    return f"from {training.init_from}" if training.init_from else f"random, from seed {training.seed}"


def plan_from_dict(data: object) -> Plan:
    """The plan a JSON document holds. Its sections must all be there: the defaults of a missing one would make a
    plan nobody asked for (missing knobs once showed as a global batch that does not add up)."""
    for section in ("training", "hardware", "knobs"):
        if isinstance(data, dict) and section not in data:
            fail(section, "missing: a plan holds model, training, hardware and knobs (`fastml plan` writes them)")
    return from_dict(Plan, data)


def load_plan(path: str | Path) -> Plan:
    """The plan in the JSON file at `path`, validated; any problem with the file is a one-line `UserError`."""
    if not Path(path).exists():
        raise UserError(f"{path}: no such plan file (make one with `fastml plan -o {path}`)")
    return plan_from_dict(read_json(path, "a plan", MAX_PLAN_FILE_BYTES))


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan.to_json())


def with_overrides(plan: Plan, assignments: list[str]) -> Plan:
    """Applies `section.field=value` assignments (values parsed as JSON, else taken as strings), re-validating."""
    data = to_dict(plan)
    for assignment in assignments:
        section, name, value = parse_assignment(assignment)
        data[section][name] = value
    return plan_from_dict(data)


def parse_assignment(assignment: str) -> tuple[str, str, object]:
    """`SECTION.FIELD=VALUE` as (section, field, value): the value parsed as JSON where it is JSON, and
    `knobs.recompute=a,b` as a list. The value is checked later, with the plan it goes into."""
    sections = [f.name for f in dataclasses.fields(Plan) if f.name not in ("version", "predicted")]
    key, sep, raw = assignment.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or parts[0] not in sections:
        fail("--set", f"{show(assignment)} must look like SECTION.FIELD=VALUE, SECTION one of {', '.join(sections)}")
    value = _override_value(parts[0], parts[1], raw)
    if parts == ["knobs", "recompute"] and isinstance(value, str):
        value = [v for v in value.split(",") if v]
    return parts[0], parts[1], value


def _override_value(section: str, name: str, raw: str) -> object:
    """`raw` parsed as JSON, else the string itself; always the string for a text field (a data directory "123")."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    section_type = typing.get_type_hints(Plan).get(section)
    section_type = next((t for t in typing.get_args(section_type) if t is not type(None)), section_type)
    hint = typing.get_type_hints(section_type).get(name) if dataclasses.is_dataclass(section_type) else None
    union = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    takes_text = hint is str or str in union  # str, or str | None; not a tuple of str
    takes_list = any(typing.get_origin(t) is tuple for t in union)  # training.data: a directory, or a blend
    if takes_list and isinstance(value, list):
        return value
    return raw if takes_text and value is not None and not isinstance(value, str) else value
