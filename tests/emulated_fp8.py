"""fp8 matmuls on a CPU: the cast by its float32 reference, the scaled GEMM as float32 products of the fp8 values.
What this checks is the bookkeeping around them (tests/test_gpu_precision.py runs the real ones): the fixture of
tests/test_precision.py, and every fp8 plan on a CPU that tests/run_plans.py trains (tensor and pipeline parallel
ranks, with `unit_scale`)."""

import contextlib
from unittest import mock

import torch


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


@contextlib.contextmanager
def emulated_fp8(unit_scale: bool = False):
    """Within it, fp8 plans train on a CPU; yields the fp8 module. `unit_scale`: every tensor is cast at scale 1, not
    scaled by its absolute maximum, so that a tensor-parallel rank's slice casts to what the same elements of the
    whole do in one process (by its own maximum it would not: tests/test_tensor_parallel.py compares the two)."""
    from fastml.executor.model import fp8

    def at_unit_scale(x, dtype, rowwise=True, transposed=False, partial_amax=None):
        largest = torch.tensor([fp8.FP8_MAX[dtype]], dtype=torch.float32, device=x.device).view(torch.int32)
        return fp8.quantize_reference(x, dtype, rowwise, transposed, partial_amax=largest)

    with (mock.patch.object(fp8, "quantize", at_unit_scale if unit_scale else fp8.quantize_reference),
          mock.patch.object(fp8, "check_fp8", lambda device: None),
          mock.patch.object(torch, "_scaled_mm", _scaled_mm)):
        yield fp8
