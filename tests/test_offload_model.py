"""The planner's model of offload against what the executor does with each offload knob: which parameter groups
move (fastml.plan.offloaded_groups), the bytes each puts on the GPU and the host (planner/memory.py), and the
copies and optimizer steps of the simulated step (planner/simulate.py)."""

import dataclasses

import pytest

from fastml.hwprofiles.schema import Calibration

from fastml.executor.model.transformer import build_model
from fastml.executor.memory.optim import layer_groups
from fastml.plan import STAGING_SLOTS, Knobs
from fastml.planner.costs import costs
from fastml.planner.hardware import load_machine
from fastml.planner.memory import (PROCESS_HOST_BYTES, STREAM_BUFFER_LAYERS, block_input_bytes, group_params,
                                   block_backward_workspace_bytes, forward_kept_bytes, layer_activation_bytes,
                                   loss_workspace_bytes, memory, model_states, placement, rebuilt_activation_bytes)
from fastml.planner.simulate import simulate
from fastml.spec import PRESETS

SEQ = 2048
ALL_OFFLOADED = dict(offload_optimizer=1.0, offload_master=1.0, offload_gradients=1.0, offload_weights=1.0,
                     offload_residuals=1.0)


def peak_phase_and_host(knobs: Knobs, model: str = "tinyllama-1.1b", seq_len: int = SEQ):
    m = memory(PRESETS[model], seq_len, knobs, num_gpus=1, gpus_per_node=1, device="cuda")
    return m.peak_phase, m.host


def sizes(model: str) -> tuple[int, int, int]:
    """Parameters of a block, of the embedding and of the head group (final norm and LM head)."""
    groups = group_params(PRESETS[model])
    return groups["blocks.0"], groups["embed"], groups["head"]


# ---------------------------------------------------------------------------------------------------- groups


@pytest.mark.parametrize("model", ["tinyllama-1.1b", "llama-3.2-1b", "qwen3-8b"])
def test_groups_are_the_executors_optimizer_groups(model):
    """Untied and tied LM heads, qk-norm: each group holds exactly the parameters of the executor's group."""
    real = {name: sum(p.numel() for _, p in named) for name, named in layer_groups(build_model(PRESETS[model])).items()}
    assert group_params(PRESETS[model]) == real


# ---------------------------------------------------------------------------------------------------- memory


def test_offloaded_gradients_are_one_host_copy_whatever_the_accumulation():
    """Gradients of offloaded blocks live on the host once (accumulated on the GPU, a block at a time). At the GPU's
    peak (with block recompute, the last block's backward pass) a step's first micro-batch has made the head's
    gradients alone (the embedding's come last, a block's own are its workspace); accumulating, every gradient on
    the GPU is there, with the sums so far of the block and of the one below fetched, where they are offloaded."""
    block, embed, head = sizes("tinyllama-1.1b")
    layers = PRESETS["tinyllama-1.1b"].num_layers
    knobs = Knobs(recompute=("block",), offload_gradients=1.0)
    for accumulation in (1, 8):
        _, host = peak_phase_and_host(dataclasses.replace(knobs, grad_accum_steps=accumulation))
        assert host["gradients"] == 2 * layers * block
    first, _ = peak_phase_and_host(knobs)
    assert first["gradients"] == 2 * head
    summed, _ = peak_phase_and_host(dataclasses.replace(knobs, grad_accum_steps=8))
    assert summed["gradients"] == 2 * (embed + head) + 2 * STREAM_BUFFER_LAYERS * block
    half_gpu, half_host = peak_phase_and_host(dataclasses.replace(knobs, grad_accum_steps=8, offload_gradients=0.5))
    assert half_host["gradients"] == 2 * 11 * block  # round(0.5 x 22): the first 11
    # the other 11 on the GPU; the peak is in the backward pass of one of the first 11, with two of their sums fetched
    assert half_gpu["gradients"] == 2 * (embed + head + 11 * block) + 2 * STREAM_BUFFER_LAYERS * block


@pytest.mark.parametrize("recompute", [(), ("block",)], ids=["none", "block"])
def test_residual_offload_moves_exactly_the_block_inputs(recompute):
    """Blocks x hidden x tokens x 2 bytes go to the host; the GPU keeps each block's other saved tensors. At the peak
    (accumulating, so that every gradient is there throughout: the loss, or the last block's backward pass) none of
    the offloaded inputs (the first blocks') is back yet."""
    spec, tokens = PRESETS["tinyllama-1.1b"], 8 * SEQ
    base = Knobs(micro_batch_size=8, grad_accum_steps=2, recompute=recompute)
    gpu, host = peak_phase_and_host(base)
    off_gpu, off_host = peak_phase_and_host(dataclasses.replace(base, offload_residuals=0.5))
    block_input = spec.hidden_size * tokens * 2
    assert block_input_bytes(spec, base, tokens) == block_input
    assert off_host["activations"] == 11 * block_input and host["activations"] == 0
    assert gpu["activations"] - off_gpu["activations"] == 11 * block_input
    if recompute:  # block recompute keeps nothing else: the block input is all a block saves
        assert layer_activation_bytes(spec, base, tokens, "cuda") == block_input


@pytest.mark.parametrize("knob, category, bytes_per_param", [
    ("offload_optimizer", "optimizer_states", 8), ("offload_master", "master_weights", 4)])
def test_embedding_and_head_follow_the_optimizer_and_masters_only_at_fraction_one(knob, category, bytes_per_param):
    block, embed, head = sizes("tinyllama-1.1b")
    partial_gpu, partial_host = peak_phase_and_host(Knobs(**{knob: 0.75}))
    assert partial_host[category] == bytes_per_param * 16 * block  # round(0.75 x 22) blocks
    assert partial_gpu[category] == bytes_per_param * (6 * block + embed + head)
    whole_gpu, whole_host = peak_phase_and_host(Knobs(**{knob: 1.0}))
    assert whole_gpu[category] == 0
    assert whole_host[category] == bytes_per_param * PRESETS["tinyllama-1.1b"].num_params()


def test_weights_and_gradients_of_the_embedding_and_head_stay_on_the_gpu():
    """Offloaded weights stream through the GPU a block at a time, the one computing and the one fetched beside it;
    the embedding's and the head's stay. So do their gradients (accumulating, so that all are there at the peak),
    beside the sums so far of the block and the one below."""
    block, embed, head = sizes("tinyllama-1.1b")
    gpu, host = peak_phase_and_host(Knobs(offload_weights=1.0))
    assert host["weights"] == 2 * 22 * block
    assert gpu["weights"] == 2 * (embed + head) + 2 * STREAM_BUFFER_LAYERS * block  # the streaming buffers
    gpu, host = peak_phase_and_host(Knobs(grad_accum_steps=2, recompute=("block",), offload_gradients=1.0))
    assert host["gradients"] == 2 * 22 * block
    assert gpu["gradients"] == 2 * (embed + head) + 2 * STREAM_BUFFER_LAYERS * block


def test_host_memory_is_the_offloaded_tensors_staging_and_the_process():
    """Everything offloaded: pinned bf16 weights and gradients of the blocks, fp32 masters and Adam m, v of every
    group, the block inputs, the staging of the largest group (the head's gradient down and new weights up, in
    STAGING_SLOTS buffers each) and the
    process itself."""
    spec = PRESETS["tinyllama-1.1b"]
    block, embed, head = sizes("tinyllama-1.1b")
    _, host = peak_phase_and_host(Knobs(recompute=("block",), **ALL_OFFLOADED))
    expected = {"weights": 2 * 22 * block, "gradients": 2 * 22 * block, "master_weights": 4 * spec.num_params(),
                "optimizer_states": 8 * spec.num_params(), "activations": 22 * spec.hidden_size * SEQ * 2,
                "workspace": PROCESS_HOST_BYTES + STAGING_SLOTS * (2 + 2) * max(embed, head),
                "comm_buffers": 0}
    assert host == expected


def test_streamed_masters_are_the_blocks_only_host_weights():
    """knobs.stream_masters with everything offloaded: each block's host copy is its fp32 master (4 bytes a
    parameter, counted as weights, as the executor's meter counts a tensor that is both), the 2 bytes of its bf16 copy
    gone; the GPU rounds one block's fetched masters at a time, from an fp32 staging buffer freed once they are
    rounded, before the block that fetched them rebuilds its activations: it sets the peak only where it is the
    larger (a short sequence)."""
    spec = PRESETS["tinyllama-1.1b"]
    block, embed, head = sizes("tinyllama-1.1b")
    knobs = Knobs(recompute=("block",), **ALL_OFFLOADED)
    gpu, host = peak_phase_and_host(knobs)
    streamed_gpu, streamed_host = peak_phase_and_host(dataclasses.replace(knobs, stream_masters=True))
    assert streamed_host["weights"] == 4 * 22 * block
    assert streamed_host["master_weights"] == 4 * (embed + head)
    assert sum(host.values()) - sum(streamed_host.values()) == 2 * spec.num_layers * block
    assert streamed_gpu == gpu  # the fetched blocks are bf16 on the GPU either way
    short, _ = peak_phase_and_host(knobs, seq_len=16)
    streamed_short, _ = peak_phase_and_host(dataclasses.replace(knobs, stream_masters=True), seq_len=16)
    rebuilt = rebuilt_activation_bytes(spec, knobs, 16, "cuda")
    assert streamed_short["workspace"] == 4 * block - rebuilt > short["workspace"]


def test_gpu_steps_of_host_masters_need_one_groups_workspace():
    """With the masters on the host and the optimizer on the GPU, a group's step fetches its master into fp32
    workspace beside its fp32 gradient: 8 bytes per parameter of the largest group, which at a short sequence sets
    the GPU's peak (the optimizer runs after the backward pass has freed the activations)."""
    block, embed, head = sizes("llama-3.1-8b")
    short = Knobs(recompute=("block",))
    gpu, _ = peak_phase_and_host(dataclasses.replace(short, offload_master=1.0), "llama-3.1-8b", seq_len=256)
    assert gpu["workspace"] == 8 * max(embed, head, block) and gpu["activations"] == 0
    resident, _ = peak_phase_and_host(short, "llama-3.1-8b", seq_len=256)
    assert resident["workspace"] == 4 * max(embed, head, block)  # the fp32 gradient copy alone
    cpu_steps, _ = peak_phase_and_host(dataclasses.replace(short, offload_master=1.0, offload_optimizer=1.0),
                                "llama-3.1-8b", seq_len=256)
    assert cpu_steps["workspace"] < resident["workspace"]  # no GPU step: the loss's workspace again


# ---------------------------------------------------------------------------------------------------- simulation


def simulated(**knobs):
    machine = dataclasses.replace(load_machine("h200", 1), calibration=Calibration())  # the model as it is
    k = Knobs(micro_batch_size=1, grad_accum_steps=3, recompute=("block",), **knobs)
    return simulate(PRESETS["tinyllama-1.1b"], SEQ, k, machine), costs(PRESETS["tinyllama-1.1b"], SEQ, k, machine)


def test_the_ranks_of_a_node_share_its_cpu_adamw():
    """The profile's rate is the node's, over all its cores; its ranks step their optimizers at once, each with its
    share of the cores (executor/loop/device.py), so each at a share of the rate."""
    spec, knobs = PRESETS["tinyllama-1.1b"], Knobs(offload_optimizer=1.0)
    one, four = (costs(spec, SEQ, knobs, load_machine("rtx4090", gpus)) for gpus in (1, 4))
    assert four.cpu_adam_per_param == pytest.approx(4 * one.cpu_adam_per_param)



def test_accumulated_gradients_come_back_before_each_later_backward_pass():
    sim, _ = simulated(offload_gradients=0.5)
    graph = sim.graph
    fetched = {n for n in graph if n.startswith("h2d grads")}
    assert fetched == {f"h2d grads L{layer} mb{m}" for layer in range(11) for m in (1, 2)}
    for layer in range(11):
        for m in (1, 2):
            fetch = f"h2d grads L{layer} mb{m}"
            assert graph.has_edge(f"d2h grads L{layer} mb{m - 1}", fetch)
            assert graph.has_edge(fetch, f"bwd L{layer} mb{m}")
            assert graph.nodes[fetch]["end"] <= graph.nodes[f"bwd L{layer} mb{m}"]["start"]
    assert not any(n.startswith("d2h grads L11 ") for n in graph)  # blocks past the fraction keep theirs


def test_the_cpu_optimizer_starts_after_the_last_backward_pass_and_clipping():
    sim, c = simulated(**ALL_OFFLOADED)
    graph = sim.graph
    spec = PRESETS["tinyllama-1.1b"]
    steps = [n for n in graph if n.startswith("cpu adam")]
    assert steps == [f"cpu adam {group}" for group in group_params(spec)]
    backward_end = max(d["end"] for n, d in graph.nodes(data=True) if n.startswith(("bwd", "d2h grads")))
    assert graph.nodes["clip gradients"]["start"] >= backward_end
    assert min(graph.nodes[n]["start"] for n in steps) >= graph.nodes["clip gradients"]["end"]
    cpu_seconds = sum(graph.nodes[n]["duration"] for n in steps)
    assert cpu_seconds == pytest.approx(spec.num_params() / load_machine("h200", 1).node.cpu_adam_params_per_s)
    assert sim.time_s["optimizer"] >= cpu_seconds  # the GPU waits for it (knobs.overlap_cpu_step is off)
    # Streamed blocks' new weights are written to their host copy; the embedding's and head's go up to the GPU.
    assert {n for n in graph if n.startswith("h2d updated")} == {"h2d updated embed", "h2d updated head"}


def test_streamed_weights_come_up_before_every_pass_one_block_ahead():
    sim, _ = simulated(offload_weights=1.0)
    graph = sim.graph
    for m in range(3):
        for tag, compute in (("fwd", "fwd"), ("bwd", "recompute")):
            for layer in range(22):
                fetch = f"h2d weights L{layer} mb{m} {tag}"
                assert graph.has_edge(fetch, f"{compute} L{layer} mb{m}")
    # Two buffers: block 5's forward copy waits for block 3's forward to be done with its buffer.
    assert graph.nodes["h2d weights L5 mb1 fwd"]["start"] >= graph.nodes["fwd L3 mb1"]["end"]
    # In the backward pass a buffer frees after the block's backward (block 5's after block 7's).
    assert graph.nodes["h2d weights L5 mb1 bwd"]["start"] >= graph.nodes["bwd L7 mb1"]["end"]


def test_streamed_masters_take_twice_the_weights_time_to_come_up():
    """knobs.stream_masters streams fp32 masters instead of bf16 weights: the same copies, of twice the bytes, on
    the blocks whose masters it streams (here the first half: the others step on the GPU)."""
    sim, c = simulated(stream_masters=True, offload_weights=1.0, offload_optimizer=0.5, offload_master=1.0,
                       offload_gradients=1.0)
    assert c.layer_masters_h2d == pytest.approx(2 * c.layer_weights_h2d)
    graph = sim.graph
    for layer in range(22):
        fetch = f"h2d {'masters' if layer < 11 else 'weights'} L{layer} mb0 fwd"
        assert graph.nodes[fetch]["duration"] == (c.layer_masters_h2d if layer < 11 else c.layer_weights_h2d)
        assert graph.has_edge(fetch, f"fwd L{layer} mb0")


def test_offloaded_inputs_leave_two_on_the_gpu():
    """With block recompute a block keeps only its input, and with every input offloaded at most
    STREAM_BUFFER_LAYERS are on the GPU at once, as memory() counts them."""
    sim, _ = simulated(offload_residuals=1.0)
    spec = PRESETS["tinyllama-1.1b"]
    assert sim.activation_peak_bytes == STREAM_BUFFER_LAYERS * block_input_bytes(spec, Knobs(), SEQ)
    graph = sim.graph
    assert graph.has_edge("fwd L4 mb0", "d2h input L4 mb0") and graph.has_edge("h2d input L4 mb0", "recompute L4 mb0")


def test_the_gpu_peaks_in_one_phase_of_the_step():
    """The 8B under a 24 GiB cap as the planner chose it on the H200 (benchmarks/fidelity.py's p-8b-s2048-24gib):
    every block streamed and stepped on the CPU, a quarter of the block inputs offloaded (the first 8 blocks').
    It peaks in the last block's backward pass, as the executor's schedule has it (measured with hooks on the
    H200, benchmarks/NOTES.md): the embedding's and head's weights, the block's and the next one's fetched, the head's
    gradients alone made, the 24 inputs kept and the block's rebuilt activations, and its backward workspace; not the
    fetched masters' staging (freed before the block rebuilds), nor buffers of gradients on their way to the host (a
    block makes its own in its workspace), nor the head's activations (gone once its backward pass is done).
    Counted all at once, these were 32% more than the 9.97 GiB measured."""
    spec, tokens = PRESETS["llama-3.1-8b"], 8 * SEQ
    knobs = Knobs(micro_batch_size=8, recompute=("block",), lm_head_chunks=4, stream_masters=True,
                  offload_residuals=0.25, **dict.fromkeys(("offload_optimizer", "offload_master", "offload_gradients",
                                                           "offload_weights"), 1.0))
    block, embed, head = sizes("llama-3.1-8b")
    gpu, _ = peak_phase_and_host(knobs, "llama-3.1-8b")
    assert gpu == {"weights": 2 * (embed + head) + 2 * 2 * block, "master_weights": 0, "gradients": 2 * head,
                   "optimizer_states": 0,
                   "activations": 24 * block_input_bytes(spec, knobs, tokens)
                   + rebuilt_activation_bytes(spec, knobs, tokens, "cuda"),
                   "workspace": block_backward_workspace_bytes(spec, knobs, tokens), "comm_buffers": 0}


def test_the_categories_are_those_the_run_measures():
    """The closing table sets each predicted category beside what the run's meter measures (executor/loop/meter.py),
    and the meter takes them at other moments than the peak: the model states once every gradient is made, the
    activations a micro-batch's forward pass leaves (the head weight's gradient, which the loss makes, among them),
    workspace the rest of the peak. TinyLlama at one micro-batch of 8 peaks at its loss, where none of its gradients
    is made yet but the head's, in the loss's workspace."""
    spec, knobs, tokens = PRESETS["tinyllama-1.1b"], Knobs(micro_batch_size=8), 8 * SEQ
    m = memory(spec, SEQ, knobs, num_gpus=1, gpus_per_node=1, device="cuda")
    states, _ = model_states(spec, knobs, placement(spec, knobs), 1)
    assert m.peak_phase["gradients"] == 0 < m.gpu["gradients"] == states["gradients"]
    assert m.peak_phase["workspace"] == loss_workspace_bytes(spec, knobs, tokens)  # the peak is at the loss
    head_weight_gradient = spec.vocab_size * spec.hidden_size * 2
    assert m.gpu["activations"] == forward_kept_bytes(spec, knobs, tokens, "cuda") + head_weight_gradient
    assert m.gpu_peak == sum(m.peak_phase.values())
    # Its gradients and its forward pass's activations are never alive together: they add up to more than the peak,
    # and the meter's workspace, the rest of the peak, is 0. Accumulating, the first micro-batch's gradients are.
    assert sum(m.gpu.values()) > m.gpu_peak and m.gpu["workspace"] == 0
    m = memory(spec, SEQ, Knobs(micro_batch_size=4, grad_accum_steps=2), num_gpus=1, gpus_per_node=1, device="cuda")
    assert sum(m.gpu.values()) == m.gpu_peak and m.gpu["workspace"] > 0
    # ZeRO-3 over 8 GPUs: the meter lists a rank's shards, not the head's weights gathered for a moment, a group's
    # gradients before their reduction, nor the collectives' buffers (it lists none): those are in the peak alone.
    knobs = Knobs(micro_batch_size=1, shard_optimizer=True, shard_gradients=True, shard_weights=True)
    m = memory(spec, SEQ, knobs, num_gpus=8, gpus_per_node=8, device="cuda")
    states, _ = model_states(spec, knobs, placement(spec, knobs), 8)
    assert [m.gpu[k] for k in ("weights", "gradients")] == [int(states[k]) for k in ("weights", "gradients")]
    assert m.peak_phase["weights"] > m.gpu["weights"] and m.gpu["comm_buffers"] == 0 < m.peak_phase["comm_buffers"]


def test_each_phase_holds_what_the_executor_holds_then():
    """The phases the peak is taken over, each set up to be the peak (executor/memory/placement.py's schedule)."""
    spec, (block, embed, head) = PRESETS["tinyllama-1.1b"], sizes("tinyllama-1.1b")
    # A block's backward pass with every input offloaded: its own input and the one below fetched.
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=2, recompute=("block",), offload_residuals=1.0,
                  lm_head_chunks=8)
    gpu, _ = peak_phase_and_host(knobs)
    tokens = 4 * SEQ
    assert gpu["activations"] == 2 * block_input_bytes(spec, knobs, tokens) + \
        rebuilt_activation_bytes(spec, knobs, tokens, "cuda")
    # The first block's backward pass, in a step's first micro-batch: every other block's gradients and the head's
    # are made, the embedding's and the block's own (its workspace) not yet.
    gpu, _ = peak_phase_and_host(Knobs(micro_batch_size=8, recompute=("block",)))
    assert gpu["gradients"] == 2 * (head + 21 * block)
    # fp8 matmuls with uncached weights: a block casts its weights to fp8 as it computes.
    knobs = Knobs(micro_batch_size=8, recompute=("block",), matmul_dtype="fp8", lm_head_chunks=8)
    gpu, _ = peak_phase_and_host(knobs)
    assert gpu["workspace"] == block_backward_workspace_bytes(spec, knobs, 8 * SEQ) + spec.layer_matmul_params()


def test_a_tied_heads_gradient_waits_for_the_embeddings():
    """Tied embeddings: autograd keeps the head's part of the weight's gradient until the embedding's part is made,
    then adds both into the gradient. Accumulating, it waits beside the sum so far through every block's backward
    pass (measured: Llama-3.2-1B under 6 GiB, mb 4 x 2, peaked one such gradient above the model without it), and the
    embedding's backward pass holds both parts beside the sum (at a short sequence, the peak)."""
    block, embed, norm = sizes("llama-3.2-1b")  # tied: the head's group is the final norm
    knobs = Knobs(micro_batch_size=4, grad_accum_steps=2, recompute=("block",), lm_head_chunks=4, **ALL_OFFLOADED)
    gpu, _ = peak_phase_and_host(knobs, "llama-3.2-1b", seq_len=4096)
    # the sum and the waiting part, the norm's, and two blocks' sums fetched
    assert gpu["gradients"] == 2 * (2 * embed + norm) + 2 * STREAM_BUFFER_LAYERS * block
    _, embed, norm = sizes("qwen2.5-0.5b")
    gpu, _ = peak_phase_and_host(Knobs(grad_accum_steps=2, **ALL_OFFLOADED), "qwen2.5-0.5b", seq_len=16)
    assert gpu["gradients"] == 2 * (3 * embed + norm) and gpu["activations"] == 0
