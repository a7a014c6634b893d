"""Offload changes where tensors live, not the math: each offload knob alone and all together give the losses of a
run without offload. On a CPU the "GPU" is the CPU and copies are plain ones, so this tests the bookkeeping (which
tensors move, when gradients are summed, which optimizer step runs where); tests/test_gpu.py runs the same on CUDA
streams."""

import dataclasses
import json
import time

import pytest
import torch

from fastml.plan import Knobs, Plan, Training, master_streamed_groups, offloaded_groups
from small_model import EVAL_TOKENS, SMALL
from fastml.executor.loop.build import build_training_model
from fastml.executor.storage.checkpoints import _load_model
from fastml.executor.memory.optim import AdamW
from fastml.executor.loop import train as train_module
from fastml.executor.loop.train import train

SAME_ARITHMETIC = ["offload_weights", "offload_gradients", "offload_residuals", "offload_master"]


def cpu_plan(steps=3, **knobs):
    """bf16 parameters with fp32 masters, as on a GPU, so that offload moves masters and bf16 copies around; three
    micro-batches a step, so that offloaded gradients are summed across them."""
    return Plan(model=SMALL, training=Training(seq_len=32, global_batch_tokens=32 * 6, steps=steps,
                                               eval_tokens=EVAL_TOKENS),
                knobs=Knobs(micro_batch_size=2, grad_accum_steps=3, **knobs))


def trained_losses(tmp_path, plan, name, **options):
    """The losses of `plan` trained (`train`'s `options`: steps, resume), logged to tmp_path / name."""
    train(plan, log_json=tmp_path / name, show_progress=False, **options)
    return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]


def run_losses(tmp_path, name, **knobs):
    return trained_losses(tmp_path, cpu_plan(**knobs), name)


def checkpointed_plan(tmp_path, name, **knobs):
    """A 6-step `cpu_plan` that checkpoints every 3 steps into tmp_path / name."""
    p = cpu_plan(steps=6, **knobs)
    training = dataclasses.replace(p.training, checkpoint_dir=str(tmp_path / name), checkpoint_interval=3)
    return dataclasses.replace(p, training=training)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_losses(tmp_path_factory.mktemp("ref"), "none.jsonl")


@pytest.mark.parametrize("knob", SAME_ARITHMETIC)
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_an_offload_knob_that_only_moves_tensors_changes_no_loss(tmp_path, reference, knob, fraction):
    assert run_losses(tmp_path, "offload.jsonl", **{knob: fraction}) == reference


def test_the_cpu_optimizer_step_matches_within_rounding(tmp_path, reference):
    """offload_optimizer steps on the CPU with the C++ AdamW: the same formula, in another order of operations."""
    losses = run_losses(tmp_path, "cpu_adam.jsonl", offload_optimizer=1.0)
    assert losses[0] == reference[0]  # the first loss comes before any step
    assert losses == pytest.approx(reference, rel=2e-3)


def test_every_knob_together_with_recompute(tmp_path):
    everything = {name: 1.0 for name in SAME_ARITHMETIC + ["offload_optimizer"]}
    plain = run_losses(tmp_path, "plain.jsonl", recompute=("block",), offload_optimizer=1.0)
    assert run_losses(tmp_path, "all.jsonl", recompute=("block",), **everything) == plain


def test_offloaded_tensors_live_in_host_buffers():
    plan = cpu_plan(offload_weights=0.5, offload_gradients=0.5, offload_master=1.0, offload_optimizer=1.0)
    model = build_training_model(plan, torch.device("cpu"))
    optimizer = AdamW(model, plan.training, plan.knobs, model.placement)
    streamed = offloaded_groups(plan.knobs, "offload_weights", plan.model.num_layers)
    assert streamed == {f"blocks.{i}" for i in range(plan.model.num_layers // 2)}
    for group in optimizer.param_groups:
        assert group["on_cpu"]  # the optimizer knob at 1.0 takes the embedding and head too
        for p in group["params"]:
            in_host_buffer = model.placement.offload.weights.views.get(model.placement.name_of[p])
            assert (in_host_buffer is not None) == (group["layer"] in streamed)
            if in_host_buffer is not None:
                assert p.data_ptr() == in_host_buffer.data_ptr()


def test_a_parameter_left_without_a_gradient_is_an_error_not_a_hang():
    """A group's gradients move (or, with several ranks, are reduced) once all its parameters have theirs: one
    without a gradient would leave the group unmoved, and the ranks' collectives out of step. It is said instead."""
    plan = cpu_plan(offload_gradients=1.0)
    model = build_training_model(plan, torch.device("cpu"))
    optimizer = AdamW(model, plan.training, plan.knobs, model.placement)
    model.blocks[0].ffn_norm.forward = lambda x: x  # its weight takes no part in the loss
    tokens = torch.randint(0, SMALL.vocab_size, (2, 33))
    model.placement.begin_micro_batch(0, last=True)
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    with pytest.raises(RuntimeError, match="blocks.0: 5 of its 6 parameters had a gradient in this backward pass"):
        optimizer.clip_grad_norm_(1.0)


@pytest.mark.parametrize("knobs", [
    dict(offload_optimizer=1.0),
    dict(offload_optimizer=0.5, offload_weights=0.5, offload_gradients=0.5),
    dict(offload_optimizer=1.0, offload_weights=1.0, offload_gradients=1.0, offload_master=1.0,
         offload_residuals=1.0, recompute=("block",)),
])
def test_the_overlapped_cpu_step_changes_no_loss(tmp_path, knobs):
    """knobs.overlap_cpu_step moves the CPU's step onto a worker thread, not its arithmetic: the same losses."""
    assert run_losses(tmp_path, "overlap.jsonl", overlap_cpu_step=True, **knobs) == \
        run_losses(tmp_path, "plain.jsonl", **knobs)


def test_the_next_forward_pass_waits_for_each_groups_step_and_no_more(monkeypatch, tmp_path):
    """With knobs.overlap_cpu_step a forward pass uses a group's weights only once the group's step is done, and
    the next step's forward pass starts before the whole step is done: the head's step, the last, is slowed, so
    that the embedding and the blocks are used before it ends if (and only if) each waits for its own step alone."""
    plan = cpu_plan(steps=3, offload_optimizer=1.0, offload_weights=0.5, offload_gradients=1.0,
                    overlap_cpu_step=True)
    events = []  # (what, group), appended by the main thread and by the worker
    stepped_in_background = AdamW._in_background

    def slow_head(self, layer, work, clipped):
        sent = stepped_in_background(self, layer, work, clipped)
        time.sleep(0.3 if layer == "head" else 0.02)
        events.append(("stepped", layer))
        return sent
    monkeypatch.setattr(AdamW, "_in_background", slow_head)
    build = train_module.build_training_model

    def build_and_watch(*args, **kwargs):
        model = build(*args, **kwargs)
        users = {"embed": model.embed, "head": model.norm, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)}}
        for group, module in users.items():
            module.register_forward_pre_hook(lambda module, inputs, group=group: events.append(("used", group)))
        return model
    monkeypatch.setattr(train_module, "build_training_model", build_and_watch)
    train(plan, log_json=tmp_path / "log.jsonl", show_progress=False)

    forward_passes = 0
    for i, (what, group) in enumerate(events):
        if what != "used":
            continue
        forward_passes += group == "embed"
        steps_taken = min((forward_passes - 1) // plan.knobs.grad_accum_steps, plan.training.steps)
        assert events[:i].count(("stepped", group)) >= steps_taken, (i, group)
    first_step_done = events.index(("stepped", "head"))
    assert ("used", "embed") in events[events.index(("stepped", "embed")):first_step_done]


def test_an_overlapped_run_checkpoints_and_resumes_as_the_uninterrupted_one(tmp_path):
    """Checkpoints wait for the CPU's step (run.save): a run stopped after 3 steps and resumed gives the losses of
    the run that went through, and both those of the same plan without the overlap."""
    def plan(name, **more):
        return checkpointed_plan(tmp_path, name, offload_optimizer=1.0, offload_weights=0.5, offload_gradients=1.0,
                                 **more)

    def losses(p, log, **options):
        return trained_losses(tmp_path, p, log, **options)
    whole = losses(plan("whole", overlap_cpu_step=True), "whole.jsonl")
    stopped = plan("stopped", overlap_cpu_step=True)
    assert losses(stopped, "stopped.jsonl", steps=3) == whole[:3]
    assert losses(stopped, "stopped.jsonl", resume=True) == whole
    assert losses(plan("plain"), "plain.jsonl") == whole


# Where knobs.stream_masters acts: blocks that step on the CPU with their masters and gradients on the host.
MASTERS_ON_HOST = dict(offload_optimizer=1.0, offload_master=1.0, offload_gradients=1.0)


@pytest.mark.parametrize("knobs", [dict(offload_weights=1.0, recompute=("block",), offload_residuals=1.0),
                                   dict(offload_weights=0.5, overlap_cpu_step=True)])
def test_streamed_masters_change_no_loss(tmp_path, knobs):
    """knobs.stream_masters: a streamed block's host copy is its fp32 master, rounded to bf16 as it is fetched, to
    nearest as the CPU step rounds it otherwise (torch's cast and csrc/adamw_math.h's): the same bits."""
    plain = run_losses(tmp_path, "plain.jsonl", **MASTERS_ON_HOST, **knobs)
    assert run_losses(tmp_path, "masters.jsonl", stream_masters=True, **MASTERS_ON_HOST, **knobs) == plain


def test_a_block_whose_masters_are_streamed_keeps_one_host_copy():
    """Its parameters point at their fp32 masters between uses, which are the optimizer's masters (no bf16 copy),
    and the step writes no rounded weights; the other streamed blocks keep theirs beside their masters."""
    plan = cpu_plan(stream_masters=True, **{**MASTERS_ON_HOST, "offload_optimizer": 0.5}, offload_weights=1.0)
    model = build_training_model(plan, torch.device("cpu"))
    optimizer = AdamW(model, plan.training, plan.knobs, model.placement)
    homes = master_streamed_groups(plan.knobs, plan.model.num_layers)
    assert homes == {f"blocks.{i}" for i in range(plan.model.num_layers // 2)}
    offload = model.placement.offload
    for group in optimizer.param_groups:
        for p in group["params"]:
            name, master = model.placement.name_of[p], optimizer.state[p].get("master")
            if group["layer"] in homes:
                assert p.dtype == torch.float32 and master.data_ptr() == p.data_ptr()
                # storage of its own: a checkpoint writes it without copying it first (files.compact)
                assert master.untyped_storage().nbytes() == master.numel() * master.element_size()
                assert name in offload.masters and name not in offload.weights.views
            elif group["layer"].startswith("blocks."):  # streamed, stepped by the device (the CPU in this test)
                assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
                assert p.data_ptr() == offload.weights.views[name].data_ptr()


def test_a_run_with_streamed_masters_resumes_as_the_uninterrupted_one_either_way(tmp_path):
    """Its checkpoints hold what any other plan's do (the weights rounded, the masters in the optimizer's state): a
    run stopped after 3 steps resumes with streamed masters or without, and gives the losses of the run that went
    through."""
    def plan(name, **more):
        return checkpointed_plan(tmp_path, name, offload_weights=1.0, **MASTERS_ON_HOST, **more)

    def losses(p, log, **options):
        return trained_losses(tmp_path, p, log, **options)
    whole = losses(plan("whole", stream_masters=True), "whole.jsonl")
    assert losses(plan("streamed", stream_masters=True), "a.jsonl", steps=3) == whole[:3]
    assert losses(plan("streamed"), "a.jsonl", resume=True) == whole
    assert losses(plan("plain"), "b.jsonl", steps=3) == whole[:3]
    assert losses(plan("plain", stream_masters=True), "b.jsonl", resume=True) == whole


def test_weights_loaded_into_streamed_masters_are_rounded_as_the_weights():
    """A run that starts from fp32 weights (an HF model, init_from) rounds them to the model's dtype wherever they
    go, fp32 masters included: the same start with streamed masters or without."""
    plan = cpu_plan(stream_masters=True, offload_weights=1.0, **MASTERS_ON_HOST)
    model = build_training_model(plan, torch.device("cpu"))
    source = {name: torch.randn(t.shape, generator=torch.Generator().manual_seed(i))
              for i, (name, t) in enumerate(model.state_dict().items())}
    _load_model(model, source.__getitem__)
    for name, t in model.state_dict().items():
        assert torch.equal(t, source[name].to(torch.bfloat16).to(t.dtype)), name


def test_block_inputs_in_flight_each_have_a_host_buffer_reused_once_back():
    """A pipeline stage holds several micro-batches' block inputs at once (under GPipe every forward pass comes before
    the first backward pass): each goes to a host buffer of its own, comes back whole, and the next step's inputs
    reuse those buffers."""
    from fastml.executor.memory.offload import HostOffload
    from fastml.executor.memory.streams import Copier

    cpu = torch.device("cpu")
    offload = HostOffload(cpu_plan(offload_residuals=1.0), {"blocks.0": {}}, cpu, Copier(cpu), torch.float32)
    first_buffers = None
    for step in range(2):
        inputs = [torch.full((2, 3), 10.0 * step + m) for m in range(3)]
        for m, x in enumerate(inputs):
            offload.residual_to_host("blocks.0", m, x)
        assert all(x.untyped_storage().nbytes() == 0 for x in inputs)  # gone from the "GPU"
        for m in reversed(range(3)):
            offload.fetch_residual("blocks.0", m)
            offload.wait_residual("blocks.0", m)
            assert torch.equal(inputs[m], torch.full((2, 3), 10.0 * step + m))
        buffers = {t.data_ptr() for t in offload.host_tensors()["activations"]}
        assert len(buffers) == 3 and buffers == (first_buffers or buffers)
        first_buffers = buffers
