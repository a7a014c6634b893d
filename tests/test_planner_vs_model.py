"""The planner's counts against the executor's real model: matmul shapes, FLOPs (torch.utils.flop_counter), the
bytes autograd keeps for the backward pass (saved-tensor hooks), the loss's (tokens x vocab) tensors (a dispatch
trace) and parameter bytes (the state dict), for several presets and knob settings.

On CPU the model runs on the meta device or on fake tensors (shapes, dtypes and the CPU kernels' choices, no
memory), so an 8B block costs nothing. The GPU test at the end repeats the activation and loss counts with real
bf16 tensors on CUDA, where torch picks other kernels (fused rms_norm, flash attention).
"""

import dataclasses
import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from fastml.executor import native
from fastml.hwprofiles.host import op_counter
from fastml.executor.model.apply import apply_recompute
from fastml.executor.model.fp8 import MIN_CAPABILITY, convert_to_fp8
from fastml.executor.model import fused
from fastml.executor.model.loss import lm_loss_sum
from fastml.executor.model.transformer import Transformer, build_model, rotary_tables
from fastml.plan import KNOBS, Knobs
from fastml.planner.costs import (ATTENTION_BACKWARD_FACTOR, LM_HEAD_CHUNK_OPS, head_flops, layer_flops,
                                  layer_gemms)
from fastml.planner.memory import (activation_bytes, block_backward_workspace_bytes, forward_kept_bytes,
                                   layer_activation_bytes, loss_logit_bytes, loss_workspace_bytes, model_states,
                                   param_bytes, placement, rebuilt_activation_bytes, saved_bytes_per_token)
from fastml.spec import PRESETS

# tiny; Llama 3.2 (tied embeddings, GQA); Qwen2.5 (tied, qkv bias, 14 heads of 64); Qwen3 (qk-norm, head_dim 128
# with hidden 4096); Llama 3.1 8B.
MODELS = ["tiny", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-8b", "llama-3.1-8b"]
BATCH, SEQ = 2, 64
CPU_KNOBS = Knobs(param_dtype="fp32", matmul_dtype="fp32")
"""What a CPU run uses: fp32 parameters, which are their own masters, and fp32 activations."""
MATMULS = {"aten.mm", "aten.addmm"}
ATTENTION = {"aten.bmm"}  # SDPA's math path on the meta device: q·kᵀ and p·v as batched matmuls


def one_block(name: str) -> torch.nn.Module:
    return build_model(dataclasses.replace(PRESETS[name], num_layers=1)).blocks[0]


def block_inputs(spec, device="meta", dtype=torch.float32):
    x = torch.randn(BATCH, SEQ, spec.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rotary_tables(spec, SEQ, torch.device(device), dtype)
    return x, cos, sin


def counted(counter: FlopCounterMode, ops: set[str]) -> int:
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ops)


# ---------------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name", MODELS)
def test_gemm_shapes_are_the_models_linear_layers(name):
    spec = PRESETS[name]
    model = build_model(dataclasses.replace(spec, num_layers=1))
    block = model.blocks[0]
    linears = {"qkv": block.attn.qkv, "out": block.attn.out, "gate_up": block.ffn.gate_up, "down": block.ffn.down}
    assert spec.block_linear_shapes() == {n: tuple(m.weight.shape) for n, m in linears.items()}
    assert spec.lm_head_shape() == tuple(model.lm_head_weight.shape)
    assert sum(isinstance(m, torch.nn.Linear) for m in block.modules()) == len(linears)


# ---------------------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("name", MODELS)
def test_block_flops_are_what_costs_charges(name):
    """Matmuls exactly. Attention: the meta device runs SDPA's math path, which computes the whole s x s square
    (the counter's forward is twice the causal count the planner charges: flash attention skips the masked half)
    and a backward of twice its forward; the planner charges flash attention's backward, 2.5 times its forward,
    which is torch's own count for the flash kernels (and measured on a GPU in the test at the end)."""
    spec = PRESETS[name]
    block = one_block(name)
    x, cos, sin = block_inputs(spec)
    with FlopCounterMode(display=False) as forward:
        y = block(x, cos, sin)
    with FlopCounterMode(display=False) as backward:
        y.sum().backward()
    planned = layer_flops(spec, BATCH, SEQ)
    assert counted(forward, MATMULS) == planned["forward.gemm"]
    assert counted(backward, MATMULS) == planned["backward.gemm"]
    assert counted(forward, ATTENTION) == 2 * planned["forward.attention"]
    assert counted(backward, ATTENTION) == 2 * counted(forward, ATTENTION)
    assert set(map(str, forward.get_flop_counts()["Global"])) <= MATMULS | ATTENTION


def test_attention_backward_factor_is_torchs_count_for_flash_attention():
    q, kv = (BATCH, 32, SEQ, 128), (BATCH, 8, SEQ, 128)
    assert sdpa_backward_flop_count(q, q, kv, kv) / sdpa_flop_count(q, kv, kv) == ATTENTION_BACKWARD_FACTOR


def test_gemm_shapes_are_costs_shapes():
    spec = PRESETS["llama-3.1-8b"]
    assert layer_gemms(spec, 7) == {name: (7, n, k) for name, (n, k) in spec.block_linear_shapes().items()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_model_flops_match_the_planner_and_the_mfu_definition(name, num_chunks):
    """The whole model, loss included. `flops_per_token` (MFU) counts every matmul but the embedding's lookup,
    forward and backward (6·N_matmul), and causal attention at three times its forward; it leaves out norms,
    rotary embedding, SwiGLU and the softmax. The LM head, chunked or not, makes its three matmuls once."""
    spec = PRESETS[name]
    model = build_model(spec)
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ), device="meta")
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens, tokens, num_chunks).backward()
    num_tokens = BATCH * SEQ
    block = layer_flops(spec, BATCH, SEQ)
    planned = spec.num_layers * (block["forward.gemm"] + block["backward.gemm"]) + head_flops(spec, num_tokens)
    assert counted(counter, MATMULS) == planned
    causal_attention = counted(counter, ATTENTION) / 2
    assert counted(counter, MATMULS) + causal_attention == spec.flops_per_token(SEQ) * num_tokens


def test_each_chunk_of_the_lm_head_dispatches_the_ops_the_planner_prices():
    """The host's time of a chunked head grows by LM_HEAD_CHUNK_OPS a slice after the first (planner/costs.py
    `with_host_time`): the loss's forward and backward at 1, 4 and 8 chunks."""
    spec = dataclasses.replace(PRESETS["tiny"], num_layers=1)
    model = Transformer(spec)
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ))
    ops = {}
    for chunks in (1, 4, 8):
        with op_counter() as counter:
            model.loss(tokens, tokens, chunks).backward()
        ops[chunks] = counter.ops
    assert [ops[c] - ops[1] for c in (4, 8)] == [3 * LM_HEAD_CHUNK_OPS, 7 * LM_HEAD_CHUNK_OPS]


def test_a_gemm_of_few_tokens_takes_at_least_its_weights_read():
    """An LM head's chunk of a few tokens against a 128k-word vocabulary is bound by reading the weight, which the
    efficiency curve (in the geometric mean of M, N and K) does not see."""
    from fastml.planner.hardware import load_machine

    gpu = load_machine("h200", 1).gpu
    vocab, hidden = PRESETS["llama-3.1-8b"].vocab_size, PRESETS["llama-3.1-8b"].hidden_size
    assert gpu.gemm_seconds(16, vocab, hidden, "bf16") >= vocab * hidden * 2 / gpu.hbm_bytes_per_s


# ---------------------------------------------------------------------------------------------------- activations


def saved_bytes(forward, inputs, constants) -> dict:
    """Bytes autograd keeps between `forward(*inputs)` and its backward pass, by storage: every saved tensor goes
    through the outermost `saved_tensors_hooks`, each storage counted once (a view keeps its whole base), the
    `constants` left out (parameters, and the rotary tables: model-wide, shared by every block).

    Non-reentrant checkpointing (recompute) installs its own hooks around its region, so what the region's ops save
    never reaches ours: it is dropped and recomputed. What the checkpoint itself keeps, its inputs, it saves with
    `save_for_backward` before its hooks are installed, so ours see them; test_block_recompute_keeps_the_input
    proves it. Any tensor autograd keeps is one of these: there is no other way for a graph node to hold one."""
    skip = {StorageWeakRef(t.untyped_storage()) for t in constants}
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in skip:
            kept.setdefault(ref, (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(*inputs)
    out.float().sum().backward()  # the graph was complete: backward runs
    return kept


def block_saved_bytes(block, inputs) -> dict:
    x, cos, sin = inputs
    return saved_bytes(block, inputs, [*block.parameters(), cos, sin])


def fake_block(name: str, parts: tuple[str, ...]):
    """One block of `name` with `parts` recomputed, and its inputs, as fp32 fake tensors on the CPU."""
    spec = dataclasses.replace(PRESETS[name], num_layers=1)
    with torch.device("cpu"):
        model = Transformer(spec)
    apply_recompute(model, parts, compiled=False)
    return model.blocks[0], block_inputs(spec, "cpu")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("parts", KNOBS["recompute"].choices, ids=lambda p: "+".join(p) or "none")
def test_saved_activation_bytes_match_the_planner(name, parts):
    """fp32 on the CPU, as a CPU run trains (CPU_KNOBS), for each recompute choice the planner searches."""
    spec = PRESETS[name]
    with FakeTensorMode():
        block, inputs = fake_block(name, parts)
        kept = block_saved_bytes(block, inputs)
    knobs = dataclasses.replace(CPU_KNOBS, recompute=parts)
    measured = sum(num_bytes for num_bytes, _, _ in kept.values())
    assert measured == layer_activation_bytes(spec, knobs, BATCH * SEQ, device="cpu"), kept


def test_block_recompute_keeps_the_input():
    with FakeTensorMode():
        block, inputs = fake_block("tiny", ("block",))
        kept = block_saved_bytes(block, inputs)
        assert list(kept) == [StorageWeakRef(inputs[0].untyped_storage())]
    assert saved_bytes_per_token(PRESETS["tiny"], Knobs(recompute=("block",)), "cpu") == {
        "block.input": PRESETS["tiny"].hidden_size * 2}


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b", "qwen3-8b"])
def test_whole_model_activations_are_what_the_forward_pass_keeps(name):
    """The whole model's forward pass, loss included, fp32 on the CPU: the blocks and the head as `memory` counts
    them, the head weight's gradient that the loss makes in its forward pass and keeps (part of its workspace), and
    what the planner leaves out as too small to matter: the token ids (int64) and the rotary tables."""
    spec, knobs = PRESETS[name], dataclasses.replace(CPU_KNOBS, micro_batch_size=BATCH)
    with FakeTensorMode():
        with torch.device("cpu"):
            model = Transformer(spec)
        tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ))
        kept = saved_bytes(lambda t: model.loss(t, t), [tokens], list(model.parameters()))
    num_tokens = BATCH * SEQ
    weight_gradient = spec.vocab_size * spec.hidden_size * param_bytes(knobs)
    uncounted = 8 * num_tokens + 2 * SEQ * spec.head_dim * 4
    planned = forward_kept_bytes(spec, knobs, num_tokens, device="cpu")
    assert sum(n for n, _, _ in kept.values()) == planned + weight_gradient + uncounted


# ---------------------------------------------------------------------------------------------------- loss


class _NewTensors(TorchDispatchMode):
    """Dtypes of the (rows x cols) tensors that ops create, one per storage, in order."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.numel, self.seen, self.dtypes = rows * cols, set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.seen:
                    self.seen.add(ref)
                    self.dtypes.append(t.dtype)
        return out


BYTES_OF = {torch.float32: 4, torch.bfloat16: 2}


@pytest.mark.parametrize("knobs, dtype", [(Knobs(), torch.bfloat16), (CPU_KNOBS, torch.float32)])
@pytest.mark.parametrize("chunks", [1, 4])
def test_the_loss_makes_a_slice_of_logits_per_slice(knobs, dtype, chunks):
    """The (tokens x vocab) tensors the loss makes (a dispatch trace; its kernel works in place) are each slice's
    logits, in the activation dtype, as memory.loss_logit_bytes counts a GPU's (that one exists at a time, the GPU
    test of the loss's peak below checks); what it keeps for the backward pass is the two gradients it made, of the
    hidden states and of the head's weight."""
    spec = PRESETS["llama-3.2-1b"]
    rows = BATCH * SEQ
    hidden = torch.randn(rows, spec.hidden_size, device="meta", dtype=dtype, requires_grad=True)
    weight = torch.randn(spec.lm_head_shape(), device="meta", dtype=dtype, requires_grad=True)
    targets = torch.randint(0, spec.vocab_size, (rows,), device="meta")
    with _NewTensors(rows // chunks, spec.vocab_size) as trace:
        kept = saved_bytes(lambda h: lm_loss_sum(h, weight, targets, chunks), [hidden], [weight])
    assert [BYTES_OF[d] for d in trace.dtypes] == [loss_logit_bytes(knobs, "cuda")] * chunks
    assert sorted(shape for _, shape, _ in kept.values()) == sorted([hidden.shape, weight.shape])


@pytest.mark.parametrize("dtype, knobs", [(torch.float32, CPU_KNOBS), (torch.bfloat16, Knobs())])
def test_on_the_cpu_the_loss_works_in_the_planned_bytes(dtype, knobs):
    """The CPU's loss (fused.cross_entropy_reference_) makes no (tokens x vocab) tensor beside float32 logits, and
    one float32 copy of narrower ones."""
    rows, vocab = 16, 1000
    logits = torch.randn(rows, vocab, dtype=dtype)
    with _NewTensors(rows, vocab) as trace:
        trace.seen.add(StorageWeakRef(logits.untyped_storage()))  # the in-place ops' results are the logits
        fused.cross_entropy_reference_(logits, torch.randint(0, vocab, (rows,)))
    assert BYTES_OF[dtype] + sum(BYTES_OF[d] for d in trace.dtypes) == loss_logit_bytes(knobs, "cpu")


# ---------------------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("knobs, dtype", [(Knobs(), torch.bfloat16), (CPU_KNOBS, torch.float32)])
def test_parameter_bytes_follow_the_param_dtype(name, knobs, dtype):
    """Weights and gradients as the model holds them in that dtype; fp32 masters only for bf16 parameters."""
    spec = PRESETS[name]
    model = build_model(spec).to(dtype)
    state_bytes = sum(t.nbytes for t in model.state_dict().values())
    gpu, _ = model_states(spec, knobs, placement(spec, knobs), num_gpus=1)
    assert gpu["weights"] == gpu["gradients"] == state_bytes
    numel = sum(t.numel() for t in model.state_dict().values())
    assert gpu["master_weights"] == (4 * numel if dtype == torch.bfloat16 else 0)
    assert gpu["optimizer_states"] == 8 * numel


# ---------------------------------------------------------------------------------------------------- GPU


def cuda_block(name: str, parts: tuple[str, ...], matmul_dtype: str = "bf16"):
    spec = dataclasses.replace(PRESETS[name], num_layers=1)
    with torch.device("cuda"):
        model = Transformer(spec).to(torch.bfloat16)
    if matmul_dtype == "fp8":
        native.load_cuda()
        convert_to_fp8(model)
    apply_recompute(model, parts, compiled=False)
    return model.blocks[0], block_inputs(spec, "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real bf16 kernels)")
@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b", "qwen3-8b", "llama-2-7b"])
@pytest.mark.parametrize("parts", KNOBS["recompute"].choices, ids=lambda p: "+".join(p) or "none")
@pytest.mark.parametrize("matmul_dtype", ["bf16", "fp8"])
def test_on_cuda_saved_bytes_match_the_planner(name, parts, matmul_dtype):
    """bf16 on CUDA, as a GPU run trains: fused rms_norm, fused attention (cuDNN's on an H200 with torch 2.11).
    Measured there on 2026-11-30: equal to the planner's count but for 16 bytes, the attention kernel's random
    seed and offset (two int64 scalars). fp8 linears add four float32 inverse scales."""
    if matmul_dtype == "fp8" and torch.cuda.get_device_capability() < MIN_CAPABILITY:
        pytest.skip("needs fp8 tensor cores (compute capability 8.9 or later)")
    block, inputs = cuda_block(name, parts, matmul_dtype)
    kept = block_saved_bytes(block, inputs)
    planned = layer_activation_bytes(PRESETS[name], Knobs(recompute=parts, matmul_dtype=matmul_dtype), BATCH * SEQ,
                                     "cuda")
    assert sum(n for n, _, _ in kept.values()) == pytest.approx(planned, abs=64), kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real attention kernels)")
@pytest.mark.parametrize("parts", [(), ("attention",)], ids=["none", "attention"])
def test_on_cuda_attention_flops_match_the_planner(parts):
    """The fused attention kernels' FLOPs (full square, as the counter counts them: twice the causal count), with
    a backward 2.5 times the forward, and the forward once more when attention is recomputed. Multi-head
    attention (llama-2-7b): torch 2.11's counter rejects grouped-query shapes in the backward formula."""
    block, inputs = cuda_block("llama-2-7b", parts)
    with FlopCounterMode(display=False) as counter:
        block(*inputs).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = sum(n for op, n in counts.items() if "scaled_dot_product" in op)
    flops = layer_flops(PRESETS["llama-2-7b"], BATCH, SEQ)
    recomputed = flops["forward.attention"] if parts else 0
    assert attention / 2 == flops["forward.attention"] + flops["backward.attention"] + recomputed, counts


def settled_cuda_memory() -> int:
    """The GPU memory allocated now, the peak counter reset to it, once nothing is left to come in between: an
    earlier test's tensors freed (a failed test's frames hold them until collected) and cuBLAS's workspace made
    (at a process's first matmul, through the same allocator)."""
    gc.collect()
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    del a
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real allocator)")
@pytest.mark.parametrize("name, rows, chunks", [("llama-3.2-1b", 512, 1), ("llama-3.2-3b", 8192, 16),
                                                ("llama-3.2-1b", 16384, 16), ("llama-3.2-1b", 8192, 4)])
@pytest.mark.parametrize("accumulated", [False, True], ids=["first", "later"])
def test_on_cuda_the_loss_peaks_at_the_planned_workspace(name, rows, chunks, accumulated):
    """The loss's forward and backward pass, as in a step's first micro-batch and in a later one (a weight gradient
    already accumulated, which the new one is added to in place): the peak is its forward pass's, one slice's
    logits beside the two gradients it makes (memory.loss_workspace_bytes)."""
    spec = PRESETS[name]
    hidden = torch.randn(rows, spec.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(spec.lm_head_shape(), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if accumulated:
        weight.grad = torch.zeros_like(weight)
    targets = torch.randint(0, spec.vocab_size, (rows,), device="cuda")
    base = settled_cuda_memory()
    lm_loss_sum(hidden, weight, targets, chunks).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak == pytest.approx(loss_workspace_bytes(spec, Knobs(lm_head_chunks=chunks), rows), rel=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real allocator)")
@pytest.mark.parametrize("name, batch", [("qwen2.5-1.5b", 16), ("llama-3.2-1b", 8)])
@pytest.mark.parametrize("parts", [(), ("block",)], ids=["none", "block"])
def test_on_cuda_a_block_backward_makes_the_planned_workspace(name, batch, parts):
    """What a block's backward pass allocates beyond what its forward pass left (the gradient it receives is made
    before): its activations rebuilt where it recomputes, and the gradients it makes (weights' included, fresh as
    in a step's first micro-batch). Measured on an H200 (2026-12-03): within 6% (the norms' and attention's small
    gradients and workspaces, which the planner leaves out, and the ones it counts whole that are freed early)."""
    spec = dataclasses.replace(PRESETS[name], num_layers=1)
    seq = 2048
    with torch.device("cuda"):
        model = Transformer(spec).to(torch.bfloat16)
    apply_recompute(model, parts, compiled=False)
    x = torch.randn(batch, seq, spec.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary_tables(spec, seq, torch.device("cuda"), torch.bfloat16)
    received = torch.randn_like(x)
    y = model.blocks[0](x, cos, sin)
    before = settled_cuda_memory()
    y.backward(received)
    torch.cuda.synchronize()
    made = torch.cuda.max_memory_allocated() - before
    knobs, tokens = Knobs(recompute=parts), batch * seq
    planned = (rebuilt_activation_bytes(spec, knobs, tokens, "cuda") + block_backward_workspace_bytes(spec, knobs, tokens)
               - spec.hidden_size * activation_bytes(knobs) * tokens)
    assert made == pytest.approx(planned, rel=0.08)
