"""The fused kernels (executor/model/fused.py): their references against autograd of the plain arithmetic, the ops'
gradients, the LM head's loss that makes its gradients in its forward pass (executor/model/loss.py) against autograd
of F.cross_entropy, and the Triton kernels against the references under Triton's interpreter, on the CPU
(tests/test_gpu_fused.py runs the kernels on a GPU)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastml.executor.model import fused
from fastml.executor.model.loss import LinearCrossEntropy, lm_loss_sum


def plain_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def test_the_references_are_swiglu_and_its_gradient():
    gate_up = torch.randn(3, 5, 2 * 24, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 5, 24, dtype=torch.float64)
    out = plain_swiglu(gate_up)
    (expected,) = torch.autograd.grad(out, gate_up, grad)
    torch.testing.assert_close(fused.swiglu_reference(gate_up), out)
    torch.testing.assert_close(fused.swiglu_backward_reference(grad, gate_up), expected)


def test_the_op_has_swiglus_gradients():
    gate_up = torch.randn(4, 2 * 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused.swiglu, (gate_up,))


def test_the_op_keeps_only_its_input():
    gate_up = torch.randn(4, 2 * 6, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused.swiglu(gate_up)
    assert [t.data_ptr() for t in saved] == [gate_up.data_ptr()]


def test_the_op_traces_into_one_compiled_graph():
    compiled = torch.compile(fused.swiglu, fullgraph=True)
    gate_up = torch.randn(8, 2 * 16, requires_grad=True)
    torch.testing.assert_close(compiled(gate_up), fused.swiglu_reference(gate_up))


def test_the_amax_ops_give_swiglus_results_and_their_maximum():
    gate_up = torch.randn(5, 2 * 24) * 4
    grad = torch.randn(5, 24)
    cases = [(fused.swiglu_amax(gate_up), fused.swiglu_reference(gate_up)),
             (fused.swiglu_backward_amax(grad, gate_up), fused.swiglu_backward_reference(grad, gate_up))]
    for (out, amax), want in cases:
        assert torch.equal(out, want)
        assert amax.dtype == torch.int32 and amax.view(torch.float32).max() == want.abs().max()
    gate_up[2, 30] = float("nan")  # an up value: SwiGLU's output is NaN there
    assert fused.swiglu_amax(gate_up)[1].view(torch.float32).isnan().all()


def test_the_cross_entropy_reference_is_the_loss_and_its_gradient():
    logits = torch.randn(7, 40, dtype=torch.float64, requires_grad=True) * 5
    targets = torch.randint(0, 40, (7,))
    expected = F.cross_entropy(logits, targets, reduction="none")
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    got = logits.detach().clone()
    torch.testing.assert_close(fused.cross_entropy_reference_(got, targets), expected.detach())
    torch.testing.assert_close(got, expected_grad)


def plain_loss_and_grads(hidden, weight, targets, scale):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")
    return loss.detach(), *torch.autograd.grad(loss * scale, (hidden, weight))


@pytest.mark.parametrize("chunks", [1, 3, 4, 37])
def test_the_lm_loss_has_the_plain_loss_and_gradients(chunks):
    """In float64, chunked or not, and (an uneven split) with 37 rows in 3 or 4 slices: the summed cross-entropy
    and, through a scale (a mean's, or the micro-batches'), the gradients of autograd on the plain head and loss."""
    hidden, weight = torch.randn(37, 16, dtype=torch.float64), torch.randn(53, 16, dtype=torch.float64)
    targets = torch.randint(0, 53, (37,))
    expected, expected_hidden, expected_weight = plain_loss_and_grads(hidden, weight, targets, 0.3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = lm_loss_sum(h, w, targets, chunks)
    (loss * 0.3).backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(h.grad, expected_hidden)
    torch.testing.assert_close(w.grad, expected_weight)
    with torch.no_grad():  # evaluation: the losses alone
        torch.testing.assert_close(lm_loss_sum(hidden, weight, targets, chunks), expected)


def test_the_lm_loss_adds_to_an_accumulated_gradient_and_to_a_tied_embeddings():
    """A later micro-batch (the weight's gradient already holds the earlier ones') with the head tied to the
    embedding, whose lookup makes the hidden states: autograd sums the head's gradient with the lookup's."""
    embedding, targets = torch.randn(11, 4, dtype=torch.float64), torch.randint(0, 11, (8,))
    tokens = torch.randint(0, 11, (8,))
    earlier = torch.randn(11, 4, dtype=torch.float64)
    grads = []
    for loss_of in (lambda w: F.cross_entropy(F.embedding(tokens, w) @ w.t(), targets, reduction="sum"),
                    lambda w: lm_loss_sum(F.embedding(tokens, w), w, targets, 3)):
        w = embedding.clone().requires_grad_()
        w.grad = earlier.clone()
        (loss_of(w) * 0.5).backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0])


def bf16_lm_loss_matches_float64(device: str, rows: int, hidden_size: int, vocab: int, chunks: int) -> None:
    """bf16 hidden states and head against autograd in float64 on the same bf16 logits (each slice's from the same
    GEMM as the loss makes them), peaked (the weight scaled so that the softmax is far from uniform): the loss within
    float32's sums; each gradient, by its norm, within 2**-8: about twice what the two bf16 roundings between (the
    logits' gradient's and the GEMM output's, 2**-9 relative at most, 2**-8/sqrt(12) on average each) make. Wrong
    probabilities by 1% already exceed it (about 2.3 times 2**-8 at these shapes on the CPU)."""
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device=device, generator=generator).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device=device, generator=generator) * 6 / hidden_size**0.5).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device=device, generator=generator)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = lm_loss_sum(h, w, targets, chunks)
    (loss / rows).backward()
    logits = torch.cat([h @ weight.t() for h in hidden.tensor_split(chunks)]).double().requires_grad_()
    expected = F.cross_entropy(logits, targets, reduction="sum")
    (grad_logits,) = torch.autograd.grad(expected / rows, logits)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=0)
    for got, want in ((h.grad, grad_logits @ weight.double()), (w.grad, grad_logits.t() @ hidden.double())):
        assert (got.double() - want).norm() <= 2**-8 * want.norm()


@pytest.mark.parametrize("chunks", [1, 4])
def test_the_lm_loss_in_bf16_matches_float64(chunks):
    bf16_lm_loss_matches_float64("cpu", rows=512, hidden_size=256, vocab=4000, chunks=chunks)


def test_the_lm_loss_makes_only_the_gradients_asked_for():
    hidden, weight = torch.randn(8, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
    targets = torch.randint(0, 11, (8,))
    _, expected_hidden, _ = plain_loss_and_grads(hidden, weight, targets, 1.0)
    h = hidden.clone().requires_grad_()
    lm_loss_sum(h, weight, targets, 2).backward()
    torch.testing.assert_close(h.grad, expected_hidden)
    assert weight.grad is None


def test_the_lm_loss_refuses_a_second_backward_pass():
    """Its backward pass scales the gradients it kept in place: a second one would scale them again."""
    h, w = torch.randn(8, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    loss = LinearCrossEntropy.apply(h, w, torch.randint(0, 11, (8,)), 2, None)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        loss.backward()


INTERPRETED = """
import torch
from fastml.executor.model import fused
from fastml.executor.model.loss import LinearCrossEntropy, lm_loss_sum
for dtype, tolerance in ((torch.bfloat16, {}), (torch.float32, dict(rtol=1e-5, atol=1e-6))):
    # rows of a partial block, of more than one block, one element
    for shape in [(3, 5, 2 * 1100), (7, 2 * 16), (1, 2)]:
        gate_up = torch.randn(shape, dtype=dtype) * 4
        grad = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype)
        torch.testing.assert_close(fused.launch_swiglu(gate_up), fused.swiglu_reference(gate_up), **tolerance)
        # a gradient that is not contiguous (the kernels take any layout)
        strided = grad.transpose(0, -1).contiguous().transpose(0, -1)
        torch.testing.assert_close(fused.launch_swiglu_backward(strided, gate_up),
                                   fused.swiglu_backward_reference(grad, gate_up), **tolerance)
        # the maxima's kernels: the same outputs, and maxima whose largest is that of |output|
        for (out, amax), plain in ((fused.launch_swiglu(gate_up, with_amax=True), fused.launch_swiglu(gate_up)),
                                   (fused.launch_swiglu_backward(grad, gate_up, with_amax=True),
                                    fused.launch_swiglu_backward(grad, gate_up))):
            assert torch.equal(out, plain)
            assert amax.max().view(torch.float32) == plain.abs().max().float()
# cross-entropy: rows of a partial block, of exactly one, of several, a one-word vocabulary
for dtype in (torch.bfloat16, torch.float32):
    for rows, vocab in [(5, 100), (3, fused.CROSS_ENTROPY_BLOCK), (2, 2 * fused.CROSS_ENTROPY_BLOCK + 7), (2, 1)]:
        logits = torch.randn(rows, vocab, dtype=dtype) * 4
        targets = torch.randint(0, vocab, (rows,))
        got, expected = logits.clone(), logits.clone()
        losses = fused.launch_cross_entropy_(got, targets)
        torch.testing.assert_close(losses, fused.cross_entropy_reference_(expected, targets), rtol=1e-5, atol=1e-5)
        # each gradient is the rounding of nearly the same float32 value: one bf16 step apart at most (|g| <= 1)
        torch.testing.assert_close(got, expected, **({"rtol": 0, "atol": 2**-8} if dtype == torch.bfloat16 else {}))
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)")
def test_the_triton_kernels_match_the_references_in_the_interpreter():
    """Triton's interpreter runs the kernels on the CPU (a process of its own: it is chosen when they are defined)."""
    done = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
