"""On a CUDA GPU: the fused kernels (executor/model/fused.py) against their references, in compiled blocks, and the
LM head's loss that uses one (executor/model/loss.py)."""

import pytest
import torch

from fastml.executor.model import fused
from test_fused import bf16_lm_loss_matches_float64, plain_swiglu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")]

SHAPES = [(2, 2048, 2 * 5632), (8192, 2 * 14336), (3, 7, 2 * 1100), (1, 2)]
"""TinyLlama's and Llama-3.1-8B's, rows of a partial block, one element."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_swiglu_kernels_match_the_references(shape, dtype):
    tolerance = {} if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(shape, device="cuda", dtype=dtype) * 4
    grad = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=dtype)
    x = gate_up.clone().requires_grad_()
    out = fused.swiglu(x)
    (grad_x,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(out, fused.swiglu_reference(gate_up), **tolerance)
    torch.testing.assert_close(grad_x, fused.swiglu_backward_reference(grad, gate_up), **tolerance)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_amax_kernels_give_the_plain_outputs_and_their_maximum(shape):
    """One maximum for each program (row and block of columns), whose largest is that of |output|; a NaN output
    makes it NaN (its bits exceed every number's)."""
    gate_up = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 4
    grad = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda", dtype=torch.bfloat16)
    programs = gate_up.numel() // shape[-1] * -(-(shape[-1] // 2) // fused.BLOCK)
    for (out, amax), plain in ((fused.swiglu_amax(gate_up), fused.swiglu(gate_up)),
                               (fused.swiglu_backward_amax(grad, gate_up), fused.swiglu_backward(grad, gate_up))):
        assert torch.equal(out, plain)
        assert amax.shape == (programs,) and amax.max().view(torch.float32) == plain.abs().max().float()
    gate_up.view(-1, shape[-1])[-1, -1] = float("nan")  # the last up value: the last output is NaN
    assert fused.swiglu_amax(gate_up)[1].max().view(torch.float32).isnan()
    assert fused.swiglu_backward_amax(grad, gate_up)[1].max().view(torch.float32).isnan()


def test_a_compiled_swiglu_matches_the_plain_one_in_bf16():
    """Within bf16's rounding of the plain arithmetic's result, forward and backward, compiled into one graph."""
    gate_up = torch.randn(4096, 2 * 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(fused.swiglu, fullgraph=True)
    out = compiled(gate_up)
    (got,) = torch.autograd.grad(out, gate_up, grad)
    wide = gate_up.detach().double().requires_grad_()
    expected = plain_swiglu(wide)
    (expected_grad,) = torch.autograd.grad(expected, wide, grad.double())
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(got.double(), expected_grad, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, vocab", [(64, 128256), (256, 32000), (5, 151936), (3, 7)], ids=str)
def test_the_cross_entropy_kernel_matches_the_reference(rows, vocab, dtype):
    """Llama 3's, TinyLlama's and Qwen's vocabularies, and one under a block. The losses are float32 sums of up to
    2**17 terms in two orders; each gradient the rounding of nearly the same float32 value, so in bf16 one step
    apart at most (|g| <= 1)."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=dtype) * 4
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    got, expected = logits.clone(), logits.clone()
    losses = fused.cross_entropy_(got, targets)
    torch.testing.assert_close(losses, fused.cross_entropy_reference_(expected, targets), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, **({"rtol": 0, "atol": 2**-8} if dtype == torch.bfloat16 else {}))


def test_a_target_outside_the_vocabulary_gives_a_nan_loss():
    logits = torch.randn(2, 100, device="cuda", dtype=torch.bfloat16)
    losses = fused.cross_entropy_(logits, torch.tensor([3, 100], device="cuda"))
    assert losses[0].isfinite() and losses[1].isnan()


@pytest.mark.parametrize("chunks", [1, 4])
def test_the_lm_loss_matches_the_plain_loss_in_bf16(chunks):
    """test_fused's bf16 check on the GPU's kernel and GEMMs, at TinyLlama's vocabulary."""
    bf16_lm_loss_matches_float64("cuda", rows=4096, hidden_size=512, vocab=32000, chunks=chunks)
