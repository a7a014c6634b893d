"""Several ranks on a CPU (gloo, and the memcpy collectives through shared memory): data parallelism and every ZeRO
stage, alone and with offload, trained a few steps by jobs of 2 processes and of 2 nodes x 2 processes
(torchrun's rendezvous, both nodes on this machine), each compared with one process taking every micro-batch of the
step; checkpoints resumed at another number of ranks; a rank that dies, hangs or meets a NaN; and the main job,
`fastml plan --device cpu --gpus 2` then `fastml run`.

Tolerances: the ranks' gradients are summed in another order than one process adds its micro-batches, so losses
agree to rounding: rel 1e-5 in fp32, 1e-3 with bf16 weights. Where each rank takes one micro-batch and the sum runs
in rank order (the memcpy collectives, and gloo at these sizes), the order is the same and the losses are equal.
"""

import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from safetensors.torch import load_file

from fastml.config import to_dict
from fastml.plan import Hardware, Knobs, Plan, Training, load_plan, save_plan
from fastml.record import load_record
from fastml.executor import native
from fastml.executor.memory.shared import FLAG_LINE_BYTES
from fastml.executor.model.transformer import build_model
from fastml.executor.storage.data import TokenData
from fastml.executor.storage.tensordir import read_manifest
from fastml.executor.loop.train import train
from fastml.executor.parallel.world import World
from fastml.executor.storage.prepare import prepare
from small_model import EVAL_TOKENS, SMALL, SMALL_OVERRIDES
from test_validation import documents, independent_loss, val_losses, validated_plan, write_jsonl

pytestmark = pytest.mark.slow

SEQ_LEN, SEQUENCES = 32, 8
ZERO = {0: {}, 1: dict(shard_optimizer=True), 2: dict(shard_optimizer=True, shard_gradients=True),
        3: dict(shard_optimizer=True, shard_gradients=True, shard_weights=True)}
FP32 = dict(param_dtype="fp32", matmul_dtype="fp32")
ROOT = Path(__file__).resolve().parent.parent


def plan(ranks: int = 1, nodes: int = 1, micro: int = 2, steps: int = 3, bf16: bool = False, **knobs) -> Plan:
    """The small model on SEQUENCES sequences a step, over `ranks` CPU processes on `nodes` nodes."""
    return Plan(model=SMALL, training=Training(seq_len=SEQ_LEN, global_batch_tokens=SEQ_LEN * SEQUENCES,
                                                         steps=steps, eval_tokens=EVAL_TOKENS),
                hardware=Hardware(device="cpu", num_gpus=ranks, gpus_per_node=ranks // nodes),
                knobs=Knobs(micro_batch_size=micro, grad_accum_steps=SEQUENCES // (micro * ranks),
                            **({} if bf16 else FP32), **knobs))


def one_process(p: Plan) -> Plan:
    """The same step in one process: every micro-batch of every rank, one after another."""
    k = p.knobs
    return dataclasses.replace(p, hardware=Hardware(device="cpu"), knobs=dataclasses.replace(
        k, grad_accum_steps=k.grad_accum_steps * p.hardware.num_gpus))


def with_checkpoints(p: Plan, root: Path, interval: int = 2) -> Plan:
    return dataclasses.replace(p, training=dataclasses.replace(p.training, checkpoint_dir=str(root),
                                                               checkpoint_interval=interval))


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def losses(log: Path) -> list[float]:
    return [r["loss"] for r in records(log)]


def trained_alone(tmp_path: Path, p: Plan, name: str, **options) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    train(p, log_json=log, show_progress=False, **options)
    return losses(log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path: Path, runs: list[dict], ranks: int, nodes: int = 1, env=None,
             timeout_s: float = 600, cwds: list[Path] | None = None) -> list[subprocess.CompletedProcess]:
    """Runs tests/run_plans.py over `runs` as a job of `ranks` processes on `nodes` torchrun agents (nodes), each
    agent in its working directory of `cwds` where given."""
    spec = tmp_path / f"spec-{ranks}x{nodes}.json"
    spec.write_text(json.dumps({"runs": [{**run, "plan": to_dict(run["plan"]), "log": str(run["log"])}
                                         for run in runs]}))
    if nodes == 1:
        where = ["--standalone"]
    else:
        where = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                 "--rdzv-id", tmp_path.name]
    command = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(ranks // nodes),
               str(ROOT / "tests" / "run_plans.py"), str(spec)]
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, cwd=cwds[node] if cwds else None)
              for node in range(nodes)]
    done = []
    for agent in agents:
        out, err = agent.communicate(timeout=timeout_s)
        done.append(subprocess.CompletedProcess(command, agent.returncode, out, err))
    return done


def job(tmp_path: Path, plans: dict[str, Plan], ranks: int, nodes: int = 1,
        more: list[dict] = ()) -> dict[str, list[dict]]:
    """Each plan trained by one job of `ranks` processes (started once for all of them, with the `more` runs of
    other tests after them: a start costs seconds of imports per process): its records by name (and its run record
    in tmp_path/name)."""
    runs = [{"plan": p, "log": tmp_path / f"{name}.jsonl", "run_dir": str(tmp_path / name)}
            for name, p in plans.items()]
    for agent in torchrun(tmp_path, [*runs, *more], ranks, nodes):
        assert agent.returncode == 0, agent.stderr[-3000:]
    return {name: records(tmp_path / f"{name}.jsonl") for name in plans}


# --- one job of 2 ranks trains all of these ------------------------------------------------------------------------

def two_rank_plans() -> dict[str, Plan]:
    plans = {f"zero{stage}-{comm}": plan(2, comm=comm, **ZERO[stage]) for stage in ZERO for comm in ("nccl", "memcpy")}
    plans |= {f"one-micro-batch-{comm}": plan(2, micro=4, comm=comm) for comm in ("nccl", "memcpy")}
    off = dict(offload_optimizer=1.0, offload_master=1.0)
    plans |= {
        "zero1-cpu-step": plan(2, bf16=True, **ZERO[1], **off),
        "zero3-cpu-step-memcpy": plan(2, bf16=True, comm="memcpy", **ZERO[3], **off),
        "zero3-streamed": plan(2, bf16=True, **ZERO[3], offload_weights=1.0, offload_residuals=0.5),
        "zero3-host-cache": plan(2, bf16=True, comm="memcpy", **ZERO[3], cache_weights_on_host=True),
        "ddp-host-gradients": plan(2, micro=1, bf16=True, offload_gradients=1.0),
        "zero1-host-gradients": plan(2, micro=1, bf16=True, **ZERO[1], offload_gradients=1.0),
        "zero2-host-gradient-shards": plan(2, micro=1, bf16=True, **ZERO[2], offload_gradients=1.0,
                                           offload_optimizer=1.0),
        "ddp-streamed-memcpy": plan(2, bf16=True, comm="memcpy", offload_weights=0.5, offload_optimizer=0.5),
        # streamed weights stepped on the CPU, in each rank's own host copy or in one the node's ranks share
        "zero1-streamed-cpu-step": plan(2, bf16=True, **ZERO[1], offload_weights=1.0, offload_optimizer=1.0),
        "zero1-shared-host-weights": plan(2, bf16=True, **ZERO[1], offload_weights=1.0, offload_optimizer=1.0,
                                          share_host_weights=True),
        "zero1-shared-host-weights-memcpy": plan(2, bf16=True, comm="memcpy", **ZERO[1], offload_weights=0.5,
                                                 offload_optimizer=1.0, share_host_weights=True),
        # and their CPU steps overlapping the next step, each followed by the ranks' barrier (the others gathered)
        "zero1-shared-host-weights-overlap": plan(2, bf16=True, comm="memcpy", **ZERO[1], offload_weights=0.5,
                                                  offload_optimizer=1.0, share_host_weights=True,
                                                  overlap_cpu_step=True),
        # the planner's bf16 masters: each rank's shard of the compensation stepped beside its m and v, half on the CPU
        "zero1-compensated-bf16": plan(2, bf16=True, **ZERO[1], optimizer_dtype="bf16", master_dtype="bf16_kahan",
                                       offload_optimizer=0.5),
    }
    return plans


def SHARED_FROM_CHECKPOINT(root: Path) -> Plan:  # noqa: N802: a plan, as the constants beside it
    """Shared host weights loaded from the weights of the sharded run's checkpoint of step 2 (each rank its part)."""
    p = plan(2, bf16=True, **ZERO[1], offload_weights=1.0, offload_optimizer=1.0, share_host_weights=True)
    return dataclasses.replace(p, training=dataclasses.replace(p.training, init_from=str(
        root / "ck" / "step-00000002")))


NAN_PLAN = plan(2, steps=4)
NAN_FAULTS = "nan-loss@2:1"
SHARDED_CHECKPOINTS = plan(2, steps=4, **ZERO[2])


@pytest.fixture(scope="module")
def two_ranks_dir(tmp_path_factory):
    """The one job of 2 ranks of this module: two_rank_plans(), then a NaN on rank 1 (nan.jsonl) and a ZeRO-2 run
    that checkpoints every 2 steps (sharded.jsonl, ck/), read by the tests of those below."""
    path = tmp_path_factory.mktemp("two-ranks")
    validated = validated_plan(prepared_with_validation(path), path / "validated-ck", ranks=2, **ZERO[3])
    job(path, two_rank_plans(), ranks=2, more=[
        {"plan": NAN_PLAN, "log": path / "nan.jsonl", "faults": NAN_FAULTS},
        {"plan": with_checkpoints(SHARDED_CHECKPOINTS, path / "ck"), "log": path / "sharded.jsonl"},
        {"plan": validated, "log": path / "validated.jsonl"},
        {"plan": SHARED_FROM_CHECKPOINT(path), "log": path / "shared-from-checkpoint.jsonl"}])
    return path


def prepared_with_validation(root: Path) -> Path:
    prepare([write_jsonl(root / "d.jsonl", documents(400))], root / "data", progress=False, validation_fraction=0.1)
    return root / "data"


def test_two_ranks_evaluate_the_final_weights_loss_on_the_same_sequences(two_ranks_dir):
    """ZeRO-3 over 2 ranks, each evaluating half the sequences with its shards gathered: the sum over both is the
    loss of the final weights on all of them, computed here in one batch (tests/test_validation.py)."""
    losses = val_losses(two_ranks_dir / "validated.jsonl")
    assert list(losses) == [2, 4]
    assert losses[4] == pytest.approx(independent_loss(two_ranks_dir / "validated-ck", two_ranks_dir / "data", 32),
                                      rel=1e-5)


def final_val_loss(log_records: list[dict]) -> float:
    """The validation loss after the last step (the default corpus holds out a split, so every run evaluates one)."""
    return log_records[-1]["val_loss"]


@pytest.fixture(scope="module")
def two_ranks(two_ranks_dir):
    return {name: records(two_ranks_dir / f"{name}.jsonl") for name in two_rank_plans()}


@pytest.mark.parametrize("name", [f"zero{stage}-{comm}" for stage in ZERO for comm in ("nccl", "memcpy")])
def test_every_zero_stage_on_both_transports_trains_as_one_process(tmp_path, two_ranks, name):
    alone = trained_alone(tmp_path, one_process(two_rank_plans()[name]), name)
    got = [r["loss"] for r in two_ranks[name]]
    assert got[0] == alone[0]  # before any step: the same weights and the same sequences
    assert got == pytest.approx(alone, rel=1e-5)
    assert final_val_loss(two_ranks[name]) == pytest.approx(final_val_loss(records(tmp_path / f"{name}.jsonl")),
                                                            rel=1e-5)


@pytest.mark.parametrize("comm", ["nccl", "memcpy"])
def test_one_micro_batch_per_rank_sums_in_one_processs_order(tmp_path, two_ranks, comm):
    name = f"one-micro-batch-{comm}"
    log = tmp_path / "alone.jsonl"
    train(one_process(two_rank_plans()[name]), log_json=log, show_progress=False)
    assert [(r["loss"], r["grad_norm"]) for r in two_ranks[name]] == [(r["loss"], r["grad_norm"]) for r in records(log)]


@pytest.mark.parametrize("name", ["zero1-cpu-step", "zero3-cpu-step-memcpy", "zero3-streamed", "zero3-host-cache",
                                  "ddp-host-gradients", "zero1-host-gradients", "zero2-host-gradient-shards",
                                  "ddp-streamed-memcpy", "zero1-compensated-bf16", "zero1-shared-host-weights",
                                  "zero1-shared-host-weights-memcpy", "zero1-shared-host-weights-overlap"])
def test_sharding_with_offload_trains_as_one_process_with_that_offload(tmp_path, two_ranks, name):
    """A rank's shard of the optimizer state in host memory, stepped by the C++ AdamW; streamed weight shards;
    gathered weights kept on the host for the backward pass; gradients, or a rank's reduced shard of them, summed
    on the host over micro-batches."""
    alone = trained_alone(tmp_path, one_process(two_rank_plans()[name]), name)
    got = [r["loss"] for r in two_ranks[name]]
    assert got[0] == alone[0]
    assert got == pytest.approx(alone, rel=1e-3)
    assert final_val_loss(two_ranks[name]) == pytest.approx(final_val_loss(records(tmp_path / f"{name}.jsonl")),
                                                            rel=1e-3)


def test_ranks_sharing_the_streamed_weights_host_copy_train_bit_for_bit_as_with_a_copy_each(two_ranks, two_ranks_dir):
    """knobs.share_host_weights changes where the updated weights are written, not what they are: each rank's CPU
    step writes its shard into the node's one copy instead of its own, and no all-gather follows. The run's meter
    counts each rank's share of that copy, so the two ranks' host weights are half of one copy each."""
    own, shared = two_ranks["zero1-streamed-cpu-step"], two_ranks["zero1-shared-host-weights"]
    assert [(r["loss"], r["grad_norm"]) for r in shared] == [(r["loss"], r["grad_norm"]) for r in own]
    assert shared[-1]["val_loss"] == own[-1]["val_loss"]
    small = build_model(SMALL)
    streamed_bytes = sum(p.numel() for name, p in small.named_parameters() if name.startswith("blocks.")) * 2
    host_weights = [log[-1]["host_memory_bytes"]["weights"] for log in (own, shared)]
    segment_bytes = 2 * FLAG_LINE_BYTES + streamed_bytes  # the barrier's flags first
    assert host_weights[1] == host_weights[0] - streamed_bytes + segment_bytes // 2
    record = load_record(two_ranks_dir / "zero1-shared-host-weights" / "record.json")
    assert record.measured.node_host_memory_bytes > 0


def test_ranks_sharing_host_weights_start_from_a_checkpoints_weights_as_one_process(tmp_path, two_ranks_dir):
    """training.init_from into the node's one host copy, each rank writing its part (executor/storage/checkpoints.py):
    the losses of one process started from the same weights."""
    got = losses(two_ranks_dir / "shared-from-checkpoint.jsonl")
    alone = trained_alone(tmp_path, one_process(SHARED_FROM_CHECKPOINT(two_ranks_dir)), "alone")
    assert got[0] == alone[0]
    assert got == pytest.approx(alone, rel=1e-3)


def test_ranks_sharing_host_weights_overlap_their_cpu_steps_with_the_next_step_bit_for_bit(two_ranks):
    """knobs.overlap_cpu_step with sharded states and shared host weights: the shared blocks step on each rank's
    worker thread, each then waiting for the other rank's (a barrier), while the next forward pass begins; the
    embedding, the head and the blocks kept on the GPU step first and are gathered. Only the timing changes."""
    overlapped, inline = two_ranks["zero1-shared-host-weights-overlap"], two_ranks["zero1-shared-host-weights-memcpy"]
    assert [(r["loss"], r["grad_norm"]) for r in overlapped] == [(r["loss"], r["grad_norm"]) for r in inline]


def test_four_ranks_sharing_the_streamed_weights_host_copy_train_as_one_process(tmp_path):
    """knobs.share_host_weights over 4 ranks, on gloo and on the memcpy collectives, half the blocks streamed: the
    loss curve of one process."""
    plans = {f"shared-{comm}": plan(4, micro=1, bf16=True, comm=comm, **ZERO[1], offload_weights=0.5,
                                    offload_optimizer=1.0, share_host_weights=True) for comm in ("nccl", "memcpy")}
    got = job(tmp_path, plans, ranks=4)
    for name, p in plans.items():
        alone = trained_alone(tmp_path, one_process(p), f"{name}-alone")
        assert [r["loss"] for r in got[name]] == pytest.approx(alone, rel=1e-3)


def test_each_rank_works_on_its_share_of_the_cores_under_torchrun(two_ranks_dir):
    """torchrun sets OMP_NUM_THREADS=1 in each rank; each still takes its share of the cores, and the record says so."""
    record = load_record(two_ranks_dir / "zero1-cpu-step" / "record.json")
    assert record.machine.cpu_threads == max(1, os.cpu_count() // 2)


def test_gpu_ranks_take_their_share_of_the_cores_whatever_the_launcher_left_them(monkeypatch):
    """The C++ AdamW of a GPU rank runs on torch's threads: under torchrun each had one, under torch's elastic
    launcher (`fastml run`) each had all the cores; both now take the cores this process may use // ranks of the
    node."""
    from fastml.executor.loop import device

    gpus = dataclasses.replace(plan(4), hardware=Hardware(device="cuda", num_gpus=4, gpus_per_node=4))
    monkeypatch.setattr(device, "check_gpus", lambda plan: None)
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(24)))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    threads = torch.get_num_threads()
    try:
        for before in (1, 24):
            torch.set_num_threads(before)
            got = device.training_device(gpus, World(rank=1, size=4, local_rank=1, local_size=4))
            assert (got, torch.get_num_threads()) == (torch.device("cuda", 1), 6)
    finally:
        torch.set_num_threads(threads)


# --- 2 nodes of 2 ranks ---------------------------------------------------------------------------------------

def wider_plans() -> dict[str, Plan]:
    return {"zero0-nccl": plan(4, 2), "zero3-nccl": plan(4, 2, **ZERO[3]),
            "zero1-cpu-step": plan(4, 2, bf16=True, **ZERO[1], offload_optimizer=1.0)}


@pytest.fixture(scope="module")
def two_nodes_job(tmp_path_factory, two_ranks_dir):
    """The one job of 2 nodes x 2 ranks, each torchrun agent in a working directory of its own: wider_plans(), the 2
    ranks' sharded checkpoint of step 2 resumed by 4 (resumed-4.jsonl), then one checkpoint directory both nodes see
    (an absolute path) and one they do not (the relative "ck", another directory on each node), which ends the job.
    Its directory and its agents. (One job of 4 ranks on one node more cost half a minute of a 2-core machine's
    10-minute suite: the memcpy collectives at 2 to 4 ranks are checked on their own below.)"""
    path = tmp_path_factory.mktemp("two-nodes")
    cwds = [path / "agent-a", path / "agent-b"]
    for cwd in cwds:
        cwd.mkdir()
    resumed = path / "resumed-4"
    shutil.copytree(two_ranks_dir / "ck" / "step-00000002", resumed / "step-00000002")
    runs = [{"plan": p, "log": path / f"{name}.jsonl", "run_dir": str(path / name)}
            for name, p in wider_plans().items()]
    runs += [{"plan": with_checkpoints(plan(4, 2, steps=4, **ZERO[3]), resumed), "log": path / "resumed-4.jsonl",
              "resume": True},
             {"plan": with_checkpoints(plan(4, 2, steps=1), path / "shared"), "log": path / "shared.jsonl"},
             {"plan": with_checkpoints(plan(4, 2, steps=1), Path("ck")), "log": path / "per-node.jsonl"}]
    return path, torchrun(path, runs, 4, 2, cwds=cwds)


def test_two_nodes_of_two_ranks_train_as_one_process(tmp_path, two_nodes_job):
    """A job that ends in the refusal of its last run: the runs before it trained."""
    plans = wider_plans()
    path, agents = two_nodes_job
    assert all((path / f"{name}.jsonl").is_file() for name in plans), agents[0].stderr[-3000:]
    trained = {name: records(path / f"{name}.jsonl") for name in plans}
    for name, p in plans.items():
        alone = trained_alone(tmp_path, one_process(p), name)
        got = [r["loss"] for r in trained[name]]
        assert got[0] == alone[0], name
        assert got == pytest.approx(alone, rel=1e-3 if p.knobs.param_dtype == "bf16" else 1e-5), name


def test_nodes_that_see_different_checkpoint_directories_are_refused(two_nodes_job):
    """2 nodes x 2 ranks on one machine, each torchrun agent in a working directory of its own: a relative checkpoint
    directory names another directory on each node, as a disk of each node's would. Every rank refuses it before
    training; a directory both see (an absolute path here) passes the same check and trains."""
    tmp_path, agents = two_nodes_job
    assert (tmp_path / "shared" / "step-00000001").is_dir() and len(records(tmp_path / "shared.jsonl")) == 1
    for agent in agents:
        assert agent.returncode != 0
        assert re.search(r"ck: is not one directory that every node shares: node 1 \(host [^)]+\) does not see the "
                         r"file rank 0 wrote into it", agent.stderr), agent.stderr[-3000:]
    assert not (tmp_path / "per-node.jsonl").exists() and not list(tmp_path.rglob(".fastml-node-check-*"))


# --- the collectives, data, NaN, checkpoints, failures -----------------------------------------------------------

def check_collectives(device: str, ranks: int, env=None, row_bytes: int | None = None) -> int:
    """tests/check_collectives.py as a job of `ranks` processes (with rows of `row_bytes`, where given); how many
    ranks found every result equal."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), str(ROOT / "tests" / "check_collectives.py"), device,
                             *([str(row_bytes)] if row_bytes else [])], capture_output=True,
                            text=True, env={**os.environ, **(env or {})}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.count("memcpy collectives equal")


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_memcpy_collectives_equal_the_sums_in_rank_order(ranks):
    """With rows of 64 KiB: the shards of several rounds are tens of thousands of elements, not millions. (The
    training runs above use the full rows, and tests/test_gpu_distributed.py checks them on a GPU.)"""
    assert check_collectives("cpu", ranks, row_bytes=2**16) == ranks


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A process group of this process alone, and the node's shared memory in a directory of the test."""
    import torch.distributed as dist

    from fastml.executor.memory import shared

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(shared, "SHARED_DIR", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    yield tmp_path / "shm"
    dist.destroy_process_group()


def test_the_shared_memory_is_removed_when_a_rank_fails_before_all_mapped_it(one_rank_group, monkeypatch):
    from fastml.executor.memory import shared
    from fastml.executor.parallel.world import SINGLE

    def another_rank_is_gone():
        raise RuntimeError("rank 1 is gone")
    monkeypatch.setattr(shared.dist, "barrier", another_rank_is_gone)
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        shared._map(SINGLE, 4096)
    assert list(one_rank_group.iterdir()) == []


def test_the_shared_memory_is_a_new_file_of_this_user_alone(one_rank_group, monkeypatch):
    """Created exclusively (a file or link already at its name is refused: it could be another user's, readable by
    them), mode 0600 whatever the umask."""
    import torch

    from fastml.executor.memory import shared
    from fastml.executor.parallel.world import SINGLE

    modes = []
    from_file = torch.from_file
    monkeypatch.setattr(torch, "from_file", lambda path, **kw: modes.append(os.stat(path).st_mode & 0o777)
                        or from_file(path, **kw))
    umask = os.umask(0)
    try:
        segment = shared._map(SINGLE, 4096)
    finally:
        os.umask(umask)
    assert modes == [0o600] and segment.numel() == 4096 and not segment.any()
    assert list(one_rank_group.iterdir()) == []

    class Token:
        hex = "0123456789abcdef"
    monkeypatch.setattr(shared.uuid, "uuid4", Token)
    victim = one_rank_group.parent / "victim"
    victim.write_text("theirs")
    (one_rank_group / f"fastml-shared-{os.getpid()}-0123456789ab").symlink_to(victim)
    with pytest.raises(FileExistsError):
        shared._map(SINGLE, 4096)
    assert victim.read_text() == "theirs"


def test_a_killed_jobs_shared_memory_is_removed_by_the_next(one_rank_group):
    """Named after the pid of the rank 0 that created it: a dead one's file goes, a running one's stays."""
    from fastml.executor.memory import shared
    from fastml.executor.parallel.world import SINGLE
    from test_files import reaped_pid

    dead, running = (one_rank_group / f"fastml-shared-{pid}-0123456789ab" for pid in (reaped_pid(), os.getpid()))
    dead.write_bytes(b"x")
    running.write_bytes(b"x")
    shared._map(SINGLE, 4096)
    assert list(one_rank_group.iterdir()) == [running]


SHARED_PROBE = """
import json, os, re, sys, torch, torch.distributed as dist
from fastml.executor.memory import shared
from fastml.executor.memory.shared import NodeShared
from fastml.executor.parallel.world import World
rank, size, num_bytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank, world_size=size)
node = NodeShared(World(rank=rank, size=size, local_rank=rank, local_size=size, node=0), num_bytes, cuda=False)
part = num_bytes // size
node.data[rank * part:(rank + 1) * part].fill_(rank + 1)  # each rank its part
node.barrier()
total = int(node.data.sum(dtype=torch.int64))  # and every rank reads all of it
node.barrier()  # measured once every rank maps every page, and before any unmaps one
kb = {"Rss": 0, "Pss": 0}
for block in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):  # a block a mapping
    if "fastml-shared-" in block.splitlines()[0]:
        for key in kb:
            kb[key] += int(re.search(rf"^{key}:\\s+(\\d+) kB", block, re.M)[1])
node.barrier()  # all measured while all map it
print(json.dumps({"total": total, "rss": kb["Rss"] * 1024, "pss": kb["Pss"] * 1024,
                  "others": shared.others_share_bytes()}))
"""


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_nodes_ranks_hold_one_copy_of_the_memory_they_share(tmp_path, ranks):
    """Measured by the kernel (/proc/self/smaps of each process): each rank writes its part of a 64 MiB segment and
    reads all of it; each one's resident set holds the whole segment, and their proportional set sizes (each page
    divided among the processes that map it) add up to one copy, not one a rank. The file is gone once all mapped
    it."""
    num_bytes = 64 * 2**20
    procs = [subprocess.Popen([sys.executable, "-c", SHARED_PROBE, str(rank), str(ranks), str(num_bytes),
                               str(tmp_path / "store")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(ranks)]
    seen = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        seen.append(json.loads(out))
    part = num_bytes // ranks
    assert all(s["total"] == sum((r + 1) * part for r in range(ranks)) for s in seen)
    page = os.sysconf("SC_PAGE_SIZE")
    assert all(num_bytes <= s["rss"] <= num_bytes + page for s in seen)  # the flags' page too
    assert num_bytes <= sum(s["pss"] for s in seen) <= num_bytes + ranks * page
    segment = ranks * FLAG_LINE_BYTES + num_bytes  # the meter's count of the others' shares, in every rank's RSS
    assert all(s["others"] == segment - segment // ranks for s in seen)


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_step_reads_the_sequences_of_one_process_once(ranks):
    data = TokenData.open("default", SEQ_LEN, SMALL.vocab_size)
    micro = SEQUENCES // ranks // 2
    alone = data.batches(micro, seed=0)
    split = [data.batches(micro, seed=0, rank=r, world_size=ranks) for r in range(ranks)]
    for _ in range(3):  # steps
        one = {tuple(row.tolist()) for _ in range(2 * ranks) for row in next(alone)[0]}
        together = [tuple(row.tolist()) for _ in range(2) for batch in split for row in next(batch)[0]]
        assert len(together) == len(set(together)) == SEQUENCES and set(together) == one


def test_a_nan_on_one_rank_skips_the_step_on_all(tmp_path, two_ranks_dir):
    """NAN_FAULTS: rank 1's loss of step 2 is NaN (in the 2 ranks' job)."""
    got = records(two_ranks_dir / "nan.jsonl")
    assert [r["skipped"] for r in got] == [False, True, False, False]
    os.environ["FASTML_FAULTS"] = "nan-loss@2"
    try:
        from fastml.executor.loop import faults

        faults._planned.cache_clear()
        alone = trained_alone(tmp_path, one_process(NAN_PLAN), "alone")
    finally:
        del os.environ["FASTML_FAULTS"]
        faults._planned.cache_clear()
    assert [r["loss"] for r in got if not r["skipped"]] == pytest.approx([x for x in alone if x is not None],
                                                                        rel=1e-5)


def test_a_sharded_checkpoint_resumes_at_one_and_at_four_ranks(tmp_path, two_ranks_dir, two_nodes_job):
    """Written by 2 ranks, each its shard of the optimizer state; resumed by 1 (here) and by 4 (sharded another way,
    in the 2 nodes' job): the loss curve goes on as the 2 ranks' did. `fastml convert --to-hf` reads it."""
    two = losses(two_ranks_dir / "sharded.jsonl")
    step2 = two_ranks_dir / "ck" / "step-00000002"
    assert sorted(p.name for p in step2.iterdir() if p.name.startswith("optimizer")) == [
        "optimizer-00000.safetensors", "optimizer-00001.safetensors"]
    # Each rank's RNG states, its own: seeded from training.seed + rank.
    rng = [load_file(step2 / name)["cpu"] for name in ("rng.safetensors", "rng-00001.safetensors")]
    assert not torch.equal(*rng)
    assert read_manifest(step2).training.world_size == 2
    root = tmp_path / "resumed-1"
    shutil.copytree(step2, root / step2.name)
    train(with_checkpoints(plan(1, steps=4), root), log_json=tmp_path / "resumed-1.jsonl", show_progress=False,
          resume=True)
    resumed_4 = two_nodes_job[0] / "resumed-4.jsonl"
    assert resumed_4.is_file(), two_nodes_job[1][0].stderr[-3000:]
    for log in (tmp_path / "resumed-1.jsonl", resumed_4):
        assert losses(log) == pytest.approx(two[2:], rel=1e-5), log
    converted = subprocess.run([sys.executable, "-m", "fastml", "convert", str(two_ranks_dir / "ck" / "step-00000004"),
                                "--to-hf", str(tmp_path / "hf")], capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def fastml(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastml", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_the_main_job_on_two_cpu_processes_trains_as_one(tmp_path):
    """`fastml plan --device cpu --gpus 2 -o p.json && fastml run p.json`: two gloo processes started by fastml
    itself, one progress display and one summary (rank 0's), and the losses of one process."""
    from fastml.cli import main

    pins = [arg for pin in SMALL_OVERRIDES for arg in ("--set", pin)]
    # The plan in this process (`fastml plan` runs as a command in tests/test_cli.py): a start costs seconds.
    assert main(["plan", "--device", "cpu", "--gpus", "2", "--seq", "64", "--trials", "20", *pins, "-o",
                 str(tmp_path / "p.json")]) == 0
    p = load_plan(tmp_path / "p.json")
    assert (p.hardware.num_gpus, p.hardware.device) == (2, "cpu")
    ran = fastml("run", "p.json", "--steps", "3", "--log-json", "log.jsonl", "--summary-json", "summary.json",
                 cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.count("fastml run: tiny, 3 steps") == 1 and "starting 2 CPU workers" in ran.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    alone = trained_alone(tmp_path, dataclasses.replace(one_process(p), training=dataclasses.replace(
        p.training, steps=3)), "alone")
    assert losses(tmp_path / "log.jsonl") == pytest.approx(alone, rel=1e-5)


def test_a_plan_for_more_ranks_than_started_is_one_error(tmp_path):
    """`torchrun --nproc-per-node 2 -m fastml run` of a plan for 4: the ranks' one line, and torchrun's own report of
    the failed job, printed after it (which fastml cannot leave out), names the same error as its root cause rather
    than a link to torch's documentation."""
    save_plan(plan(4), tmp_path / "p.json")
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "fastml", "run", "p.json"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    error = ("error: hardware.num_gpus: the plan is for 4 CPU processes (4 per node) but 2 processes were started "
             "(2 per node)")
    # Whichever rank says it first: the other may be stopped by torchrun before it does.
    said = r"fastml: (rank 1: )?" + re.escape(error)
    assert ran.returncode != 0 and re.search(said, ran.stderr), ran.stderr
    root_cause = ran.stderr.split("Root Cause (first observed failure):")[-1]
    assert re.search(r"traceback : " + said, root_cause), ran.stderr


SHARED_WEIGHTS = dict(bf16=True, **ZERO[1], offload_weights=1.0, offload_optimizer=1.0, share_host_weights=True)


@pytest.mark.parametrize("comm, killed, knobs", [("nccl", 0, {}), ("memcpy", 1, {}), ("memcpy", 1, SHARED_WEIGHTS)])
def test_a_killed_rank_stops_the_job_within_seconds_and_is_named(tmp_path, comm, killed, knobs):
    """kill -9 of one rank in the middle of a step: the other notices at once (gloo: its connection drops; memcpy:
    the barrier sees the process gone) and stops, so the launcher names the rank that was killed. Before, the memcpy
    rank waited at its barrier until the launcher killed it too, after its 30 s grace (SIGTERM only asks a rank to
    finish its step), and then named it. The progress line is drawn as on a terminal: every message starts a line of
    its own, also after a rank 0 killed in the middle of drawing it. Bound: 15 s from the last step logged (the
    killed step takes milliseconds; the rest is noticing, exiting and the launcher's 0.2 s polls), half the
    launcher's grace. The memory the ranks shared (the memcpy collectives', the streamed weights' host copy) is
    gone with them."""
    from fastml.executor.memory.shared import SHARED_DIR, SHARED_PREFIX

    before = set(SHARED_DIR.glob(f"{SHARED_PREFIX}*"))
    save_plan(plan(2, steps=4, comm=comm, **knobs), tmp_path / "p.json")
    ran = fastml("run", "p.json", "--log-json", "log.jsonl", cwd=tmp_path,
                 env={"FASTML_FAULTS": f"kill-mid-step@2:{killed}", "TTY_COMPATIBLE": "1", "TERM": "xterm"})
    stopped_s = time.time() - (tmp_path / "log.jsonl").stat().st_mtime  # rank 0 logged step 1; step 2 was killed
    assert ran.returncode == 128 + 9, ran.stderr
    assert f"fastml: rank {killed} (pid" in ran.stderr and "was killed by SIGKILL; the job stopped" in ran.stderr
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", ran.stderr)  # as a terminal shows it: without its escapes
    assert not re.search(r"[^\n\r]fastml: ", shown), shown  # each message at the start of a line
    assert stopped_s < 15, ran.stderr
    assert set(SHARED_DIR.glob(f"{SHARED_PREFIX}*")) <= before


def test_a_rank_waiting_at_the_memcpy_barrier_stops_when_the_one_it_waits_for_dies(tmp_path):
    """csrc/hostcomm.cpp: two processes meet at a barrier in shared memory; then one is killed, and the other's next
    barrier raises a DistBackendError naming it (the error torch.distributed raises when a peer is lost, which `fastml
    run` turns into exit code 4) instead of waiting out its 60 s timeout."""
    native.load()
    shared = tmp_path / "flags"
    flags = torch.from_file(str(shared), shared=True, size=2 * 8, dtype=torch.int64)  # two ranks' cache lines
    peer = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys, torch; from fastml.executor import native; native.load(); "
        "flags = torch.from_file(sys.argv[1], shared=True, size=16, dtype=torch.int64); "
        "torch.ops.fastml.host_barrier(flags, 1, 2, 1, 60.0); os.kill(os.getpid(), signal.SIGKILL)"), str(shared)])
    torch.ops.fastml.host_barrier(flags, 0, 2, 1, 60.0)
    assert peer.wait(timeout=60) == -signal.SIGKILL  # reaped, as a launcher reaps its workers
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=rf"rank 1 of this node \(pid {peer.pid}\) has died; rank 0 stops"):
        torch.ops.fastml.host_barrier(flags, 0, 2, 2, 60.0)
    assert time.monotonic() - start < 30


def test_a_hung_rank_stops_the_job_within_the_timeout_and_is_named(tmp_path):
    save_plan(plan(2, steps=4), tmp_path / "p.json")
    ran = fastml("run", "p.json", "--no-progress", "--timeout", "5", cwd=tmp_path, env={"FASTML_FAULTS": "hang@2:1"})
    assert ran.returncode == 4, ran.stderr
    assert "no progress for" in ran.stderr and "rank 1 (host" in ran.stderr and "at step 2" in ran.stderr


def test_a_rank_killed_while_writing_a_checkpoint_leaves_the_previous_one_usable(tmp_path):
    """The 2 ranks' checkpoint of step 2, both shards of its optimizer state, resumes (in this process: a resume at
    another number of ranks is the sharded checkpoint's test above, and it reads every shard)."""
    root = tmp_path / "ck"
    p = with_checkpoints(plan(2, steps=4, **ZERO[1]), root)
    save_plan(p, tmp_path / "p.json")
    killed = fastml("run", "p.json", "--no-progress", cwd=tmp_path, env={"FASTML_FAULTS": "kill-mid-checkpoint@4:1"})
    assert killed.returncode == 128 + 9, killed.stderr
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step-00000002"]
    said = io.StringIO()
    train(one_process(p), resume=True, log_json=tmp_path / "log.jsonl", show_progress=False,
          console=Console(file=said, width=10_000))
    assert f"resumed from {root / 'step-00000002'}" in said.getvalue()
    assert [r["step"] for r in records(tmp_path / "log.jsonl")] == [3, 4]


def test_every_ranks_shard_starts_16_byte_aligned_and_the_shards_cover_the_group():
    """A shard boundary at a multiple of 8 elements: the GPU AdamW steps every rank's shard with its packed kernel
    (csrc/adamw_cuda.cu), not the first piece of odd world sizes with its one-element kernel."""
    from fastml.executor.parallel.shard import Layout

    for world_size in (2, 3, 6):
        layout = Layout.of({"a": torch.Size([3, 5]), "b": torch.Size([101])}, world_size)
        assert layout.shard_numel % 8 == 0 and layout.padded_numel >= layout.numel
        ranges = [layout.range_of(rank) for rank in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
