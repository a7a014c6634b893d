"""Tensor and pipeline parallelism as the contract states them (fastml/layout.py), refusing by name what does not
compose, and as the planner prices them (planner/pipeline.py, planner/parallel.py)."""

import dataclasses
import math

import pytest

from fastml.config import UserError
from fastml.layout import Action, Layout, interleaved_rounds, pipeline_order, stage_layers
from fastml.plan import OFFLOAD_FRACTIONS, ZERO_STAGES, Hardware, Knobs, Plan, Training
from fastml.planner.costs import costs
from fastml.planner.hardware import load_machine
from fastml.planner.memory import block_input_bytes, layer_activation_bytes, weight_gradient_inputs_bytes
from fastml.planner.parallel import (first_block_waits, head_gradients_bytes, layout_memory, layout_simulation,
                                     layout_step, rank_layers, tensor_parallel_costs, view)
from fastml.planner.pipeline import run_pipeline
from fastml.planner.planner import DATA_PARALLEL_TRIALS, make_plan
from fastml.planner.search import Problem, _least_sharding, fits_in_memory, knob_space, layout_choices, make_knobs
from fastml.spec import PRESETS


def test_interleaved_order_is_torchs():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules.ScheduleInterleaved1F1B, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no ScheduleInterleaved1F1B._calculate_single_rank_operations to compare with")
    for p in (2, 3, 4):
        for m in range(1, 13):
            for v in (2, 3):
                rounds = interleaved_rounds(p, m)
                if m % rounds:
                    continue
                s = object.__new__(schedules.ScheduleInterleaved1F1B)  # its order alone, without a process group
                s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
                s.number_of_rounds, s.microbatches_per_round = rounds, m // rounds
                for rank, ours in enumerate(pipeline_order("interleaved_1f1b", p, m, v)):
                    theirs = [Action("F" if a.computation_type.name == "FORWARD" else "B", a.microbatch_index,
                                     a.stage_index)
                              for a in s._calculate_single_rank_operations(rank) if a is not None]
                    assert ours == theirs, (p, m, v, rank)


def test_zero_bubble_order_is_torchs():
    """ScheduleInterleavedZeroBubble's order, its input-gradient passes ("I") our backward passes, for one chunk a rank
    (ZB-H1) and several."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules.ScheduleInterleavedZeroBubble, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no ScheduleInterleavedZeroBubble._calculate_single_rank_operations to compare with")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for p in (2, 3, 4):
        for m in range(1, 13):
            for v in (1, 2, 3):
                rounds = interleaved_rounds(p, m)
                if m % rounds:
                    continue
                s = object.__new__(schedules.ScheduleInterleavedZeroBubble)  # its order alone, as above
                s.pp_group_size, s.n_local_stages, s._n_microbatches = p, v, m
                s.number_of_rounds, s.microbatches_per_round = rounds, m // rounds
                for rank, ours in enumerate(pipeline_order("zero_bubble", p, m, v)):
                    theirs = [Action(kinds[a.computation_type.name], a.microbatch_index, a.stage_index)
                              for a in s._calculate_single_rank_operations(rank) if a is not None]
                    assert ours == theirs, (p, m, v, rank)


def test_zero_bubble_fills_the_bubble_with_the_weights_passes():
    """ZB-H1 (Qi et al. 2024, section 3.1): with equal stages and free sends the bubble is (p - 1)(F + B - W), B the
    input-gradient pass, a third of 1F1B's where the three passes take as long; rank r keeps up to r + 1 micro-batches
    awaiting their weights' pass, 1F1B none."""
    f, b, w = 1.0, 1.0, 1.0
    one_f_one_b = run_pipeline("1f1b", 4, 8, 1, [f] * 4, [b + w] * 4, 0.0, [w] * 4)
    zero_bubble = run_pipeline("zero_bubble", 4, 8, 1, [f] * 4, [b + w] * 4, 0.0, [w] * 4)
    assert one_f_one_b.step_s == pytest.approx(8 * (f + b + w) + 3 * (f + b + w))
    assert zero_bubble.step_s == pytest.approx(8 * (f + b + w) + 3 * (f + b - w))
    assert zero_bubble.in_flight == one_f_one_b.in_flight == (4, 3, 2, 1)
    assert zero_bubble.awaiting_weights == (1, 2, 3, 4) and one_f_one_b.awaiting_weights == (0, 0, 0, 0)


def test_zero_bubble_keeps_the_linears_inputs_and_output_gradients_for_the_weights_pass():
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, pipeline_parallel=4, recompute=("block",))
    zero_bubble = dataclasses.replace(knobs, pipeline_schedule="zero_bubble")
    spec, _ = view(SPEC, knobs, H100S)
    output = 2048 * SPEC.hidden_size * 2
    per_micro_batch = spec.num_layers * layer_activation_bytes(spec, knobs, 2048, "cuda") + output
    # the last rank holds the most: one micro-batch in flight and four awaiting their weights' pass, where the first
    # rank of 1F1B holds four in flight
    most = max(per_micro_batch + 4 * spec.num_layers * weight_gradient_inputs_bytes(spec, knobs, 2048),
               4 * per_micro_batch)
    assert layout_memory(SPEC, 2048, zero_bubble, H100S).gpu_peak - layout_memory(SPEC, 2048, knobs, H100S).gpu_peak \
        == pytest.approx(most - 4 * per_micro_batch, abs=1)
    assert layout_step(SPEC, 2048, zero_bubble, H100S).bubble_s < layout_step(SPEC, 2048, knobs, H100S).bubble_s


def test_a_deferred_linear_makes_its_weight_gradient_in_a_pass_of_its_own():
    """Inside put_off its backward pass makes the input's gradient alone and keeps what the weight's and bias's need,
    which then come out as nn.Linear's backward pass makes them (and does outside put_off)."""
    torch = pytest.importorskip("torch")
    from fastml.executor.model import deferred

    plain = torch.nn.Linear(6, 4)
    linear = torch.nn.Linear(6, 4)
    linear.load_state_dict(plain.state_dict())
    linear.__class__ = deferred.DeferredLinear
    x, grad = torch.randn(2, 3, 6), torch.randn(2, 3, 4)
    x_plain, x_deferred = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(x_plain).backward(grad)
    with deferred.put_off() as kept:
        linear(x_deferred).backward(grad)
    assert linear.weight.grad is None and linear.bias.grad is None
    torch.testing.assert_close(x_deferred.grad, x_plain.grad)
    (one,) = kept
    made = dict(one.gradients())
    torch.testing.assert_close(made[linear.weight], plain.weight.grad)
    torch.testing.assert_close(made[linear.bias], plain.bias.grad)
    linear(x_deferred).backward(grad)  # outside put_off: an nn.Linear
    torch.testing.assert_close(linear.weight.grad, plain.weight.grad)


@pytest.mark.parametrize("p, m", [(1, 3), (2, 1), (4, 8), (4, 3), (3, 7)])
def test_1f1b_order_is_torchs_execution(p, m):
    """Schedule1F1B runs min(m, p - rank) forward passes, then a backward and a forward pass in turn, then the
    backward passes left (torch.distributed.pipelining's _step_microbatches)."""
    for rank, ours in enumerate(pipeline_order("1f1b", p, m)):
        warmup = min(m, p - rank)
        expected = [("F", j) for j in range(warmup)]
        for j in range(m - warmup):
            expected += [("B", j), ("F", warmup + j)]
        expected += [("B", j) for j in range(m - warmup, m)]
        assert [(a.kind, a.micro_batch) for a in ours] == expected
        assert {a.stage for a in ours} == {rank}


@pytest.mark.parametrize("schedule, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1),
                                               ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 4, 4)])
def test_equal_stages_and_free_sends_give_the_closed_form_bubble(schedule, p, m, v):
    """Narayanan et al. 2021, section 2.2: (p - 1) forward and backward passes of a stage, of a v-th of the blocks
    each when interleaved."""
    f, b = 1.0, 2.0
    run = run_pipeline(schedule, p, m, v, [f / v] * (p * v), [b / v] * (p * v), 0.0)
    assert run.busy_s == pytest.approx([m * (f + b)] * p)
    assert run.step_s == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


def test_1f1b_keeps_fewer_micro_batches_in_flight_than_gpipe():
    assert run_pipeline("gpipe", 4, 8, 1, [1.0] * 4, [2.0] * 4, 0.0).in_flight == (8, 8, 8, 8)
    assert run_pipeline("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4, 0.0).in_flight == (4, 3, 2, 1)
    assert run_pipeline("1f1b", 4, 2, 1, [1.0] * 4, [2.0] * 4, 0.0).in_flight == (2, 2, 2, 1)


def test_sends_and_uneven_stages_lengthen_the_step():
    even = run_pipeline("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4, 0.0).step_s
    assert run_pipeline("1f1b", 4, 8, 1, [1.0] * 4, [2.0] * 4, 0.1).step_s > even
    assert run_pipeline("1f1b", 4, 8, 1, [1.0, 1.0, 1.5, 1.0], [2.0, 2.0, 3.0, 2.0], 0.0).step_s > even


def test_stages_split_the_blocks():
    assert stage_layers(10, 4) == (2, 3, 3, 2)
    assert sum(stage_layers(80, 16)) == 80
    assert rank_layers(PRESETS["tiny"], Layout(tensor=1, pipeline=2, data=1, virtual=2)) == [2, 2]


H100S = load_machine("h100-sxm", 8, 2)
SPEC = PRESETS["llama-3.1-8b"]


def test_without_a_layout_the_view_is_the_plan_itself():
    assert view(SPEC, Knobs(), H100S) == (SPEC, H100S)


def test_the_view_is_a_slice_of_the_model_on_the_data_parallel_group():
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, tensor_parallel=4, pipeline_parallel=2)
    spec, machine = view(SPEC, knobs, H100S)
    assert (spec.num_heads, spec.num_kv_heads, spec.ffn_hidden_size, spec.vocab_size) == (8, 2, 3584, 32064)
    assert spec.num_layers == 16 and spec.hidden_size == SPEC.hidden_size
    assert machine.num_gpus == 2 and machine.gpus_per_node == 2
    assert machine.node.nic_bytes_per_s == pytest.approx(H100S.node.nic_bytes_per_s / 4)


def test_tensor_parallel_collectives():
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=8, tensor_parallel=4, recompute=("block",))
    tp = tensor_parallel_costs(SPEC, 2048, knobs, H100S)
    assert tp.forward == tp.backward == tp.recompute > 0 and tp.head > tp.forward / 2
    with_sp = tensor_parallel_costs(SPEC, 2048, dataclasses.replace(knobs, sequence_parallel=True), H100S)
    assert with_sp.forward == pytest.approx(tp.forward + 2 * H100S.collective_latency_s *  # a launch more each
                                            H100S.calibration.transfer)
    assert tensor_parallel_costs(SPEC, 2048, dataclasses.replace(knobs, tensor_parallel=1), H100S).forward == 0


def test_sequence_parallel_splits_the_activations():
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, tensor_parallel=4)
    split = dataclasses.replace(knobs, sequence_parallel=True)
    assert layer_activation_bytes(SPEC, split, 2048, "cuda") < layer_activation_bytes(SPEC, knobs, 2048, "cuda")
    block = dataclasses.replace(split, recompute=("block",))
    assert layer_activation_bytes(SPEC, block, 2048, "cuda") * 4 == \
        layer_activation_bytes(SPEC, dataclasses.replace(block, sequence_parallel=False, tensor_parallel=1), 2048,
                               "cuda")


def test_the_first_stage_holds_a_micro_batch_per_stage():
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, pipeline_parallel=4, recompute=("block",))
    spec, _ = view(SPEC, knobs, H100S)
    gpipe = layout_memory(SPEC, 2048, dataclasses.replace(knobs, pipeline_schedule="gpipe"), H100S)
    one_f_one_b = layout_memory(SPEC, 2048, knobs, H100S)
    output = 2048 * SPEC.hidden_size * 2  # a pass's output, bf16, kept for its backward pass
    per_micro_batch = spec.num_layers * layer_activation_bytes(spec, knobs, 2048, "cuda") + output
    last_stage = 7 * head_gradients_bytes(spec, knobs, 2048)  # GPipe's every loss before the first backward pass
    assert gpipe.gpu_peak - one_f_one_b.gpu_peak == pytest.approx((8 - 4) * per_micro_batch + last_stage, abs=1)


def plan_with(num_gpus: int = 4, **knobs) -> Plan:
    values = {"micro_batch_size": 1, "grad_accum_steps": 1} | knobs
    layout = values.get("tensor_parallel", 1) * values.get("pipeline_parallel", 1)
    return Plan(model=PRESETS["tiny"], hardware=Hardware(num_gpus=num_gpus, gpus_per_node=num_gpus),
                training=Training(seq_len=64, global_batch_tokens=64 * values["grad_accum_steps"] * num_gpus //
                                  layout), knobs=Knobs(**values))


@pytest.mark.parametrize("knobs, field", [
    ({"tensor_parallel": 3}, "knobs.tensor_parallel"),
    ({"tensor_parallel": 8}, "knobs.tensor_parallel"),
    ({"sequence_parallel": True}, "knobs.sequence_parallel"),
    ({"pipeline_parallel": 2, "virtual_stages": 2}, "knobs.virtual_stages"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"}, "knobs.pipeline_schedule"),
    ({"pipeline_parallel": 8}, "knobs.pipeline_parallel"),
    ({"tensor_parallel": 2, "comm": "memcpy"}, "knobs.comm"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "zero_bubble", "shard_optimizer": True, "shard_gradients": True,
      "shard_weights": True}, "knobs.shard_weights"),
    ({"pipeline_parallel": 2, "offload_residuals": 0.5}, "knobs.offload_residuals"),
    ({"pipeline_schedule": "zero_bubble"}, "knobs.pipeline_schedule"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "zero_bubble", "compile": True}, "knobs.compile"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "zero_bubble", "matmul_dtype": "fp8"}, "knobs.matmul_dtype"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "zero_bubble", "offload_weights": 1.0}, "knobs.offload_weights"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "zero_bubble", "offload_gradients": 1.0},
     "knobs.offload_gradients"),
])
def test_a_layout_that_cannot_be_laid_names_its_knob(knobs, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        plan_with(**knobs)


def test_the_batch_is_counted_over_the_data_parallel_ranks():
    plan = plan_with(tensor_parallel=2, pipeline_parallel=2, grad_accum_steps=4)
    assert plan.layout.data == 1 and plan.training.global_batch_tokens == 4 * 64
    with pytest.raises(UserError, match=r"training\.global_batch_tokens: .* 1 data-parallel ranks"):
        dataclasses.replace(plan, training=dataclasses.replace(plan.training, global_batch_tokens=4 * 64 * 4))


def test_a_pinned_layout_that_does_not_divide_the_model_is_refused_before_the_search():
    with pytest.raises(UserError, match=r"knobs\.tensor_parallel: 3 must divide the model's num_heads"):
        make_plan(model="llama-3.1-8b", hw="h100-sxm", gpus=8, overrides=("knobs.tensor_parallel=3",), trials=5)


def test_each_pipeline_pass_waits_for_its_first_blocks_gathered_weights():
    """With ZeRO-3 a block's weights are gathered while the block before it computes, and a pipeline pass's first
    block has none before it: each of a rank's passes, forward and backward, waits for one gather (the last stage's
    backward one hidden behind its head as far as the head lasts, but not under GPipe, where the next forward pass
    takes it), which the step counts as exposed communication; without sharded weights it waits for none."""
    zero2 = Knobs(micro_batch_size=1, grad_accum_steps=8, pipeline_parallel=2, shard_optimizer=True,
                  shard_gradients=True, recompute=("block",))
    zero3 = dataclasses.replace(zero2, shard_weights=True)
    spec, data_parallel = view(SPEC, zero3, H100S)
    c = costs(spec, 2048, zero3, data_parallel)
    gather, head = c.layer_weight_gather.comm_s, c.head_forward_backward
    assert first_block_waits(zero3, c, data_parallel.num_gpus, head) == \
        pytest.approx((gather, gather, gather - min(head, gather)))
    gpipe = dataclasses.replace(zero3, pipeline_schedule="gpipe")
    assert first_block_waits(gpipe, c, data_parallel.num_gpus, head) == pytest.approx((gather, gather, gather))
    assert layout_step(SPEC, 2048, zero2, H100S).first_block_waits_s == 0
    step = layout_step(SPEC, 2048, zero3, H100S)
    assert step.first_block_waits_s == pytest.approx(8 * 2 * gather) or \
        step.first_block_waits_s == pytest.approx(8 * (2 * gather - min(head, gather)))
    assert layout_simulation(SPEC, 2048, zero3, H100S).time_s["exposed_comm"] == \
        pytest.approx(step.view.time_s["exposed_comm"] + step.first_block_waits_s)


def test_a_pipelines_block_inputs_in_flight_go_to_the_host():
    """offload_residuals with a pipeline: each block input of the micro-batches a rank holds at once is in host memory
    (a buffer each in every GPU's process) instead of on the GPU. The first stage of four holds four micro-batches;
    at its peak, in a backward pass, the inputs of that pass's micro-batch are back on the GPU, the other three's
    not."""
    knobs = Knobs(micro_batch_size=1, grad_accum_steps=8, pipeline_parallel=4, recompute=("block",))
    on_gpu, on_host = (layout_memory(SPEC, 2048, dataclasses.replace(knobs, offload_residuals=f), H100S)
                       for f in (0.0, 1.0))
    spec, _ = view(SPEC, knobs, H100S)
    inputs = block_input_bytes(spec, knobs, 2048) * spec.num_layers  # a micro-batch's, of the stage's blocks
    assert on_gpu.gpu_peak - on_host.gpu_peak == pytest.approx(3 * inputs, rel=0.01)
    assert on_host.host["activations"] - on_gpu.host["activations"] == 4 * inputs * H100S.gpus_per_node


def test_a_pipeline_goes_with_zero_3_when_pinned():
    result = make_plan(model="llama-3.1-70b", hw="h100-sxm", gpus=8, nodes=4, trials=5,
                       overrides=("knobs.pipeline_parallel=2", "knobs.shard_weights=true"))
    knobs = result.plan.knobs
    assert knobs.pipeline_parallel == 2 and knobs.shard_weights


def test_a_pinned_zero_bubble_schedule_is_planned_with_the_knobs_it_goes_with():
    result = make_plan(model="llama-3.1-70b", hw="h100-sxm", gpus=8, nodes=16, global_batch_tokens=2**20, trials=10,
                       overrides=("knobs.pipeline_parallel=4", "knobs.pipeline_schedule=zero_bubble"))
    knobs = result.plan.knobs
    assert knobs.pipeline_schedule == "zero_bubble" and knobs.pipeline_parallel == 4
    assert not knobs.compile and knobs.offload_weights == knobs.offload_gradients == 0


def test_footholds_are_the_plans_at_the_edge_of_what_fits():
    """`_least_sharding` walks the edge of the plans that fit: for each recompute choice, the least ZeRO stage that
    fits, where it is less than the choice before needs. Checked against trying every stage of every choice."""
    problem = Problem(SPEC, 2048, 2**20, H100S, layouts=True)
    space = knob_space(problem, lower_precision=False)
    base = {n: c[0] for n, c in space.items()} | {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch_size": 8}
    expected, least_so_far = [], len(ZERO_STAGES) + 1
    for recompute in space["recompute"]:
        stages = [{n: i < stage for i, n in enumerate(ZERO_STAGES)} for stage in range(len(ZERO_STAGES) + 1)]
        fitting = [i for i, stage in enumerate(stages)
                   if fits_in_memory(problem, make_knobs(problem, base | stage | {"recompute": recompute}))]
        if fitting and fitting[0] < least_so_far:
            expected.append(base | stages[fitting[0]] | {"recompute": recompute})
            least_so_far = fitting[0]
    assert len(expected) >= 2  # a case with a walk to take
    assert _least_sharding(problem, space, base) == expected


def test_fp8_goes_with_a_layout_whose_slices_suit_it():
    """A drawn fp8 stays fp8 with tensor and pipeline parallelism, but not with a pinned zero bubble (fp8 linears
    make their weight gradients in their own backward pass); a tensor-parallel size whose slices do not suit fp8
    GEMMs is neither offered to the search nor taken as a pin with fp8."""
    problem = Problem(SPEC, 8192, 2**20, load_machine("h100-sxm", 8, 16), layouts=True)
    drawn = {"matmul_dtype": "fp8", "tensor_parallel": 4, "pipeline_parallel": 4}
    assert make_knobs(problem, drawn).matmul_dtype == "fp8"
    assert make_knobs(problem, drawn | {"pipeline_schedule": "zero_bubble"}).matmul_dtype == "bf16"
    odd = dataclasses.replace(PRESETS["tiny"], ffn_hidden_size=176)  # halves of 88: not a multiple of 16
    assert layout_choices(dataclasses.replace(problem, spec=odd))["tensor_parallel"] == (1,)
    with pytest.raises(UserError, match=r"knobs\.tensor_parallel: 2 with fp8 matmuls, a rank's slices: .*down\.in 88"):
        make_plan(model="tiny", hw="h100-sxm", gpus=8, trials=5, overrides=(
            "model.ffn_hidden_size=176", 'knobs.matmul_dtype="fp8"', "knobs.tensor_parallel=2"))


def test_the_planner_weighs_layouts_for_other_hardware():
    """A 70B on 16 nodes of 8 H100s at a million tokens a step (8 sequences a GPU) is predicted faster with tensor and
    pipeline parallelism, and the plan says why; so is a 72B on 4 nodes, whose data-parallel plans need ZeRO-3; an 8B
    on one node stays data parallel."""
    big = make_plan(model="llama-3.1-70b", hw="h100-sxm", gpus=8, nodes=16, global_batch_tokens=2**20, trials=40)
    assert big.plan.knobs.tensor_parallel * big.plan.knobs.pipeline_parallel > 1
    assert any(note.startswith("layout tensor") and "data-parallel plan" in note for note in big.notes)
    qwen = make_plan(model="qwen2.5-72b", hw="h100-sxm", gpus=8, nodes=4, global_batch_tokens=2**20, trials=40)
    assert qwen.plan.knobs.tensor_parallel > 1 and qwen.plan.knobs.pipeline_parallel > 1
    small = make_plan(model="llama-3.1-8b", hw="h100-sxm", gpus=8, trials=40)
    assert small.plan.knobs.tensor_parallel == small.plan.knobs.pipeline_parallel == 1
    assert any(note.startswith("data parallel alone") for note in small.notes)


SMALL_DATA_PARALLEL_SPACE = ("knobs.compile=false", "knobs.recompute=[]", "knobs.lm_head_chunks=1", "knobs.comm=nccl",
                             "knobs.shard_weights=false", "knobs.shard_gradients=false",
                             *(f"knobs.{name}=0" for name in OFFLOAD_FRACTIONS))


@pytest.mark.parametrize("pins, trials", [((), 20), (SMALL_DATA_PARALLEL_SPACE, 100)])
def test_the_searches_report_their_trials_as_one_count(pins, trials):
    """Where layouts are weighed, a data-parallel search and a layouts search run one after the other
    (planner/planner.py `_search`): the progress counts their trials together, toward their sum, with the best so
    far never going down. With DATA_PARALLEL_TRIALS of the trials, or where those would enumerate its space (pinned
    down here to fewer plans than --trials), as many trials as it has plans."""
    reports = []
    make_plan(model="tiny", hw="h200", gpus=8, trials=trials, overrides=pins,
              on_trial=lambda *report: reports.append(report))
    total = reports[-1][1]
    assert [(done, of) for done, of, _ in reports] == [(done, total) for done in range(1, total + 1)]
    data_parallel_trials, share = total - trials, math.ceil(trials * DATA_PARALLEL_TRIALS)
    if pins:  # its whole space, more plans than its share of the trials
        assert share < data_parallel_trials < trials
    else:
        assert data_parallel_trials == share
    bests = [best for *_, best in reports]
    assert bests == sorted(bests) and bests[0] > 0
