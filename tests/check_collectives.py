"""One rank of a test job that checks the memcpy collectives (executor/parallel/hostcomm.py) on DEVICE ("cpu", or "cuda" for
GPU 0, every rank on it) against the same sums taken in rank order on the CPU, bit for bit, in bf16 and fp32, for
shards of one round and of several (tests/test_distributed.py, tests/test_gpu_distributed.py).

    torchrun --standalone --nproc-per-node N tests/check_collectives.py DEVICE [ROW_BYTES]

ROW_BYTES, where given, replaces the rows' MEMCPY_ROW_BYTES (32 MiB): the rounds are the same with rows of a few KiB,
and the shards of several rounds much smaller (on a 2-core CPU, summing those of full rows took most of the time).
"""

import sys

import torch
import torch.distributed as dist

from fastml.executor.parallel import hostcomm
from fastml.executor.parallel.world import launched
from fastml.executor.parallel.hostcomm import HostCollectives
if len(sys.argv) > 2:
    hostcomm.MEMCPY_ROW_BYTES = int(sys.argv[2])
ROW_BYTES = hostcomm.MEMCPY_ROW_BYTES
world = launched()
dist.init_process_group("gloo")
device = torch.device(sys.argv[1])
comm = HostCollectives(world, device)
W, r = world.size, world.rank
def data(rank, n, dtype):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n)).to(dtype)
for dtype in (torch.bfloat16, torch.float32):
    # one round; several: a row holds ROW_BYTES // 4 bf16 elements per cell at 2 ranks (2**23 in a row of 32 MiB)
    for shard in (1000, ROW_BYTES // 4 + 12345):
        every = [data(rank, W * shard, dtype) for rank in range(W)]
        expected = every[0][r * shard:(r + 1) * shard].clone()
        for rank in range(1, W):
            expected += every[rank][r * shard:(r + 1) * shard]  # in rank order, rounded after each addition
        out = torch.empty(shard, dtype=dtype, device=device)
        comm.reduce_scatter(out, every[r].to(device)).wait()
        assert torch.equal(out.cpu(), expected), ("reduce_scatter", dtype, shard)
        gathered = torch.empty(W * shard, dtype=dtype, device=device)
        comm.all_gather(gathered, every[r][:shard].to(device)).wait()
        assert torch.equal(gathered.cpu(), torch.cat([e[:shard] for e in every])), ("all_gather", dtype, shard)
        in_place = torch.zeros(W * shard, dtype=dtype, device=device)
        in_place[r * shard:(r + 1) * shard] = every[r][:shard].to(device)
        comm.all_gather(in_place, in_place[r * shard:(r + 1) * shard]).wait()
        assert torch.equal(in_place.cpu(), torch.cat([e[:shard] for e in every])), ("in place", dtype, shard)
        summed = every[r].clone().to(device)
        comm.all_reduce(summed).wait()
        sums = [every[0][k * shard:(k + 1) * shard].clone() for k in range(W)]
        for k in range(W):
            for rank in range(1, W):
                sums[k] += every[rank][k * shard:(k + 1) * shard]
        assert torch.equal(summed.cpu(), torch.cat(sums)), ("all_reduce", dtype, shard)
if device.type == "cuda":
    torch.cuda.synchronize()
comm.close()
print(f"rank {r}: memcpy collectives equal")
