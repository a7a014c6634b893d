"""Tensor parallelism (with and without sequence parallelism) on CPU processes over gloo: jobs of 2 ranks (TP 2) and
of 4 (TP 2 x DP 2, ZeRO 0, 2 with gradient shards in host memory, and 3), each trained a few steps and compared with
one process taking every micro-batch; checkpoints (whole tensors, and ZeRO's shards of slices) resumed at another
layout; the slices of fused weights.

Tolerances: a row-parallel linear sums its two halves' partial products after the fact, and the cross-entropy adds
its vocabulary's halves, where one process adds the same terms in one GEMM: fp32 results differ in the last bits of
each such sum, as the data-parallel ranks' gradient sums do (tests/test_distributed.py), so losses and gradient norms
agree to rel 1e-5 in fp32 over these few steps. The first step's loss is before any update, from the same weights:
it differs by those sums alone, rel 1e-6.
"""

import contextlib
import dataclasses
import shutil

import pytest
import torch

from fastml.plan import Hardware, Knobs, Plan, Training
from fastml.executor.loop.train import train
from fastml.executor.parallel.tensor import TensorParallel
from emulated_fp8 import emulated_fp8
from small_model import EVAL_TOKENS, SMALL
from test_distributed import FP32, SEQ_LEN, SEQUENCES, ZERO, job, records, with_checkpoints

pytestmark = pytest.mark.slow

QWEN_LIKE = dataclasses.replace(SMALL, qkv_bias=True, qk_norm=True, tied_embeddings=True)
"""Every parameter a split rule covers: qkv bias, q/k norms over a rank's heads, an LM head tied to the embedding."""


def layout_plan(ranks: int, tensor: int, steps: int = 3, model=SMALL, **knobs) -> Plan:
    """The small model, SEQUENCES sequences a step in micro-batches of 2, over `ranks` CPU processes in tensor-parallel
    groups of `tensor`."""
    micro, data = 2, ranks // (tensor * knobs.get("pipeline_parallel", 1))
    return Plan(model=model, training=Training(seq_len=SEQ_LEN, global_batch_tokens=SEQ_LEN * SEQUENCES, steps=steps,
                                               eval_tokens=EVAL_TOKENS),
                hardware=Hardware(device="cpu", num_gpus=ranks, gpus_per_node=ranks),
                knobs=Knobs(micro_batch_size=micro, grad_accum_steps=SEQUENCES // (micro * data),
                            tensor_parallel=tensor, **{**FP32, **knobs}))


def alone(p: Plan) -> Plan:
    """The same steps in one process: every micro-batch of every data-parallel rank, one after another."""
    k = p.knobs
    knobs = {name: getattr(k, name) for name in ("recompute", "offload_weights", "offload_optimizer", "param_dtype",
                                                 "matmul_dtype", "cache_fp8_weights")}
    return layout_plan(1, 1, p.training.steps, p.model, **knobs)


def resumed_alone(tmp_path, checkpoint, p: Plan) -> list[dict]:
    """The records of one process resuming `checkpoint` (a step's directory) and taking the rest of `p`'s steps."""
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck / checkpoint.name)
    log = tmp_path / "resumed.jsonl"
    train(with_checkpoints(alone(p), ck), log_json=log, show_progress=False, resume=True)
    return records(log)


def assert_continues(got: list[dict], uninterrupted: list[dict]) -> None:
    """Steps 3 and 4, resumed from step 2's checkpoint, on the uninterrupted run's loss curve."""
    assert [r["step"] for r in got] == [3, 4]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in uninterrupted[2:]], rel=1e-5)


PLANS = {
    "tp2": layout_plan(2, 2),
    "tp2-sp": layout_plan(2, 2, sequence_parallel=True),
    "tp2-qwen": layout_plan(2, 2, model=QWEN_LIKE),
    "tp2-sp-qwen": layout_plan(2, 2, model=QWEN_LIKE, sequence_parallel=True),
    "tp2-sp-recompute": layout_plan(2, 2, sequence_parallel=True, recompute=("block",)),
    "tp2-streamed-cpu-step": layout_plan(2, 2, offload_weights=1.0, offload_optimizer=1.0),
    # fp8 matmuls, emulated on the CPU at unit scale (tests/emulated_fp8.py), the fused fp8 feed-forward layer sliced
    "tp2-sp-fp8": layout_plan(2, 2, model=QWEN_LIKE, sequence_parallel=True, param_dtype="bf16", matmul_dtype="fp8"),
    "tp2-fp8": layout_plan(2, 2, param_dtype="bf16", matmul_dtype="fp8"),
}
COMPILED = layout_plan(2, 2, sequence_parallel=True, compile=True)
FOUR_RANK_PLANS = {
    "tp2-dp2": layout_plan(4, 2),
    "tp2-dp2-zero3": layout_plan(4, 2, **ZERO[3]),
    "tp2-dp2-zero3-sp": layout_plan(4, 2, sequence_parallel=True, **ZERO[3]),
    "tp2-dp2-zero2-host-grads": layout_plan(4, 2, model=QWEN_LIKE, offload_gradients=1.0, **ZERO[2]),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every plan above, by its jobs (one of 2 ranks, one of 4), and checkpoints: a TP 2 run and a TP 2 x DP 2 ZeRO-2
    run saved at step 2 of 4."""
    path = tmp_path_factory.mktemp("tensor-parallel")
    saved = with_checkpoints(layout_plan(2, 2, steps=4, sequence_parallel=True), path / "ck-tp2")
    job(path, PLANS, ranks=2, more=[{"plan": saved, "log": path / "saved.jsonl"},
                                    {"plan": COMPILED, "log": path / "compiled.jsonl"}])
    saved_zero = with_checkpoints(layout_plan(4, 2, steps=4, sequence_parallel=True, **ZERO[2]), path / "ck-zero")
    job(path, FOUR_RANK_PLANS, ranks=4, more=[{"plan": saved_zero, "log": path / "saved-zero.jsonl"}])
    return path


@pytest.mark.parametrize("name", [*PLANS, *FOUR_RANK_PLANS])
def test_tensor_parallel_trains_as_one_process(tmp_path, trained, name):
    p = {**PLANS, **FOUR_RANK_PLANS}[name]
    assert_trains_as_one_process(records(trained / f"{name}.jsonl"), alone_records(tmp_path, p), p.knobs)


def alone_records(tmp_path, p: Plan) -> list[dict]:
    """The records of `alone(p)`, its fp8 matmuls emulated as the ranks' are (tests/run_plans.py)."""
    log = tmp_path / "alone.jsonl"
    with emulated_fp8(unit_scale=True) if p.knobs.matmul_dtype == "fp8" else contextlib.nullcontext():
        train(alone(p), log_json=log, show_progress=False)
    return records(log)


def assert_trains_as_one_process(got: list[dict], want: list[dict], knobs: Knobs) -> None:
    """The tolerances of the module's docstring in fp32. In bf16, one process adds its bf16 gradients' norms in bf16
    (a norm good to 2^-8), the ranks their squares in float32; the clip then scales the update by that much more or
    less, a loss by about 1e-5 (1e-4 allowed). A row-parallel linear's bf16 output is rounded twice (each rank's
    partial product, then their sum) where one process rounds it once, by 2^-8 of an element at most and as often
    up as down: the first loss, a mean over every token, moved by under 1e-5 (2e-5 allowed). With fp8, an element
    that differs in its last bf16 bit rounds to the neighbouring fp8 value where it lies that close to a rounding
    boundary, about one in 2^5 of them, each then changing by 2^-3 of itself: the first loss under tensor
    parallelism moved by up to 4e-5 (1e-4 allowed), and after a step, where the two runs' weights differ in last
    bits too, the gradients drift apart by more, 2^-7 in norm over these steps."""
    bf16, fp8 = knobs.param_dtype == "bf16", knobs.matmul_dtype == "fp8"
    norm_rel, loss_rel = (2 ** -8, 1e-4) if bf16 else (1e-5, 1e-5)
    later_norm_rel = 2 ** -7 if fp8 else norm_rel
    first_loss_rel = (1e-4 if fp8 else 2e-5) if bf16 and knobs.tensor_parallel > 1 else 1e-6
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=first_loss_rel)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=loss_rel)
    assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=norm_rel)
    assert [r["grad_norm"] for r in got[1:]] == pytest.approx([r["grad_norm"] for r in want[1:]], rel=later_norm_rel)


def test_compiled_blocks_run_the_collectives_as_the_eager_ones_do(trained):
    """dynamo traces the blocks with their collectives inside (graph breaks allowed): the same training as eager."""
    eager, compiled = records(trained / "tp2-sp.jsonl"), records(trained / "compiled.jsonl")
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert [r["grad_norm"] for r in compiled] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-5)


def test_a_tensor_parallel_checkpoint_resumes_in_one_process_on_the_same_curve(tmp_path, trained):
    """The checkpoint holds whole tensors: one process resumes it at step 2 and takes the steps the TP 2 run took."""
    got = resumed_alone(tmp_path, trained / "ck-tp2" / "step-00000002", layout_plan(2, 2, steps=4))
    assert_continues(got, records(trained / "saved.jsonl"))


def test_a_tensor_parallel_zero_checkpoint_resumes_in_one_process_on_the_same_curve(tmp_path, trained):
    """Each rank of a TP 2 x DP 2 ZeRO-2 run writes its shard of its slices' optimizer state; read back whole, one
    process resumes at step 2 and takes the steps the four ranks took."""
    got = resumed_alone(tmp_path, trained / "ck-zero" / "step-00000002", layout_plan(4, 2, steps=4))
    assert_continues(got, records(trained / "saved-zero.jsonl"))


def test_one_process_checkpoint_resumes_at_tensor_parallel_2(tmp_path):
    """And the other way: a one-process run's checkpoint of step 2, resumed by a TP 2 job."""
    ck = tmp_path / "ck"
    whole = with_checkpoints(alone(layout_plan(2, 2, steps=4)), ck)
    train(whole, log_json=tmp_path / "whole.jsonl", show_progress=False)
    shutil.rmtree(ck / "step-00000004")
    split = with_checkpoints(layout_plan(2, 2, steps=4, sequence_parallel=True), ck)
    job(tmp_path, {}, ranks=2, more=[{"plan": split, "log": tmp_path / "split.jsonl", "resume": True}])
    assert_continues(records(tmp_path / "split.jsonl"), records(tmp_path / "whole.jsonl"))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_own_rows_of_every_part_of_a_fused_weight(rank):
    """Rank r's slice of qkv is its q heads, then its k heads, then its v heads; of gate_up its gate rows, then its up
    rows (a plain cut of the fused tensor would give one rank all of gate and the other all of up)."""
    s, tp = QWEN_LIKE, TensorParallel(QWEN_LIKE, 2, rank)
    q, kv, f = s.q_size // 2, s.kv_size // 2, s.ffn_hidden_size // 2
    qkv = torch.arange(s.q_size + 2 * s.kv_size, dtype=torch.float32)[:, None].expand(-1, 3)
    rows = [*range(rank * q, (rank + 1) * q), *(s.q_size + i for i in range(rank * kv, (rank + 1) * kv)),
            *(s.q_size + s.kv_size + i for i in range(rank * kv, (rank + 1) * kv))]
    assert tp.split("blocks.1.attn.qkv.weight", qkv)[:, 0].tolist() == rows
    assert tp.split("blocks.1.attn.qkv.bias", qkv[:, 0]).tolist() == rows
    gate_up = torch.arange(2 * s.ffn_hidden_size, dtype=torch.float32)[:, None]
    assert tp.split("blocks.0.ffn.gate_up.weight", gate_up)[:, 0].tolist() == \
        [*range(rank * f, (rank + 1) * f), *(s.ffn_hidden_size + i for i in range(rank * f, (rank + 1) * f))]
    down = torch.arange(s.ffn_hidden_size, dtype=torch.float32)[None, :]
    assert tp.split("blocks.0.ffn.down.weight", down)[0].tolist() == list(range(rank * f, (rank + 1) * f))
    norm = torch.ones(s.hidden_size)
    assert tp.split("blocks.0.attn_norm.weight", norm) is norm and tp.replicated("blocks.0.attn.q_norm.weight")
