"""The fused kernels (executor/model/fused.py): their references against autograd of the plain arithmetic, the ops'
gradients, and the Triton kernels against the references under Triton's interpreter, on the CPU
(tests/test_gpu_fused.py runs the kernels on a GPU)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fastml.executor.model import fused


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


INTERPRETED = """
import torch
from fastml.executor.model import fused
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
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (pip install triton)")
def test_the_triton_kernels_match_the_references_in_the_interpreter():
    """Triton's interpreter runs the kernels on the CPU (a process of its own: it is chosen when they are defined)."""
    done = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
