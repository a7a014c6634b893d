"""The executor's model: parameter counts match the spec, recompute changes no math, chunked loss is exact."""

import pytest
import torch

from fastml.plan import Knobs, Plan, Training
from fastml.spec import PRESETS
from fastml.executor.loop.build import build_training_model
from fastml.executor.model.apply import apply_plan, apply_recompute
from fastml.executor.model.transformer import build_model, materialize
from fastml.config import UserError


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_analytic_parameter_count_equals_the_model(name):
    model = build_model(PRESETS[name])  # meta device: no memory
    assert sum(p.numel() for p in model.parameters()) == PRESETS[name].num_params()


def tiny_model(seed=0, **changes):
    import dataclasses
    spec = dataclasses.replace(PRESETS["tiny"], **changes)
    return materialize(build_model(spec), "cpu", torch.float32, seed=seed)


def grads_after_backward(model, tokens, chunks=1):
    model.zero_grad()
    loss = model.loss(tokens[:, :-1], tokens[:, 1:], chunks)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("parts", [("block",), ("norm", "qkv", "attention"), ("ffn",)])
def test_recompute_leaves_loss_and_gradients_bit_identical(parts):
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(1))
    base_loss, base_grads = grads_after_backward(tiny_model(qk_norm=True, qkv_bias=True), tokens)
    model = tiny_model(qk_norm=True, qkv_bias=True)
    apply_recompute(model, parts, compiled=False)
    loss, grads = grads_after_backward(model, tokens)
    assert torch.equal(loss, base_loss)
    for name in base_grads:
        assert torch.equal(grads[name], base_grads[name]), name


def test_chunked_lm_head_matches_whole():
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(2))
    model = tiny_model(tied_embeddings=True)
    loss1, grads1 = grads_after_backward(model, tokens, 1)
    loss4, grads4 = grads_after_backward(model, tokens, 4)
    torch.testing.assert_close(loss4, loss1, rtol=1e-6, atol=1e-6)
    for name in grads1:
        torch.testing.assert_close(grads4[name], grads1[name], rtol=1e-5, atol=1e-6)


def test_causal_outputs_do_not_see_the_future():
    model = tiny_model()
    tokens = torch.randint(0, 512, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 512
    a, b = model.logits(tokens), model.logits(changed)
    assert torch.equal(a[0, :20], b[0, :20])
    assert not torch.allclose(a[0, 20:], b[0, 20:])


def test_fp8_matmuls_on_a_cpu_are_refused_with_the_reason():
    plan = Plan(model=PRESETS["tiny"], training=Training(seq_len=32, global_batch_tokens=64),
                knobs=Knobs(micro_batch_size=2, matmul_dtype="fp8"))
    with pytest.raises(UserError, match="knobs.matmul_dtype: 'fp8' matmuls run on a GPU with fp8 tensor cores; "
                                        "this run is on cpu"):
        build_training_model(plan, torch.device("cpu"))


def test_fp8_matmul_shapes_that_cublas_cannot_take_are_refused_at_load():
    """The tiny preset's matmuls are multiples of 16; 24 tokens a micro-batch are not."""
    with pytest.raises(UserError, match="knobs.matmul_dtype: 'fp8' GEMMs need every matmul dimension a multiple of "
                                        "16, and tokens per micro-batch 24 is not: use 'bf16'"):
        Plan(model=PRESETS["tiny"], training=Training(seq_len=24, global_batch_tokens=24),
             knobs=Knobs(matmul_dtype="fp8"))


def saved_activation_bytes(model, tokens):
    """Bytes autograd keeps for the backward pass of one loss (recomputed parts keep only their inputs)."""
    sizes = []

    def keep(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = tiny_loss(model, tokens)
    loss.backward()
    return sum(sizes)


def tiny_loss(model, tokens):
    return model.loss(tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("parts", [("block",), ("ffn",)])
def test_recompute_survives_compile(parts):
    """Applied before compile (apply_plan's order), recompute still frees activations in the compiled blocks."""
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(3))
    saved = {}
    for recompute in ((), parts):
        model = build_model(PRESETS["tiny"])
        apply_recompute(model, recompute, compiled=True)
        for block in model.blocks:  # apply_compile's per-block compile, with a backend that needs no C++ compiler
            block.compile(backend="aot_eager")
        saved[recompute] = saved_activation_bytes(materialize(model, "cpu", torch.float32), tokens)
    assert saved[parts] < saved[()]


MODULE_COMPILE = torch.nn.Module.compile


def compiled_tiny_model(monkeypatch, graphs: list, **changes):
    """A tiny model whose blocks apply_compile compiled, with a backend that appends each graph it is given to
    `graphs` and runs it as traced (no C++ compiler needed)."""
    import dataclasses
    backend = lambda graph, inputs: graphs.append(graph) or graph.forward  # noqa: E731
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module: MODULE_COMPILE(module, backend=backend))
    model = apply_plan(build_model(dataclasses.replace(PRESETS["tiny"], **changes)), Knobs(compile=True))
    return materialize(model, "cpu", torch.float32)


def test_every_model_built_runs_its_blocks_compiled(monkeypatch):
    """The blocks of every model share one code object, whose graphs dynamo counts against one limit: a process
    that builds more models than that, each with blocks of other shapes (the GPU tests, a benchmark), still runs
    the last one's blocks compiled, not eager (apply_compile drops the graphs of models built before)."""
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False):  # as it was, after the test
        for i in range(torch._dynamo.config.recompile_limit + 1):
            graphs = []
            model = compiled_tiny_model(monkeypatch, graphs, ffn_hidden_size=PRESETS["tiny"].ffn_hidden_size + 8 * i)
            tiny_loss(model, tokens)
            assert graphs, f"model {i}: its blocks ran without a graph"


def test_blocks_past_the_recompile_limit_fail_instead_of_running_eager(monkeypatch):
    # each length its own graph, and one graph at most
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False,
                                    fail_on_recompile_limit_hit=False):
        model = compiled_tiny_model(monkeypatch, [])
        tiny_loss(model, torch.zeros(2, 17, dtype=torch.long))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            tiny_loss(model, torch.zeros(2, 33, dtype=torch.long))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_checkpoints_of_compiled_blocks_recompute_every_op(monkeypatch, compiled):
    """Blocks to be compiled get checkpoints with the policy that recomputes every op, which reaches into the fp8
    linears' autograd.Function (torch 2.11 saved their casts without it; tests/test_gpu_precision.py measures that on
    the real op); eager ones a plain checkpoint. Either way the gradients are the same."""
    from fastml.executor.model import apply

    policies = []
    checkpoint = apply.checkpoint
    monkeypatch.setattr(apply, "checkpoint", lambda fn, *args, **kwargs: policies.append("context_fn" in kwargs) or
                        checkpoint(fn, *args, **kwargs))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(2))
    base_loss, base_grads = grads_after_backward(tiny_model(), tokens)
    model = tiny_model()
    apply_recompute(model, ("block",), compiled=compiled)
    loss, grads = grads_after_backward(model, tokens)
    assert policies and set(policies) == {compiled}
    assert torch.equal(loss, base_loss) and all(torch.equal(grads[n], base_grads[n]) for n in base_grads)


class CountingLinear(torch.nn.Linear):
    """Stands for a module conversion (an fp8 linear): same weights, and it counts its forward passes."""

    calls = 0

    def forward(self, x):
        CountingLinear.calls += 1
        return super().forward(x)


def convert_qkv(model):
    for block in model.blocks:
        old = block.attn.qkv
        block.attn.qkv = CountingLinear(old.in_features, old.out_features, bias=old.bias is not None)
        block.attn.qkv.load_state_dict(old.state_dict())


@pytest.mark.parametrize("converted_first", [True, False])
def test_recompute_applies_to_modules_converted_before_it(converted_first):
    """Conversions come before recompute: recompute then reruns the converted module in the backward pass. The other
    way round, the conversion replaces the module recompute had wrapped and the recompute is silently lost."""
    model = tiny_model()
    steps = [convert_qkv, lambda m: apply_recompute(m, ("qkv",), compiled=False)]
    for apply in steps if converted_first else reversed(steps):
        apply(model)
    CountingLinear.calls = 0
    tiny_loss(model, torch.randint(0, 512, (2, 33))).backward()
    assert CountingLinear.calls == len(model.blocks) * (2 if converted_first else 1)


def test_a_change_of_class_after_recompute_is_caught():
    """A conversion by change of class after recompute would leave the recompute rerunning the old class's forward;
    the build checks that none did."""
    from fastml.executor.model.apply import check_recompute_intact

    model = tiny_model()
    apply_recompute(model, ("qkv",), compiled=False)
    check_recompute_intact(model)
    model.blocks[1].attn.qkv.__class__ = CountingLinear
    with pytest.raises(RuntimeError, match="blocks.1.attn.qkv became a CountingLinear after its recompute wrapped a "
                                           "Linear"):
        check_recompute_intact(model)
