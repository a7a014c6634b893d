"""What `fastml profile` measures on a GPU machine, each rate the way the planner uses it: the bf16 GEMM efficiency
curve against the GPU's dense peak (square GEMMs) and the linear layers' GEMMs at their exact shapes (forward, and
the two backward ones, in the layouts F.linear and autograd use), causal attention at each head size and sequence
length, HBM bandwidth (a copy, bytes read and written), pinned host copies up and down (one GPU alone, and every GPU
at once through the shared PCIe root), the cost of a kernel launch, the host's memory bandwidth and the C++ CPU
AdamW's throughput on its cores. GPU work is timed with CUDA events, the median of several
runs after warm-ups; `quick` takes fewer sizes and smaller copies (under 20 s on one H200, once fastml's CUDA ops are
built; several GPUs add the start of their workers).

On a GPU with fp8 tensor cores (and nvcc to build fastml's CUDA ops), also fp8 GEMMs (torch._scaled_mm) at the
presets' linear-layer shapes, forward and backward, and the rate of fastml's fp8 cast (csrc/fp8_cuda.cu); where they cannot run, the
profile keeps its base profile's fp8 figures (`fp8_error` says why).

With several GPUs, also peer-to-peer copies and the collectives between them (hwprofiles/between_gpus.py).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

from fastml.config import first_line
from fastml.hwprofiles.schema import ATTENTION_BACKWARD_FACTOR, FP8_CAST_BYTES

SQUARE_SIZES = (256, 512, 1024, 2048, 4096, 8192)
QUICK_SQUARE_SIZES = (1024, 4096, 8192)
SHAPE_MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "tinyllama-1.1b", "qwen2.5-1.5b", "llama-3.2-3b", "qwen2.5-3b",
                "llama-2-7b", "mistral-7b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-8b", "llama-2-13b", "qwen2.5-14b")
"""Presets whose linear layers are measured at their exact shapes (not in `quick`), at SHAPE_TOKENS tokens: the
efficiency of a GEMM depends on its narrowest side more than the curve of square ones says (0.5B's K of 896)."""
SHAPE_TOKENS = (2048, 8192, 32768)
"""Tokens of a micro-batch: with N and K of 2048, a GEMM's rate still grows from 8192 rows to 32768."""
COPY_BYTES, QUICK_COPY_BYTES = 2**30, 2**28
ADAM_PARAMS = 2**24
ADAM_ROUNDS = 7
"""Timed steps of the CPU AdamW, the best taken: 3 gave 1.9 G params/s once on the H200 host, against 4.0-4.9."""


def measure_gpus(peak_bf16_flops: float, quick: bool, on_step=lambda what: None, nvlink: bool = False,
                 peak_fp8_flops: float | None = None, build_ops: bool = True) -> dict:
    """Every rate, by the profile field it is written to (`profile.profile_json`); `on_step(what)` before each.
    With several GPUs also those between them (hwprofiles/between_gpus.py); `nvlink`: their peer copies go over
    NVLink, whose rate the profile then takes from the copy. fp8 where the profile has an fp8 peak
    (`peak_fp8_flops`). Without `build_ops`, what needs fastml's C++ or CUDA ops built first (about a minute on
    first use) is measured only where they are built already: the profile keeps its base's figures for the rest
    (`not_built`). How long each part took is under `seconds`."""
    import torch

    from fastml.executor import native
    from fastml.hwprofiles.host import measure_host_overhead

    copy_bytes = QUICK_COPY_BYTES if quick else COPY_BYTES
    measured, seconds = {}, {}

    @contextlib.contextmanager
    def step(what: str):
        """One part of the measurement: said before it starts, its seconds kept under `seconds`."""
        on_step(what)
        started = time.perf_counter()
        yield
        seconds[what] = round(time.perf_counter() - started, 2)

    def built(library) -> bool:
        return build_ops or native.is_built(library)

    with step("bf16 GEMMs"):
        sizes = QUICK_SQUARE_SIZES if quick else SQUARE_SIZES
        measured["gpu.gemm_efficiency"] = [[g, round(_gemm_flops(g, g, g) / peak_bf16_flops, 4)] for g in sizes]
    with step("sustained GEMMs"):
        measured["gpu.sustained_compute_share"] = _sustained_compute_share()
    if not quick:
        with step("the presets' linear layers"):
            for field, gemm_flops in (("gpu.gemm_shapes", _linear_flops),
                                      ("gpu.backward_gemm_shapes", _linear_backward_flops)):
                rates = {shape: _if_it_fits(gemm_flops, *shape) for shape in _model_shapes()}
                measured[field] = [[m, n, k, round(flops / peak_bf16_flops, 4)] for (m, n, k), flops in rates.items()
                                   if flops]
    with step("attention"):
        measured["gpu.attention_shapes"] = _attention_efficiencies(peak_bf16_flops, quick)
        measured |= _attention_half_rate(peak_bf16_flops, measured["gpu.attention_shapes"])
    not_built = []
    if peak_fp8_flops and built(native.CUDA_OPS):
        with step("the fp8 cast" if quick else "fp8 GEMMs and the fp8 cast"):
            measured |= _fp8(peak_fp8_flops, quick)
    elif peak_fp8_flops:
        not_built.append("gpu.fp8_cast_bytes_per_s")
    with step("HBM"):
        measured["gpu.hbm_bytes_per_s"] = _hbm_bytes_per_s(copy_bytes)
    with step("pinned host copies"):
        up, down = _host_copies(0, copy_bytes)
        measured["gpu.pcie.h2d_bytes_per_s"], measured["gpu.pcie.d2h_bytes_per_s"] = up, down
        measured["node.h2d_all_gpus_bytes_per_s"] = _all_gpus_up(copy_bytes) if torch.cuda.device_count() > 1 else up
    with step("kernel launches"):
        measured["launch_s"] = _launch_s()
    with step("the training loop's host time"):
        measured |= {f"host_overhead.{name}": value for name, value in measure_host_overhead().items()}
    with step("host memory"):
        measured["node.host_copy_bytes_per_s"] = _host_copy_bytes_per_s(copy_bytes // 2)
    if built(native.CPU_OPS):
        with step("C++ CPU AdamW"):
            measured["node.cpu_adam_params_per_s"] = _cpu_adam_params_per_s()
    else:
        not_built.append("node.cpu_adam_params_per_s")
    if torch.cuda.device_count() > 1:
        with step("between GPUs"):
            measured |= _between_gpus(quick, on_step, nvlink)
    if not_built:
        measured["not_built"] = not_built
    return measured | {"seconds": seconds}


def _between_gpus(quick: bool, on_step, nvlink: bool) -> dict:
    """Peer copies and collectives; where their workers fail, what failed (under `between_gpus_error`), the base
    profile's figures kept and every other measurement with them."""
    import torch

    from fastml.hwprofiles import between_gpus

    gpus = torch.cuda.device_count()
    p2p = between_gpus.peer_access(gpus)  # as NCCL will see it: NCCL_P2P_DISABLE counts
    measured = {}
    try:
        if p2p:
            on_step("peer copies")
            measured["p2p_bytes_per_s"] = between_gpus.p2p_bytes_per_s()
        on_step(f"NCCL and memcpy collectives on {gpus} GPUs")
        seconds = between_gpus.time_collectives("cuda", gpus, between_gpus.QUICK_SIZES if quick else
                                                between_gpus.SIZES)
    except Exception as e:  # noqa: BLE001 - the single-GPU measurements are worth keeping whatever failed here
        return measured | {"between_gpus_error": f"{type(e).__name__}: {first_line(e)}"}
    fields = between_gpus.profile_fields(seconds, gpus, p2p)
    if p2p and nvlink:  # NVLink's rate bounds NCCL's in the planner: never below what NCCL itself reached
        fields["gpu.nvlink_bytes_per_s"] = max(measured["p2p_bytes_per_s"],
                                               *fields["collectives.bus_bytes_per_s"].values())
    return measured | fields


def _fp8(peak_fp8_flops: float, quick: bool) -> dict:
    """fp8 GEMMs at the presets' linear-layer shapes (not in `quick`, which measures their cast alone) against the
    fp8 peak, and fastml's cast; or, where they cannot run here, why (`fp8_error`)."""
    import torch

    from fastml.config import UserError
    from fastml.executor.model import fp8
    from fastml.executor import native

    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        return {"fp8_error": f"no fp8 tensor cores (below {fp8.MIN_CAPABILITY_TEXT})"}
    try:
        native.load_cuda()
    except UserError as e:
        return {"fp8_error": first_line(e)}
    measured = {"gpu.fp8_cast_bytes_per_s": _fp8_cast_bytes_per_s()}
    if not quick:
        for field, gemm_flops in (("gpu.fp8_gemm_shapes", _fp8_gemm_flops),
                                  ("gpu.fp8_backward_gemm_shapes", _fp8_backward_gemm_flops)):
            rates = {shape: _if_it_fits(gemm_flops, *shape) for shape in _model_shapes(lm_head=False)}
            measured[field] = [[m, n, k, round(flops / peak_fp8_flops, 4)] for (m, n, k), flops in rates.items()
                               if flops]
    return measured


CAST_SHAPE = (8192, 14336)
"""A large micro-batch's widest activation (8B's FFN), beyond the L2 cache."""
CAST_LAYOUTS = ((True, False), (False, True), (True, True))
"""Row-major alone (a weight, forward), transposed alone (a weight, backward), both (an input or a gradient)."""


def _fp8_cast_bytes_per_s() -> float:
    """A bf16 matrix cast to e4m3 in each layout a step casts, bytes as FP8_CAST_BYTES counts them."""
    import torch

    from fastml.executor.model import fp8

    x = torch.randn(*CAST_SHAPE, device="cuda", dtype=torch.bfloat16)
    seconds = sum(_cuda_seconds(lambda rowwise=rowwise, transposed=transposed:
                                fp8.quantize(x, fp8.E4M3, rowwise, transposed)) for rowwise, transposed in CAST_LAYOUTS)
    num_bytes = x.numel() * sum(FP8_CAST_BYTES + (rowwise and transposed) for rowwise, transposed in CAST_LAYOUTS)
    return num_bytes / seconds


def _fp8_gemm_flops(m: int, n: int, k: int) -> float:
    """x @ w.T in e4m3 with bf16 out, as the fp8 linears' forward pass multiplies (executor/model/fp8.py)."""
    import torch

    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return 2 * m * n * k / _cuda_seconds(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16, use_fast_accum=True))


def _fp8_backward_gemm_flops(m: int, n: int, k: int) -> float:
    """The backward GEMMs of the fp8 linear whose forward GEMM is (m, n, k), as executor/model/fp8.py runs them: the input
    gradient (e5m2 gradient by the e4m3 weight's transpose) and the weight gradient (the gradient's transpose by the
    input's), bf16 out, without fast accumulation; their FLOPs over their time together."""
    import torch

    grad = torch.randn(m, n, device="cuda").to(torch.float8_e5m2)
    grad_t = torch.randn(n, m, device="cuda").to(torch.float8_e5m2)
    weight_t = torch.randn(k, n, device="cuda").to(torch.float8_e4m3fn)
    x_t = torch.randn(k, m, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def both() -> None:
        torch._scaled_mm(grad, weight_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(grad_t, x_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return 2 * 2 * m * n * k / _cuda_seconds(both)


ATTENTION_HEAD_DIMS = (64, 128)
ATTENTION_SEQ_LENS = (1024, 2048, 4096, 8192)
QUICK_ATTENTION_SEQ_LENS = (2048, 8192)
ATTENTION_TOKENS = 16384
"""Tokens of the micro-batch attention is measured at: enough sequences of the shorter lengths to fill the GPU, as
training's micro-batches do (a micro-batch of few sequences and heads that leaves SMs idle is priced too fast). Its
rate depends on the sequence length (the share of the causal mask's diagonal tiles, the backward pass's
accumulation over them) and the head size: TinyLlama's 64 reached 325 TFLOP/s on the H200, the 8B's 128 376
(benchmarks/results/attention-h200.json), where the GEMM curve reaches 790 (0.80 of the peak at 8192,
results/fidelity-profile-h200.json)."""
ATTENTION_HEADS = (32, 8)
"""Query and key/value heads measured: grouped-query attention, as the Llama 3 presets have."""
ATTENTION_QUERY_TILE = 128
"""Query rows of one thread block of a flash-attention kernel (the H200's cuDNN and flash kernels: 64-128): what
`attention_half_rate_tiles` counts the work in flight in."""
OCCUPANCY_SHAPE = (128, 2048)
"""(head_dim, seq_len) measured at one sequence as well, for attention's rate at few sequences (the 8B's shape)."""


def attention_tiles(sequences: int, heads: int, seq_len: int) -> float:
    """Query tiles of a causal attention pass in flight at once: one thread block each."""
    return sequences * heads * -(-seq_len // ATTENTION_QUERY_TILE)


def measured_attention_tiles(seq_len: int) -> float:
    """The tiles in flight where attention_shapes is measured: ATTENTION_TOKENS' sequences of seq_len, 32 heads."""
    return attention_tiles(max(1, ATTENTION_TOKENS // seq_len), ATTENTION_HEADS[0], seq_len)


def half_rate_tiles(tiles: float, rate_share: float, full_tiles: float) -> float:
    """x0 of rate(x) = full x x / (x + x0) from the share of the full rate (`full_tiles` in flight) reached with
    `tiles` in flight; 0 where the fewer tiles lose nothing."""
    if rate_share >= 1:
        return 0.0
    if rate_share * full_tiles <= tiles:  # slower than the model can be: fewer tiles than this cannot go slower
        rate_share = 1.01 * tiles / full_tiles
    return tiles * full_tiles * (1 - rate_share) / (rate_share * full_tiles - tiles)


def _attention_efficiencies(peak_bf16_flops: float, quick: bool) -> list[list[float]]:
    """(head_dim, seq_len, achieved / peak) of causal SDPA forward and backward at each measured size; a size this
    GPU cannot run (out of memory, or no kernel for these inputs) is left out, and priced by the GEMM curve."""
    import torch


    heads, kv_heads = ATTENTION_HEADS
    rows = []
    for head_dim in ATTENTION_HEAD_DIMS:
        for seq_len in QUICK_ATTENTION_SEQ_LENS if quick else ATTENTION_SEQ_LENS:
            batch = max(1, ATTENTION_TOKENS // seq_len)
            # 2·s·q_size per token forward (causal: half of q·kᵀ and p·v), the backward 2.5 times it
            flops = (1 + ATTENTION_BACKWARD_FACTOR) * 2.0 * batch * seq_len * seq_len * heads * head_dim
            try:
                seconds = _cuda_seconds(_attention_pass(batch, seq_len, heads, kv_heads, head_dim))
            except (torch.cuda.OutOfMemoryError, RuntimeError):  # SDPA's math fallback on an older GPU, say
                torch.cuda.empty_cache()
                continue
            rows.append([head_dim, seq_len, round(flops / seconds / peak_bf16_flops, 4)])
    return rows


def _attention_half_rate(peak_bf16_flops: float, full: list[list[float]]) -> dict[str, float]:
    """gpu.attention_half_rate_tiles from one sequence of OCCUPANCY_SHAPE against its rate with many (in `full`,
    attention_shapes' rows); nothing where that shape was not measured."""
    import torch

    head_dim, seq_len = OCCUPANCY_SHAPE
    many = next((e for d, s, e in full if (d, s) == OCCUPANCY_SHAPE), None)
    if not many:
        return {}
    heads, kv_heads = ATTENTION_HEADS
    try:
        seconds = _cuda_seconds(_attention_pass(1, seq_len, heads, kv_heads, head_dim))
    except (torch.cuda.OutOfMemoryError, RuntimeError):
        return {}
    one = (1 + ATTENTION_BACKWARD_FACTOR) * 2.0 * seq_len * seq_len * heads * head_dim / seconds / peak_bf16_flops
    tiles = half_rate_tiles(attention_tiles(1, heads, seq_len), one / many, measured_attention_tiles(seq_len))
    return {"gpu.attention_half_rate_tiles": round(tiles, 1)}


def _attention_pass(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int):
    """Causal SDPA forward and backward in bf16 as executor/model/transformer.py runs it: (B, T, H, D) tensors seen as
    (B, H, T, D), the output's gradient too, and grouped-query heads."""
    import torch
    import torch.nn.functional as F

    def tensor(count: int, requires_grad: bool = True) -> torch.Tensor:
        return torch.randn(batch, seq_len, count, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=requires_grad)
    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    grad = tensor(heads, requires_grad=False).transpose(1, 2)

    def run() -> None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=heads != kv_heads)
        torch.autograd.grad(out, (q, k, v), grad)
    return run


QUEUE_CYCLES = 4_000_000
"""GPU clock cycles (about 2 ms) the stream is held before each timed run, so that the host has queued the run's
kernels when the GPU reaches them: the GPU's time, as in training, where the host runs ahead, not the host's pace of
launching them (one sequence's attention measured 0.17 of the peak unqueued on the H200, 0.30 in a training step)."""


def _cuda_seconds(run, repeats: int = 10, warmups: int = 2, queued: bool = True) -> float:
    """The median GPU time of `run`'s work; `queued`: with its kernels queued before the first starts."""
    import torch

    for _ in range(warmups):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(QUEUE_CYCLES)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


SUSTAINED_S = 3.0
"""How long GEMMs run back to back for `_sustained_compute_share`: long enough for a power-limited GPU to settle at
the clock it keeps (the H200 ran training steps at 600-700 W, its limit, and about 1,650 MHz of its 1,980)."""


def _sustained_compute_share() -> float:
    """The share of its rate on a short run of GEMMs (as the tables are measured) this GPU keeps when it runs them
    for SUSTAINED_S, as a training run does: the clock a GPU at its power limit lowers to, and the tables with it."""
    import torch

    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    short = _cuda_seconds(lambda: a @ b)
    started, batch, last = time.perf_counter(), 16, []
    while time.perf_counter() - started < SUSTAINED_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            a @ b
        end.record()
        end.synchronize()
        last = [*last[-9:], start.elapsed_time(end) / 1e3 / batch]  # the last ten batches: the settled clock
    return round(min(1.0, short / statistics.median(last)), 4)


def _gemm_flops(m: int, n: int, k: int) -> float:
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return 2 * m * n * k / _cuda_seconds(lambda: a @ b)


def _linear_flops(m: int, n: int, k: int) -> float:
    """A linear layer's forward GEMM in bf16 as F.linear runs it: x (m, k) by the weight (n, k) transposed."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return 2 * m * n * k / _cuda_seconds(lambda: F.linear(x, w))


def _linear_backward_flops(m: int, n: int, k: int) -> float:
    """The two backward GEMMs of the linear whose forward GEMM is (m, n, k), in bf16 as autograd runs them: the
    input gradient (dy by the weight) and the weight gradient (dy transposed by x); their FLOPs over their time."""
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def both() -> None:
        dy @ w
        dy.t() @ x
    return 2 * 2 * m * n * k / _cuda_seconds(both)


def _if_it_fits(gemm_flops, m: int, n: int, k: int) -> float | None:
    """The rate `gemm_flops` measures, or None where the GPU has no room for the GEMM's tensors (a small GPU, the
    largest shapes): the planner then takes the rate of the most rows measured."""
    import torch

    try:
        return gemm_flops(m, n, k)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _model_shapes(lm_head: bool = True) -> list[tuple[int, int, int]]:
    """(tokens, out, in) of each linear layer of SHAPE_MODELS, forward: the GEMMs costs.py times (the blocks' alone
    without `lm_head`: fp8 GEMMs are theirs)."""
    from fastml.spec import PRESETS

    shapes = set()
    for name in SHAPE_MODELS:
        spec = PRESETS[name]
        for tokens in SHAPE_TOKENS:
            shapes |= {(tokens, n, k) for n, k in spec.block_linear_shapes().values()}
        # The LM head's N (the vocabulary) is large: its rate has reached its plateau at the fewer rows.
        if lm_head:
            shapes |= {(tokens, *spec.lm_head_shape()) for tokens in SHAPE_TOKENS[:2]}
    return sorted(shapes)


def _hbm_bytes_per_s(num_bytes: int) -> float:
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / _cuda_seconds(lambda: dst.copy_(src))


def _host_copies(device: int, num_bytes: int) -> tuple[float, float]:
    """One GPU's pinned host-to-device and device-to-host rates."""
    import torch

    gpu = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{device}")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.device(device):
        up = num_bytes / _cuda_seconds(lambda: gpu.copy_(host, non_blocking=True), repeats=5)
        down = num_bytes / _cuda_seconds(lambda: host.copy_(gpu, non_blocking=True), repeats=5)
    return up, down


def _all_gpus_up(num_bytes: int) -> float:
    """Every GPU copying from pinned host memory at once, one thread each: what the node's PCIe root carries."""
    import torch

    count = torch.cuda.device_count()
    buffers = [(torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{i}"),
                torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)) for i in range(count)]

    def copy(i: int) -> None:
        gpu, host = buffers[i]
        with torch.cuda.device(i):
            for _ in range(3):
                gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize(i)

    for i in range(count):  # warm-up
        copy(i)
    threads = [threading.Thread(target=copy, args=(i,)) for i in range(count)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 3 * count * num_bytes / (time.perf_counter() - start)


def _launch_s(launches: int = 2000) -> float:
    """The GPU time per kernel of a long run of the smallest ones: launch and scheduling, no work."""
    import torch

    x = torch.zeros(1, device="cuda")

    def run() -> None:
        for _ in range(launches):
            x.add_(1)
    return _cuda_seconds(run, repeats=3, queued=False) / launches


def _host_copy_bytes_per_s(num_bytes: int) -> float:
    """A large copy in host memory: bytes read plus written per second, the fastest of a few."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_wall_s(lambda: dst.copy_(src)) for _ in range(3))
    return 2 * num_bytes / best


def _cpu_adam_params_per_s() -> float:
    """The C++ CPU AdamW with a bf16 gradient and bf16 weights out, as offloaded optimizer states are stepped."""
    import torch

    from fastml.executor.memory import cpu_adam

    master, m, v = torch.randn(ADAM_PARAMS), torch.zeros(ADAM_PARAMS), torch.zeros(ADAM_PARAMS)
    grad, out = torch.randn(ADAM_PARAMS).to(torch.bfloat16), torch.empty(ADAM_PARAMS, dtype=torch.bfloat16)

    def step() -> None:
        cpu_adam.adamw_step_(master, m, v, grad, out, 1e-4, 0.9, 0.95, 1e-8, 0.1, 1)
    step()  # pages the tensors in
    return ADAM_PARAMS / min(_wall_s(step) for _ in range(ADAM_ROUNDS))


def _wall_s(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start
