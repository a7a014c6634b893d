"""torch.library.opcheck over every op fastml registers (torch.ops.fastml.*): its schema says which inputs it
writes, its fake kernel gives the real one's outputs under torch.compile's tracing (dynamic shapes too), and its
autograd is registered where it has one. The CPU kernels here; the CUDA kernels in the tests marked gpu."""

import pytest
import torch

from fastml.executor import native
from fastml.executor.model import fp8, fused



def on_gpu(test):
    """Marks a test of a CUDA kernel: run by benchmarks/gpu_check.py, skipped where there is no GPU."""
    no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
    return pytest.mark.gpu(no_gpu(test))


ADAMW_KINDS = [(torch.float32, torch.float32, torch.bfloat16, False), (torch.float32, torch.bfloat16, None, False),
               (torch.bfloat16, torch.bfloat16, None, False), (torch.bfloat16, torch.bfloat16, None, True)]
"""(master, moments, weight written, a compensation of the masters) of the steps the executor takes with the op."""


def adamw_arguments(device: str, master_dtype, state_dtype, out_dtype, compensated, n: int = 1000) -> tuple:
    gen = torch.Generator().manual_seed(0)
    tensors = (torch.randn(n, generator=gen).to(master_dtype), torch.zeros(n, dtype=state_dtype),
               torch.zeros(n, dtype=state_dtype), torch.randn(n, generator=gen).to(torch.bfloat16),
               torch.empty(n, dtype=out_dtype) if out_dtype else None)
    low = (torch.randn(n, generator=gen) * 1e-3).to(device=device, dtype=torch.bfloat16) if compensated else None
    return (*(t.to(device) if t is not None else None for t in tensors), 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, 0.5, 7, 0,
            low)


def all_succeed(report: dict) -> bool:
    return all(outcome == "SUCCESS" for outcome in report.values())


@pytest.mark.parametrize("kinds", ADAMW_KINDS)
def test_adamw_step_passes_opcheck_on_the_cpu(kinds):
    native.load()
    assert all_succeed(torch.library.opcheck(torch.ops.fastml.adamw_step_.default, adamw_arguments("cpu", *kinds)))


def test_the_fused_swiglu_ops_pass_opcheck_on_the_cpu():
    gate_up = torch.randn(4, 3, 16, dtype=torch.bfloat16, requires_grad=True)
    assert all_succeed(torch.library.opcheck(fused.swiglu, (gate_up,)))
    grad = torch.randn(4, 3, 8, dtype=torch.bfloat16)
    assert all_succeed(torch.library.opcheck(fused.swiglu_backward, (grad, gate_up.detach())))
    assert all_succeed(torch.library.opcheck(fused.swiglu_amax, (gate_up.detach(),)))
    assert all_succeed(torch.library.opcheck(fused.swiglu_backward_amax, (grad, gate_up.detach())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_cross_entropy_passes_opcheck_on_the_cpu(dtype):
    logits = torch.randn(6, 50, dtype=dtype)
    assert all_succeed(torch.library.opcheck(fused.cross_entropy_, (logits, torch.randint(0, 50, (6,)))))


def test_host_barrier_declares_that_it_writes_its_flags():
    """One rank meets itself at the barrier. Only the schema is checked: a barrier is never traced (it waits on
    other processes), so it has no fake kernel."""
    native.load()
    flags = torch.zeros(64, dtype=torch.int64)
    report = torch.library.opcheck(torch.ops.fastml.host_barrier.default, (flags, 0, 1, 1, 5.0),
                                   test_utils=("test_schema",))
    assert all_succeed(report)


@on_gpu
@pytest.mark.parametrize("kinds", ADAMW_KINDS)
@pytest.mark.parametrize("n", [1000, 1003])  # runs of 8 only, and a rest stepped one by one
def test_adamw_step_passes_opcheck_on_the_gpu(kinds, n):
    native.load_cuda()
    assert all_succeed(torch.library.opcheck(torch.ops.fastml.adamw_step_.default,
                                             adamw_arguments("cuda", *kinds, n=n)))


@on_gpu
@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("rowwise, transposed", [(True, False), (False, True), (True, True)])
def test_quantize_fp8_passes_opcheck(dtype, rowwise, transposed):
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("needs fp8 tensor cores (compute capability 8.9 or later)")
    native.load_cuda()
    x = torch.randn(192, 320, device="cuda", dtype=torch.bfloat16)
    assert all_succeed(torch.library.opcheck(torch.ops.fastml.quantize_fp8.default, (x, dtype, rowwise, transposed)))
    rows_amax = x.abs().float().amax(1).view(torch.int32)
    assert all_succeed(torch.library.opcheck(torch.ops.fastml.quantize_fp8.default,
                                             (x, dtype, rowwise, transposed, rows_amax)))


@on_gpu
def test_the_fused_swiglu_kernels_pass_opcheck():
    gate_up = torch.randn(4, 3, 2 * 1100, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert all_succeed(torch.library.opcheck(fused.swiglu, (gate_up,)))
    grad = torch.randn(4, 3, 1100, device="cuda", dtype=torch.bfloat16)
    assert all_succeed(torch.library.opcheck(fused.swiglu_backward, (grad, gate_up.detach())))
    assert all_succeed(torch.library.opcheck(fused.swiglu_amax, (gate_up.detach(),)))
    assert all_succeed(torch.library.opcheck(fused.swiglu_backward_amax, (grad, gate_up.detach())))


@on_gpu
@pytest.mark.parametrize("vocab", [32000, 50])
def test_the_fused_cross_entropy_kernel_passes_opcheck(vocab):
    logits = torch.randn(6, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (6,), device="cuda")
    assert all_succeed(torch.library.opcheck(fused.cross_entropy_, (logits, targets)))
