"""On one CUDA GPU, two ranks sharing it (FASTML_TEST_ONE_GPU, since NCCL refuses two ranks on one GPU): the memcpy
collectives on the copy engines through pinned shared memory, against the same sums taken in rank order on the CPU;
and the sharding engine on CUDA streams over them, trained against one process. A machine of several GPUs runs the
same code with each rank on its own GPU (benchmarks/multi_gpu.py measures it)."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from fastml.plan import Hardware, Knobs, Plan, Training
from fastml.record import load_record
from fastml.spec import PRESETS
from test_distributed import ZERO, check_collectives, records, torchrun
from test_gpu import deterministic

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")]

ONE_GPU = {"FASTML_TEST_ONE_GPU": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

def test_memcpy_collectives_on_cuda_equal_the_sums_in_rank_order():
    assert check_collectives("cuda", 2, env=ONE_GPU) == 2


def gpu_plan(ranks: int = 2, micro: int = 4, steps: int = 4, **knobs) -> Plan:
    return Plan(model=PRESETS["tiny"], training=Training(seq_len=128, global_batch_tokens=128 * 8, steps=steps),
                hardware=Hardware(profile="h200", device="cuda", num_gpus=ranks, gpus_per_node=ranks),
                knobs=Knobs(micro_batch_size=micro, grad_accum_steps=8 // (micro * ranks), comm="memcpy", **knobs))


SHARED_GPU_PLANS = {
    "zero0": gpu_plan(),
    "zero3-host-cache": gpu_plan(micro=2, **ZERO[3], cache_weights_on_host=True),
    "zero1-cpu-step": gpu_plan(micro=2, **ZERO[1], offload_optimizer=1.0, offload_master=1.0),
    "zero3-streamed-shards": gpu_plan(micro=2, **ZERO[3], offload_weights=1.0, offload_residuals=0.5),
    "zero2-compiled": gpu_plan(micro=2, **ZERO[2], recompute=("block",), compile=True),
    "zero2-host-gradient-shards": gpu_plan(micro=1, **ZERO[2], offload_gradients=1.0, offload_optimizer=1.0),
    # the streamed blocks' one host copy, pinned for both ranks' copy engines, each stepping its shard there; then on
    # its worker thread into the next step (the other groups gathered first)
    "zero1-shared-host-weights": gpu_plan(micro=2, **ZERO[1], offload_weights=1.0, offload_optimizer=1.0,
                                          share_host_weights=True),
    "zero1-shared-host-weights-overlap": gpu_plan(micro=2, **ZERO[1], offload_weights=0.5, offload_optimizer=1.0,
                                                  share_host_weights=True, overlap_cpu_step=True),
}


@pytest.fixture(scope="module")
def shared_gpu_dir(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("shared-gpu")
    runs = [{"plan": p, "log": tmp_path / f"{name}.jsonl", "deterministic": True, "run_dir": str(tmp_path / name)}
            for name, p in SHARED_GPU_PLANS.items()]
    for agent in torchrun(tmp_path, runs, 2, env=ONE_GPU):
        assert agent.returncode == 0, agent.stderr[-3000:]
    return tmp_path


@pytest.fixture(scope="module")
def shared_gpu(shared_gpu_dir):
    return {name: records(shared_gpu_dir / f"{name}.jsonl") for name in SHARED_GPU_PLANS}


def test_each_gpu_rank_steps_on_the_cpu_with_its_share_of_the_cores(shared_gpu_dir):
    """torchrun gives each rank OMP_NUM_THREADS=1; the C++ AdamW of each still runs on its share of the cores."""
    record = load_record(shared_gpu_dir / "zero1-cpu-step" / "record.json")
    assert record.machine.cpu_threads == max(1, os.cpu_count() // 2)


def alone(tmp_path: Path, p: Plan) -> list[float]:
    from fastml.executor.loop.train import train

    k = p.knobs
    single = dataclasses.replace(p, hardware=Hardware(profile="h200", device="cuda"),
                                 knobs=dataclasses.replace(k, grad_accum_steps=k.grad_accum_steps * 2))
    with deterministic():
        train(single, log_json=tmp_path / "alone.jsonl", show_progress=False)
    return [r["loss"] for r in records(tmp_path / "alone.jsonl")]


def test_one_micro_batch_per_rank_over_memcpy_is_one_process_bit_for_bit(tmp_path, shared_gpu):
    assert [r["loss"] for r in shared_gpu["zero0"]] == alone(tmp_path, SHARED_GPU_PLANS["zero0"])


@pytest.mark.parametrize("name", [n for n in SHARED_GPU_PLANS if n != "zero0"])
def test_sharding_on_cuda_streams_trains_as_one_process(tmp_path, shared_gpu, name):
    """Gathered weights and their host copies, shards stepped by the C++ AdamW, streamed weight shards, a streamed
    host copy the ranks share and compiled blocks, on the GPU's streams: the losses of one process, to bf16 rounding. The first loss comes before
    any step, so it is the same bit for bit, but where the blocks are compiled: each process's Inductor chooses its
    own kernels (seen differing by 5e-6 in the first loss on an H200)."""
    got = [r["loss"] for r in shared_gpu[name]]
    reference = alone(tmp_path, SHARED_GPU_PLANS[name])
    if not SHARED_GPU_PLANS[name].knobs.compile:
        assert got[0] == reference[0]
    assert got == pytest.approx(reference, rel=2e-3)
