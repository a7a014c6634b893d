"""Tensor parallelism two ways on the same blocks, timed side by side: the executor's explicit collectives
(executor/parallel/tensor.py, `TensorParallel.enter`/`leave` around sliced linears) against DTensor's
`parallelize_module` (Colwise/Rowwise, and SequenceParallel for the norms), with and without sequence parallelism.

Issue 28 let the executor take either, "your choice, measured". It took the explicit collectives for what DTensor
could not do (fastml's fused q/k/v and gate/up weights cut wrongly by ColwiseParallel, its custom ops refused on
DTensors: benchmarks/NOTES.md, issue 28 section 2); this measures what that choice costs or saves where both run:
plain, unfused Llama blocks (norms, grouped-query attention on SDPA, SwiGLU), the forward and backward passes of a
stack of them on random inputs, their gradients whole at the end as an optimizer step needs them. DTensor's styles
take the attention's and the FFN's input once (PrepareModuleInput), as the executor's `enter` does, so that both
ways run the same collectives (counted, by op); every rank's loss is checked to agree between the two ways before
they are timed, taking turns. Writes benchmarks/results/tensor_parallel-<device>.json.

    python benchmarks/tensor_parallel.py                      # 2 CPU processes over gloo
    python benchmarks/tensor_parallel.py --device cuda        # one process per GPU over NCCL (needs 2 GPUs)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

# (hidden, heads, key/value heads, ffn width, blocks, batch, sequence) by device: on a GPU, Llama-3.1-8B's blocks
SHAPES = {"cpu": (512, 8, 4, 1536, 4, 2, 512), "cuda": (4096, 32, 8, 14336, 4, 1, 8192)}
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # the lent machines' rule
# How closely the two ways' losses agree: the same products summed in another order (a few roundings of the dtype
# per block, far below these).
LOSS_AGREES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wo = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.wk, self.wv = (nn.Linear(hidden, kv_heads * self.head_dim, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # a rank's heads: -1 above
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False), \
            nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A Llama block of plain modules; `tp` (fastml's TensorParallel) wraps its column-parallel inputs and
    row-parallel outputs with the executor's collectives, where None DTensor's styles do (`dtensor_plan`)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, tp=None):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attention, self.feed_forward = Attention(hidden, heads, kv_heads), FeedForward(hidden, ffn)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._parallel(self.attention, self._norm(self.attention_norm, x))
        return x + self._parallel(self.feed_forward, self._norm(self.ffn_norm, x))

    def _norm(self, norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None or not self.tp.sequence:
            return norm(x)
        return F.rms_norm(x, norm.normalized_shape, self.tp.shared_weight(norm.weight), norm.eps)

    def _parallel(self, part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return part(x) if self.tp is None else self.tp.leave(part(self.tp.enter(x)))


COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def dtensor_plan(sequence: bool) -> dict:
    """DTensor's styles for a block: with sequence parallelism as torchtitan lays out a Llama block, without it the
    same with whole inputs. The attention's and the FFN's input made a DTensor once for their linears
    (PrepareModuleInput), so that the gradients of q, k and v, and of gate and up, are summed once: without it each
    ColwiseParallel linear sums its own (7 all-reduces a block where 4 do)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    arrives = Shard(1) if sequence else Replicate()  # sequence parallel: each rank's slice of the sequence
    plan = {name: ColwiseParallel() for name in COLUMN}
    plan |= {name: RowwiseParallel(output_layouts=arrives) for name in ROW}
    plan |= {part: PrepareModuleInput(input_layouts=(arrives,), desired_input_layouts=(Replicate(),))
             for part in ("attention", "feed_forward")}
    return plan | ({norm: SequenceParallel() for norm in ("attention_norm", "ffn_norm")} if sequence else {})


def sliced(whole: Block, tp, shape) -> Block:
    """The block of rank tp.rank under the explicit collectives: column-parallel weights cut by output, row-parallel
    ones by input."""
    mine = Block(*shape, tp)
    state = {}
    for name, tensor in whole.state_dict().items():
        part = name.removesuffix(".weight")
        dim = 0 if part in COLUMN else 1 if part in ROW else None
        state[name] = tensor if dim is None else tensor.tensor_split(tp.size, dim)[tp.rank]
    for name, tensor in state.items():  # the shapes change: assigned, not loaded
        module = mine.get_submodule(name.rsplit(".", 1)[0])
        module.weight = nn.Parameter(tensor.clone())
    return mine


def worker(rank: int, size: int, device_kind: str, port: int, shape: tuple, iterations: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **ENV})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fastml.executor.parallel.tensor import TensorParallel
    from fastml.spec import PRESETS

    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or size) // size))
    device = torch.device(device_kind, rank if device_kind == "cuda" else None)
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", rank=rank, world_size=size)
    mesh = init_device_mesh(device_kind, (size,))
    hidden, heads, kv_heads, ffn, blocks, batch, seq = shape
    block_shape = (hidden, heads, kv_heads, ffn)
    dtype = torch.bfloat16 if device_kind == "cuda" else torch.float32
    torch.manual_seed(0)
    wholes = [Block(*block_shape).to(device, dtype) for _ in range(blocks)]
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
    results = {}
    for sequence in (False, True):
        spec = PRESETS["tiny"]  # TensorParallel reads only its vocabulary's size from it, which these blocks lack
        tp = TensorParallel(spec, size=size, rank=rank, group=None, sequence=sequence)
        explicit = nn.Sequential(*(sliced(w, tp, block_shape).to(device, dtype) for w in wholes))
        by_dtensor = nn.Sequential(*(parallelize_module(Block(*block_shape).to(device, dtype), mesh,
                                                        dtensor_plan(sequence)) for _ in range(blocks)))
        for model, whole in zip(by_dtensor, wholes):  # the same weights: DTensor cuts the whole ones itself
            for name, param in model.named_parameters():
                param.data.copy_(_distribute_like(whole.get_parameter(name).data, param.data))
        mine = x.tensor_split(size, 1)[rank] if sequence else x  # sequence parallel: this rank's slice
        losses = {way: _loss(model, mine).item() for way, model in (("explicit", explicit), ("dtensor", by_dtensor))}
        if abs(losses["explicit"] - losses["dtensor"]) > LOSS_AGREES[dtype] * abs(losses["explicit"]):
            raise SystemExit(f"rank {rank}: the two ways disagree ({losses}); their timings would mean nothing")
        ways = {"explicit": explicit, "dtensor": by_dtensor}
        collectives = {way: _collectives(blocks, mine) for way, blocks in ways.items()}
        times = _timed(ways, mine, iterations, device)
        results["tensor_and_sequence_parallel" if sequence else "tensor_parallel"] = {
            "losses": losses, "ms": times, "collectives": collectives}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _distribute_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`whole` placed as `param` is: a DTensor's slices, or as it is where the plan left the module whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(whole, param.device_mesh, param.placements) if isinstance(param, DTensor) else whole


def _loss(blocks: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return blocks(x).float().square().mean()


def _train_pass(blocks: nn.Sequential, x: torch.Tensor) -> None:
    """A forward and backward pass, its gradients whole on every rank as an optimizer step needs them: DTensor
    leaves those of the sequence-parallel norms' weights partial sums (Partial) until asked, where the executor sums
    them in the backward pass."""
    from torch.distributed.tensor import DTensor, Replicate

    _loss(blocks, x).backward()
    for param in blocks.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)


def _collectives(blocks: nn.Sequential, x: torch.Tensor) -> dict[str, int]:
    """The collectives of a pass (`_train_pass`), by op (DTensor's CommDebugMode sees torch.distributed's calls and
    DTensor's own)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        _train_pass(blocks, x)
    blocks.zero_grad(set_to_none=True)
    return {str(op): count for op, count in comm.get_comm_counts().items()}


def _timed(ways: dict[str, nn.Sequential], x: torch.Tensor, iterations: int, device: torch.device) -> dict:
    """Milliseconds of each of `iterations` passes (`_train_pass`) of each way, after two to warm up; the ways take
    turns, each going first every other time, so that a change in the machine's speed falls on both."""
    times = {way: [] for way in ways}
    for i in range(iterations + 2):
        for way in list(ways)[::1 if i % 2 else -1]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            _train_pass(ways[way], x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times[way].append((time.perf_counter() - start) * 1e3)
            ways[way].zero_grad(set_to_none=True)
    return times


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args.add_argument("--ranks", type=int, default=2)
    args.add_argument("--iterations", type=int, default=30)
    a = args.parse_args()
    if a.device == "cuda" and torch.cuda.device_count() < a.ranks:
        raise SystemExit(f"needs {a.ranks} GPUs; this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.pt")
        mp.spawn(worker, args=(a.ranks, a.device, 29500 + os.getpid() % 1000, SHAPES[a.device], a.iterations, out),
                 nprocs=a.ranks)
        results = torch.load(out)
    rows = {}
    for mode, r in results.items():
        explicit, dtensor = statistics.median(r["ms"]["explicit"]), statistics.median(r["ms"]["dtensor"])
        ratios = [d / e for d, e in zip(r["ms"]["dtensor"], r["ms"]["explicit"])]  # each turn's pair
        quartiles = statistics.quantiles(ratios, n=4)
        rows[mode] = {"explicit_ms": explicit, "dtensor_ms": dtensor,
                      "dtensor_over_explicit": statistics.median(ratios),
                      "dtensor_over_explicit_quartiles": [quartiles[0], quartiles[2]],
                      "rank0_losses": r["losses"], "collectives_per_pass": r["collectives"], "runs_ms": r["ms"]}
        print(f"{mode}: explicit {explicit:.1f} ms, DTensor {dtensor:.1f} ms (each turn's ratio: median "
              f"{statistics.median(ratios):.3f}, quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}); "
              f"rank 0's losses {r['losses']['explicit']:.6g} and {r['losses']['dtensor']:.6g}; collectives of a "
              f"pass {r['collectives']}")
    from record import write_result

    shape = dict(zip(("hidden", "heads", "kv_heads", "ffn", "blocks", "batch", "seq"), SHAPES[a.device]))
    path = write_result(f"tensor_parallel-{a.device}.json", {
        "ranks": a.ranks, "shape": shape, "iterations": a.iterations, "modes": rows,
        "meaning": "milliseconds of one forward and backward pass of the blocks on rank 0, its gradients whole "
                   "(median); dtensor_over_explicit: the median of each turn's ratio, with its quartiles; losses of "
                   "rank 0 before timing, to agree between the two ways; the collectives of one pass, by op"})
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
