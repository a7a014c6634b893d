"""Pipeline parallelism on CPU processes over gloo: jobs of 2 ranks (PP 2 in each schedule, with a tied embedding,
with the optimizer stepping on the CPU, with block inputs in host memory) and of 4 (TP 2 x PP 2 with sequence
parallelism, PP 2 x DP 2 with ZeRO-2 and with ZeRO-3), each trained a few steps and compared with one process taking
every micro-batch; checkpoints resumed at another layout.

Tolerances: a pipeline stage computes what one process computes, in the same order, for the same micro-batches;
what differs is the order of sums: the gradient norm adds per-stage sums of squares (the one process adds every
parameter's at once), the tied embedding's two gradients are added after the fact, and with tensor or data
parallelism their sums differ as tests/test_tensor_parallel.py and tests/test_distributed.py say. So losses and
gradient norms agree to rel 1e-5 in fp32 over these few steps, the first step's loss (before any update) to 1e-6.
"""

import dataclasses
import shutil
from types import SimpleNamespace

import pytest
import torch

from fastml.executor.loop.train import train
from fastml.executor.parallel.pipeline import PipelineParallel
from fastml.executor.parallel.tensor import TensorParallel
from small_model import SMALL
from test_distributed import ZERO, job, records, with_checkpoints
from test_tensor_parallel import (alone, assert_continues, assert_trains_as_one_process, layout_plan, resumed_alone,
                                  alone_records)

pytestmark = pytest.mark.slow

DEEP = dataclasses.replace(SMALL, num_layers=4)
"""Four blocks: two stages of two, or (interleaved) four stages of one."""
DEEP_TIED = dataclasses.replace(DEEP, tied_embeddings=True, qkv_bias=True, qk_norm=True)
"""The embedding held by the first stage and, as the LM head, by the last."""


def pipeline_plan(ranks: int, tensor: int = 1, steps: int = 3, model=DEEP, **knobs):
    return layout_plan(ranks, tensor, steps, model, pipeline_parallel=2, **knobs)


def evaluated_every_step(p):
    """The validation loss after every step, not only the last: a step's passes then follow forward passes without
    gradients, which leave the head's gathered weights as they found them."""
    return dataclasses.replace(p, training=dataclasses.replace(p.training, eval_interval=1))


PLANS = {
    "pp2-1f1b": pipeline_plan(2),
    "pp2-gpipe": pipeline_plan(2, pipeline_schedule="gpipe"),
    "pp2-interleaved": pipeline_plan(2, pipeline_schedule="interleaved_1f1b", virtual_stages=2),
    "pp2-tied": pipeline_plan(2, model=DEEP_TIED),
    "pp2-cpu-step": pipeline_plan(2, offload_optimizer=1.0, recompute=("block",)),
    "pp2-host-grads": pipeline_plan(2, model=DEEP_TIED, offload_gradients=1.0),
    "pp2-interleaved-streamed": pipeline_plan(2, pipeline_schedule="interleaved_1f1b", virtual_stages=2,
                                              offload_weights=1.0, offload_optimizer=1.0),
    # bf16 weights whose fp32 masters stream in their place: the second stage's first parameter is fp32 between uses
    "pp2-bf16-streamed-masters": pipeline_plan(2, param_dtype="bf16", matmul_dtype="bf16", offload_weights=1.0,
                                               offload_optimizer=1.0, offload_master=1.0, offload_gradients=1.0,
                                               stream_masters=True),
    # zero bubble: the last stage puts off its first weights' pass; interleaved, with recompute and a CPU step
    "pp2-zero-bubble": pipeline_plan(2, model=DEEP_TIED, pipeline_schedule="zero_bubble"),
    "pp2-zero-bubble-interleaved": pipeline_plan(2, model=DEEP_TIED, pipeline_schedule="zero_bubble",
                                                 virtual_stages=2, recompute=("block",), offload_optimizer=1.0),
    # block inputs in host memory, several micro-batches' at once: every forward pass before the first backward
    # pass; with zero bubble and recompute, interleaved
    "pp2-gpipe-host-inputs": pipeline_plan(2, pipeline_schedule="gpipe", offload_residuals=1.0),
    "pp2-zero-bubble-host-inputs": pipeline_plan(2, model=DEEP_TIED, pipeline_schedule="zero_bubble", virtual_stages=2,
                                                 offload_residuals=1.0, recompute=("block",)),
    # fp8 matmuls (emulated on the CPU: tests/emulated_fp8.py), their weights cast once a step
    "pp2-fp8": pipeline_plan(2, model=DEEP_TIED, pipeline_schedule="interleaved_1f1b", virtual_stages=2,
                             param_dtype="bf16", matmul_dtype="fp8", cache_fp8_weights=True),
}
FOUR_RANK_PLANS = {
    "tp2-pp2-sp": pipeline_plan(4, tensor=2, sequence_parallel=True, model=DEEP_TIED),
    "pp2-dp2-zero2": pipeline_plan(4, pipeline_schedule="interleaved_1f1b", virtual_stages=2, **ZERO[2]),
    # one round of micro-batches: the first chunk's backward passes all come after the second's
    "pp2-dp2-interleaved-host-grads": pipeline_plan(4, pipeline_schedule="interleaved_1f1b", virtual_stages=2,
                                                    offload_gradients=1.0),
    "pp2-dp2-zero1-streamed": pipeline_plan(4, offload_weights=1.0, offload_optimizer=1.0, **ZERO[1]),
    # ZeRO-2 reduces each group's gradients in its weights' pass, once a micro-batch
    "pp2-dp2-zero-bubble-zero2": pipeline_plan(4, model=DEEP_TIED, pipeline_schedule="zero_bubble", **ZERO[2]),
    "tp2-pp2-sp-zero-bubble": pipeline_plan(4, tensor=2, sequence_parallel=True, model=DEEP_TIED,
                                            pipeline_schedule="zero_bubble", virtual_stages=2),
    # ZeRO-3: the last stage runs every micro-batch's head before the first backward pass, which reads the final
    # norm's gathered weight; interleaved, each block's gathered weights cached on the host once a step
    "pp2-dp2-zero3-gpipe": evaluated_every_step(pipeline_plan(4, model=DEEP_TIED, pipeline_schedule="gpipe",
                                                              **ZERO[3])),
    "pp2-dp2-zero3-interleaved-cached": pipeline_plan(4, model=DEEP_TIED, pipeline_schedule="interleaved_1f1b",
                                                      virtual_stages=2, cache_weights_on_host=True, **ZERO[3]),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every plan above, by its jobs (one of 2 ranks, one of 4), and checkpoints: a PP 2 run and PP 2 x DP 2 ZeRO-2
    and ZeRO-3 runs saved at step 2 of 4."""
    path = tmp_path_factory.mktemp("pipeline-parallel")
    saved = with_checkpoints(pipeline_plan(2, steps=4, model=DEEP_TIED), path / "ck-pp2")
    job(path, PLANS, ranks=2, more=[{"plan": saved, "log": path / "saved.jsonl"}])
    saved_zero = [{"plan": with_checkpoints(pipeline_plan(4, steps=4, model=DEEP_TIED, virtual_stages=2,
                                                          pipeline_schedule="interleaved_1f1b", **ZERO[stage]),
                                            path / f"ck-zero{stage}"), "log": path / f"saved-zero{stage}.jsonl"}
                  for stage in (2, 3)]
    job(path, FOUR_RANK_PLANS, ranks=4, more=saved_zero)
    return path


@pytest.mark.parametrize("name", [*PLANS, *FOUR_RANK_PLANS])
def test_pipeline_parallel_trains_as_one_process(tmp_path, trained, name):
    p = {**PLANS, **FOUR_RANK_PLANS}[name]
    got, want = records(trained / f"{name}.jsonl"), alone_records(tmp_path, p)
    assert_trains_as_one_process(got, want, p.knobs)
    loss_rel = 1e-4 if p.knobs.param_dtype == "bf16" else 1e-5
    assert got[-1]["val_loss"] == pytest.approx(want[-1]["val_loss"], rel=loss_rel)  # forward passes alone, pipelined


def test_a_pipeline_checkpoint_resumes_in_one_process_on_the_same_curve(tmp_path, trained):
    """The checkpoint holds every stage's whole tensors: one process resumes it at step 2 and takes the steps the
    PP 2 run took."""
    got = resumed_alone(tmp_path, trained / "ck-pp2" / "step-00000002", pipeline_plan(2, steps=4, model=DEEP_TIED))
    assert_continues(got, records(trained / "saved.jsonl"))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_pipeline_zero_checkpoint_resumes_in_one_process_on_the_same_curve(tmp_path, trained, stage):
    """Each rank of an interleaved PP 2 x DP 2 ZeRO-2 or ZeRO-3 run writes its shard of its stages' optimizer state
    (the tied embedding's by both stages), with ZeRO-3 its stages' weights gathered whole; one process reads them and
    takes the steps the four ranks took."""
    got = resumed_alone(tmp_path, trained / f"ck-zero{stage}" / "step-00000002",
                        pipeline_plan(4, steps=4, model=DEEP_TIED))
    assert_continues(got, records(trained / f"saved-zero{stage}.jsonl"))


def test_one_process_checkpoint_resumes_at_pipeline_parallel_2(tmp_path):
    """And the other way: a one-process run's checkpoint of step 2, resumed by an interleaved PP 2 job."""
    ck = tmp_path / "ck"
    whole = with_checkpoints(alone(pipeline_plan(2, steps=4, model=DEEP_TIED)), ck)
    train(whole, log_json=tmp_path / "whole.jsonl", show_progress=False)
    shutil.rmtree(ck / "step-00000004")
    split = with_checkpoints(pipeline_plan(2, steps=4, model=DEEP_TIED, pipeline_schedule="interleaved_1f1b",
                                           virtual_stages=2), ck)
    job(tmp_path, {}, ranks=2, more=[{"plan": split, "log": tmp_path / "split.jsonl", "resume": True}])
    assert_continues(records(tmp_path / "split.jsonl"), records(tmp_path / "whole.jsonl"))


def test_an_offload_fraction_is_whole_or_none_with_a_pipeline():
    """A fraction counts the model's blocks from the first: with two stages, 0.5 would be all of the first stage's
    blocks and none of the second's, where the planner prices half of each."""
    from fastml.config import UserError

    with pytest.raises(UserError, match=r"knobs\.offload_weights: 0\.5: a fraction counts the model's blocks"):
        pipeline_plan(2, offload_weights=0.5)
    assert pipeline_plan(2, offload_weights=1.0).knobs.offload_weights == 1.0


def test_each_pipeline_rank_holds_its_stages_blocks():
    """Interleaved: rank r holds stages r, r + 2; a stage's blocks are consecutive, and the ranks cover each once."""
    ranks = [PipelineParallel(6, 2, r, virtual=2, schedule="interleaved_1f1b") for r in range(2)]
    assert [list(ranks[0].blocks_of(s)) for s in range(4)] == [[0], [1, 2], [3, 4], [5]]
    assert ranks[0].held_blocks == {0, 3, 4} and ranks[1].held_blocks == {1, 2, 5}
    assert ranks[0].first and not ranks[0].last and ranks[1].last



class _Recorder:
    """torch.distributed's point-to-point calls, recorded: each directed link's messages in the order the sender
    starts them and in the order the receiver posts them."""

    def __init__(self):
        self.sent, self.posted = {}, {}

    def isend(self, tensor, dst, tag, group):
        self.sent.setdefault(group, []).append(tag)
        return _Done()

    def irecv(self, tensor, src, tag, group):
        self.posted.setdefault(group, []).append(tag)
        return _Done()


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        pass


@pytest.mark.parametrize("schedule, size, virtual", [("gpipe", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
                                                     ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2),
                                                     ("interleaved_1f1b", 3, 3), ("zero_bubble", 4, 1),
                                                     ("zero_bubble", 2, 2), ("zero_bubble", 3, 3)])
@pytest.mark.parametrize("micro_batches", [4, 8, 12])
def test_every_link_carries_its_messages_first_in_first_out_and_no_rank_waits_for_ever(monkeypatch, schedule, size,
                                                                                       virtual, micro_batches):
    """Each rank's passes run as the executor runs them, sends never waiting and a pass waiting for its input alone:
    every rank ends (no deadlock), and on every link the receiver posts the messages in the order the sender sends
    them, as NCCL, which ignores tags, matches them."""
    from fastml.executor.parallel import pipeline
    from fastml.layout import interleaved_rounds, pipeline_order

    if micro_batches % interleaved_rounds(size, micro_batches):
        pytest.skip("not whole rounds of interleaved 1F1B (the contract refuses it)")
    recorder = _Recorder()
    monkeypatch.setattr(pipeline, "dist", recorder)
    order = pipeline_order(schedule, size, micro_batches, virtual)
    ranks = [PipelineParallel(4 * size * virtual, size, r, virtual, schedule,
                              links={(way, peer): (r, peer) if way == "to" else (peer, r)
                                     for way in ("to", "from") for peer in range(size) if peer != r})
             for r in range(size)]
    model = SimpleNamespace(tp=TensorParallel(DEEP), spec=SimpleNamespace(hidden_size=1), dtype=torch.float32)
    links = [pipeline._Links(p, order, model, torch.zeros(1, 1, dtype=torch.long)) for p in ranks]
    for r in range(size):
        links[r].post([], order[r][0])
    done, sent = [0] * size, set()
    while any(done[r] < len(order[r]) for r in range(size)):
        ran = False
        for r in range(size):
            if done[r] == len(order[r]):
                continue
            action = order[r][done[r]]
            needed = pipeline._received_by(action, size * virtual)
            if needed is not None and needed not in sent:
                continue  # waits for its input
            if needed is not None:
                links[r].take(needed)
            key = pipeline._sent_by(action, size * virtual)
            sends = [(key, torch.zeros(1))] if key is not None else []
            sent.update(k for k, _ in sends)
            done[r] += 1
            links[r].post(sends, order[r][done[r]] if done[r] < len(order[r]) else None)
            ran = True
        assert ran, f"deadlock: ranks at passes {done} of {[len(o) for o in order]}"
    assert recorder.sent == recorder.posted
