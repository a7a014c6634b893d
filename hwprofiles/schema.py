"""The hwprofile JSON schema as validated, read-only dataclasses, loaded through `fastml.config.from_dict` like a
plan: an unknown or missing key, or a value of the wrong type, is a one-line `UserError` naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fastml.config import from_dict


# The units of the measured rates, which the planner prices with and `fastml profile` measures in:

ATTENTION_BACKWARD_FACTOR = 2.5
"""Attention's backward FLOPs over its forward's: flash attention's backward does 5 matmuls of the forward's size
against the forward's 2 (FlashAttention-2, section 4.1; torch.utils.flop_counter counts its kernels the same way)."""
ELEMENTWISE_PASSES = 3
"""A block's elementwise work over a micro-batch (ModelSpec.elementwise_elements_per_token,
gpu.elementwise_bytes_per_s): the forward pass's once, the backward pass's twice (planner/costs.py)."""
FP8_AMAX_BYTES = 2
"""The bf16 read of an fp8 cast's absolute-maximum pass, which a cast skips where the kernel that made its input took
the maximum (SwiGLU's, executor/model/fp8.py FP8FeedForwardFunction)."""
FP8_CAST_BYTES = FP8_AMAX_BYTES + 2 + 1
"""Bytes moved per element by an fp8 cast (executor/model/fp8.py, csrc/fp8_cuda.cu): the bf16 read for its absolute
maximum, the bf16 read of the cast, one fp8 byte written (and one more for the transposed copy)."""


@dataclass(frozen=True, kw_only=True)
class Pcie:
    generation: int | None = None
    lanes: int | None = None
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float


@dataclass(frozen=True, kw_only=True)
class DeviceSection:
    """One accelerator (for a CPU profile: the CPU, which trains in its own memory)."""

    memory_bytes: int
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by matmul dtype (a CPU profile: the best fp32 matmul rate measured)."""
    gemm_efficiency: tuple[tuple[float, float], ...]
    """(g, achieved / peak) with g the geometric mean of a GEMM's M, N and K (a CPU profile: of attention, whose
    GEMMs are in gemm_shapes)."""
    gemm_shapes: tuple[tuple[float, float, float, float], ...] = ()
    """(M, N, K, achieved / peak) of GEMMs measured at exactly these shapes, used before the curve (a CPU profile:
    each linear layer of the models planned, forward and backward, M the tokens of a micro-batch)."""
    backward_gemm_shapes: tuple[tuple[float, float, float, float], ...] = ()
    """(M, N, K, achieved / peak) of the two backward GEMMs of the linear layer whose forward GEMM is (M, N, K)
    (the input's and the weight's gradients); where none is measured, the forward's efficiency."""
    fp8_gemm_shapes: tuple[tuple[float, float, float, float], ...] = ()
    """(M, N, K, achieved / fp8 peak) of fp8 GEMMs (torch._scaled_mm) at these shapes; where none is measured, fp8
    GEMMs take the bf16 efficiency at the fp8 peak."""
    fp8_backward_gemm_shapes: tuple[tuple[float, float, float, float], ...] = ()
    """(M, N, K, achieved / fp8 peak) of the two backward GEMMs of the fp8 linear whose forward GEMM is (M, N, K):
    e5m2 gradients, without fast accumulation; where none is measured, the forward's."""
    attention_shapes: tuple[tuple[float, float, float], ...] = ()
    """(head_dim, seq_len, achieved / bf16 peak) of causal attention's forward and backward pass as the executor runs
    it (SDPA over grouped-query heads), FLOPs as planner/costs.py counts them; measured by `fastml profile` on a GPU.
    Where none is measured, attention takes the efficiency of gemm_efficiency's curve at its size. Measured with
    enough sequences to fill the GPU (hwprofiles/measure.py: ATTENTION_TOKENS, ATTENTION_HEADS)."""
    attention_half_rate_tiles: float | None = None
    """The query tiles in flight (sequences x heads x seq_len / ATTENTION_QUERY_TILE) at which causal attention runs
    at half the rate it reaches with many, x0 of rate(x) = full x x / (x + x0): a micro-batch of few sequences and
    heads leaves SMs idle while the causal mask's longest tiles finish. Measured by `fastml profile` from one
    sequence's rate against attention_shapes'; None: every micro-batch at attention_shapes' rate."""
    sustained_compute_share: float | None = None
    """The share of the rates measured on short runs (gemm_efficiency, the GEMM tables, attention_shapes) that a
    GPU keeps on compute-bound work run for seconds, as training runs it: one at its power limit lowers its clock.
    Measured by `fastml profile` (GEMMs back to back for seconds against a short run of them); None: 1."""
    hbm_bytes_per_s: float
    """Device memory bandwidth (a CPU profile: a large tensor copy's rate in host memory)."""
    fp8_cast_bytes_per_s: float | None = None
    """fastml's fp8 cast (csrc/fp8_cuda.cu), bytes as FP8_CAST_BYTES counts them (an element, one
    more for the transposed copy) per second; None: at hbm_bytes_per_s."""
    elementwise_bytes_per_s: float | None = None
    """The blocks' work outside their matmuls and attention (norms, rotary embedding, SwiGLU, residual adds), bytes as
    planner/costs.py counts them, per second; None: at hbm_bytes_per_s. A CPU profile measures it, eager
    (hwprofiles/profile.py): a CPU runs these ops far below its copy's rate (silu's exponential, SwiGLU's reference
    ops). One rate for every shape: the CPU profile's is its model's, over the micro-batches it measured; a plan pinned
    to compile on a CPU is priced at it too."""
    pcie: Pcie | None = None
    """None where the device is the host (a CPU): nothing crosses a bus."""
    p2p: bool = False
    nvlink_bytes_per_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class NodeSection:
    gpus_per_node: int
    host_memory_bytes: int
    h2d_all_gpus_bytes_per_s: float
    """All GPUs of the node copying from host at once: the shared PCIe root complex's limit."""
    cpu_adam_params_per_s: float
    host_copy_bytes_per_s: float
    nic_bytes_per_s: float


@dataclass(frozen=True, kw_only=True)
class Collectives:
    latency_s: float
    bus_bytes_per_s: dict[str, float]
    """NCCL's bus bandwidth at large sizes, by collective, over the GPUs' own links (NVLink, or PCIe peer to peer)."""
    host_routed_bus_bytes_per_s: float | None = None
    """NCCL's bus bandwidth where the GPUs cannot reach each other and it goes through host memory (no P2P, or
    NCCL_P2P_DISABLE=1); None: as fast as the GPUs' PCIe copies."""


@dataclass(frozen=True, kw_only=True)
class Price:
    usd_per_gpu_hour: float
    source: str
    date: str = ""


@dataclass(frozen=True, kw_only=True)
class Power:
    watts_per_gpu: float
    source: str


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """How this machine's measured runs differ from the planner's model of them, fitted by `fastml calibrate` from
    run records (planner/calibrate.py); the defaults leave the model as it is."""

    forward: float = 1.0
    """Measured over modelled time of the blocks' forward passes, recomputed ones too."""
    compute: float = 1.0
    """Measured over modelled time of the GPU's other work: backward passes, the head and loss, the optimizer
    (backward kernels reach another share of the peak than forward ones)."""
    cpu_optimizer: float = 1.0
    """Measured over modelled time of the CPU's optimizer steps: the C++ AdamW in a training step, beside the copies
    that share the host's memory, against its rate measured alone."""
    transfer: float = 1.0
    """Measured over modelled time of copies between host and GPU and of collectives."""
    layer_overhead_s: float = 0.0
    """Time each pass of a block (forward, backward, recompute) and of the head adds: kernel launches, Python."""
    step_overhead_s: float = 0.0
    """Time each optimizer step adds on the CPU: the loop, the optimizer's launches, synchronisations."""
    compiled_activations: float = 1.0
    """What a torch.compile'd block keeps for its backward pass, over what the memory model counts."""
    fragmentation: float = 0.0
    """The allocator's peak beyond the memory model's, as a fraction of it."""
    records: int = 0
    """How many run records it was fitted to (0: not calibrated)."""
    model_version: int = 0
    """The version of the planner's time and memory models that it was fitted to (planner/calibrate.py
    MODEL_VERSION; 0: fitted before versions were kept). Terms fitted to another version correct errors this one
    may not make, or miss ones it makes."""


@dataclass(frozen=True, kw_only=True)
class HostOverhead:
    """The host's share of a step where the GPU waits for it: fastml's training loop on a model whose kernels take
    no time (the tiny preset, one sequence per micro-batch), its step times at two depths and two micro-batch counts
    fitted as below (hwprofiles/host.py). Python, the dispatcher and the kernel launches of a pass cost about the
    same whatever the model's width, so a pass takes the longer of this and its GPU work (planner/costs.py)."""

    block_pass_s: float
    """One block's forward and backward pass over one micro-batch."""
    head_s: float
    """The embedding, the final norm, the LM head and the loss, forward and backward, over one micro-batch."""
    optimizer_per_block_s: float
    """The optimizer step of one block's parameter group (its clipping and AdamW launches)."""
    step_s: float
    """What every step adds besides: the loop, the loss's and the gradient norm's synchronisations, the data."""


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    source: str
    """Where every number comes from: datasheets, published measurements, or this machine (and when)."""
    device: Literal["cuda", "cpu"] = "cuda"
    device_names: tuple[str, ...] = ()
    gpu: DeviceSection
    node: NodeSection
    collectives: Collectives
    price: Price | None = None
    """None where nobody rents it by the hour (a CPU): plans on it are not priced."""
    power: Power | None = None
    calibration: Calibration = Calibration()
    host_overhead: HostOverhead | None = None
    """None: the host's time is not priced (a profile of a GPU nobody measured it on, or a CPU)."""


# Keys a profile may carry for people and for the tools that wrote it, not read by the planner: the raw topology
# `fastml profile` detected, and a CPU profile's measurements.
INFORMATIONAL_KEYS = ("detected", "measured")


def parse_profile(data: object, where: str) -> HardwareProfile:
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in INFORMATIONAL_KEYS}
    return from_dict(HardwareProfile, data, where)
