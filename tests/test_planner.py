"""The planner: memory model against the ZeRO paper and our model, feasibility, collective choice, search."""

import dataclasses
import json

import pytest

from fastml import hwprofiles
from fastml.plan import TIME_COMPONENTS, Knobs
from fastml.planner.hardware import load_machine, parse_bytes
from fastml.planner.costs import collective_s, costs
from fastml.planner.memory import layer_activation_bytes, memory, model_state_bytes
from fastml.planner.planner import NoFeasiblePlan, make_plan
from fastml.planner.search import Problem, evaluate, exhaustive, knob_space, pin, search, tokens_per_s
from fastml.planner.simulate import chrome_trace, simulate
from fastml.spec import PRESETS
from fastml.executor.model import build_model

GB = 1e9


@pytest.mark.parametrize("knobs, expected_gb", [
    (Knobs(), 120.0),
    (Knobs(shard_optimizer=True), 31.4),
    (Knobs(shard_optimizer=True, shard_gradients=True), 16.6),
    (Knobs(shard_optimizer=True, shard_gradients=True, shard_weights=True), 1.9),
])
def test_model_states_match_the_zero_paper(knobs, expected_gb):
    """ZeRO (Rajbhandari et al. 2020), figure 1: a 7.5B model with mixed-precision Adam over 64 GPUs."""
    total = sum(model_state_bytes(7.5e9, knobs, num_gpus=64).values())
    assert total / GB == pytest.approx(expected_gb, abs=0.05)


def test_model_states_count_our_models_real_parameters():
    spec = PRESETS["llama-3.1-8b"]
    real = sum(p.numel() for p in build_model(spec).parameters())
    assert sum(model_state_bytes(real, Knobs(), 1).values()) == 16 * real
    m = memory(spec, 2048, Knobs(), num_gpus=1, gpus_per_node=1)
    assert m.gpu["weights"] + m.gpu["gradients"] + m.gpu["master_weights"] + m.gpu["optimizer_states"] == 16 * real


def test_recompute_and_offload_move_memory_where_they_should():
    spec = PRESETS["tinyllama-1.1b"]
    act = {parts: layer_activation_bytes(spec, Knobs(recompute=parts), 2048) for parts in
           [(), ("swiglu",), ("attention",), ("ffn",), ("block",)]}
    assert act[("block",)] < act[("ffn",)] < act[("swiglu",)] < act[()]
    assert act[("attention",)] < act[()]
    assert act[("block",)] == 2048 * spec.hidden_size * 2
    base = memory(spec, 2048, Knobs(), 1, 1)
    off = memory(spec, 2048, Knobs(offload_optimizer=1.0, offload_master=1.0), 1, 1)
    assert off.gpu["optimizer_states"] == 0 and off.gpu["master_weights"] == 0
    assert off.host["optimizer_states"] == base.gpu["optimizer_states"]


@pytest.mark.parametrize("model, hw, kwargs", [
    ("llama-2-7b", "rtx5060ti-16gb", dict(seq_len=1024)),
    ("qwen2.5-32b", "rtx4090", dict(gpus=4, host_mem="512GiB")),
    ("llama-3.1-8b", "h200", dict(gpus=1)),
])
def test_headline_cases_are_feasible(model, hw, kwargs):
    """A plan is found (make_plan raises NoFeasiblePlan otherwise), and offload moves model states to the host
    without losing any: GPU and host shares add up to the whole (ZeRO's counts, checked in the tests above)."""
    planned = make_plan(model=model, hw=hw, trials=120, **kwargs)
    plan, p = planned.plan, planned.plan.predicted
    assert p.tokens_per_s > 0 and 0 < p.mfu < 1
    states = model_state_bytes(plan.model.num_params(), plan.knobs, plan.hardware.num_gpus)
    for category, total in states.items():
        on_host = p.host_memory_bytes[category] / plan.hardware.gpus_per_node
        assert p.memory_bytes[category] + on_host >= total - 2, category


def test_70b_on_one_4090_is_infeasible_with_a_clear_message():
    with pytest.raises(NoFeasiblePlan) as info:
        make_plan(model="llama-3.1-70b", hw="rtx4090", gpus=1, host_mem="64GiB", trials=60)
    message = str(info.value)
    assert "\n" not in message
    assert "host memory" in message and "--host-mem" in message and "more GPUs" in message


@pytest.mark.parametrize("hw, gpus, expected", [("rtx4090", 4, "memcpy"), ("h200", 2, "nccl")])
def test_collective_choice_follows_the_links(hw, gpus, expected):
    """Without P2P, host-routed copies beat NCCL's path through host memory; over NVLink NCCL wins."""
    problem = Problem(PRESETS["tinyllama-1.1b"], 2048, 2048 * 4 * gpus, load_machine(hw, gpus))
    speed = {}
    for comm in ("nccl", "memcpy"):
        knobs = Knobs(micro_batch_size=1, grad_accum_steps=4, recompute=("block",), shard_optimizer=True, comm=comm)
        candidate = evaluate(problem, knobs)
        assert candidate.feasible
        speed[comm] = tokens_per_s(problem, candidate)
    assert max(speed, key=speed.get) == expected
    planned = make_plan(model="tinyllama-1.1b", hw=hw, gpus=gpus, global_batch_tokens=2048 * 4 * gpus, trials=150)
    assert planned.plan.knobs.comm == expected


def test_search_finds_the_exhaustive_optimum():
    problem = Problem(PRESETS["tinyllama-1.1b"], 2048, 2048 * 16, load_machine("h200", 1))
    space = pin(knob_space(problem, runnable_only=True, lower_precision=False), {"compile": True})
    best = exhaustive(problem, space)[0]
    found = search(problem, space, num_trials=500)[0]  # small space: enumerated by the search itself
    assert found.knobs == best.knobs
    larger = knob_space(problem, runnable_only=False, lower_precision=False)
    tpe = search(problem, pin(larger, {"compile": True, "lm_head_chunks": 1}), num_trials=150)[0]
    assert tokens_per_s(problem, tpe) >= 0.95 * tokens_per_s(problem, best)


def test_simulation_adds_up_and_traces():
    spec = PRESETS["tinyllama-1.1b"]
    machine = load_machine("rtx4090", 4)
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=5, recompute=("block",), offload_optimizer=0.5,
                  offload_residuals=0.5, shard_gradients=True, comm="memcpy")
    sim = simulate(spec, 2048, knobs, machine)
    assert set(sim.time_s) == set(TIME_COMPONENTS)
    assert sim.time_s["exposed_comm"] >= 0 and sim.time_s["recompute"] > 0
    assert sim.critical_path and sim.critical_path[0].startswith("fwd L0")
    trace = json.loads(json.dumps(chrome_trace(sim)))
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"compute", "comm", "cpu", "h2d", "d2h"} <= tracks


def test_activation_timeline_peak_matches_the_analytic_model():
    spec = PRESETS["tinyllama-1.1b"]
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=2)
    sim = simulate(spec, 2048, knobs, load_machine("h200", 1))
    assert sim.activation_peak_bytes == spec.num_layers * layer_activation_bytes(spec, knobs, 4 * 2048)


def test_a_serial_step_is_the_sum_of_its_ops():
    """One GPU, nothing to overlap: the step is its ops one after another, so its time and breakdown follow from
    the op costs alone, here for more micro-batches than are simulated (the rest are extrapolated)."""
    spec = PRESETS["tinyllama-1.1b"]
    machine = load_machine("h200", 1)
    knobs = Knobs(micro_batch_size=2, grad_accum_steps=7, recompute=("block",))
    c, n, layers = costs(spec, 2048, knobs, machine), knobs.grad_accum_steps, spec.num_layers
    sim = simulate(spec, 2048, knobs, machine)
    per_micro_batch = layers * (c.layer_forward + c.layer_backward) + c.head_forward_backward
    compute = n * per_micro_batch + (n - 1) * c.grad_accumulate
    expected = {"compute": compute, "recompute": n * layers * c.layer_recompute, "optimizer": c.gpu_optimizer}
    assert sim.time_s == pytest.approx(dict.fromkeys(TIME_COMPONENTS, 0.0) | expected)
    assert sim.step_time_s == pytest.approx(sum(expected.values()))


def test_nccl_without_p2p_goes_through_host_memory():
    """Without P2P, NCCL stages every GPU's share in host memory: the rate is the node's PCIe share, whatever the
    profile's NCCL numbers say (DESIGN.md: two H200s with NCCL_P2P_DISABLE=1 train slower than one)."""
    nvlink = load_machine("h200", 2)
    no_p2p = dataclasses.replace(nvlink, gpu=dataclasses.replace(nvlink.gpu, p2p=False))
    moved = 2**30 / 2  # an all-gather of 1 GiB over 2 GPUs: each receives half
    latency = nvlink.collective_latency_s
    assert collective_s("all_gather", 2**30, nvlink, "nccl") == pytest.approx(
        latency + moved / nvlink.bus_bytes_per_s["all_gather"])
    assert collective_s("all_gather", 2**30, no_p2p, "nccl") == pytest.approx(
        latency + moved / min(no_p2p.h2d_bytes_per_s(), no_p2p.d2h_bytes_per_s()))


def test_every_shipped_profile_loads_and_cites_a_source():
    for name in hwprofiles.names():
        profile = hwprofiles.load(name)
        assert profile["source"]
        if name != "cpu":
            machine = load_machine(name)
            assert machine.gpu.peak_flops["bf16"] > 0 and machine.gpu.gemm_efficiency
            assert machine.usd_per_gpu_hour > 0 and profile["price"]["source"] and profile["price"]["date"]


def test_byte_sizes_parse():
    assert parse_bytes("16GiB", "x") == 16 * 2**30
    assert parse_bytes("24 GB", "x") == 24 * 10**9
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots", "--gpu-mem")
