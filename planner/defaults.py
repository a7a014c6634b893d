"""A plan with default knobs for the detected device: what `fastml plan` writes until the search exists."""

from __future__ import annotations

import torch

from fastml import hwprofiles
from fastml.config import check_range, fail
from fastml.plan import Hardware, Knobs, Plan, Training, with_overrides
from fastml.spec import resolve_model

TINY_SEQ_LEN = 256
DEFAULT_SEQ_LEN = 2048
SEQUENCES_PER_STEP = 16


def detect_hardware(device: str | None = None) -> Hardware:
    """The first CUDA GPU if there is one (or `device` says "cuda"), else the CPU."""
    if device not in (None, "cpu", "cuda"):
        fail("--device", f"{device!r} is not allowed; choose one of 'cpu', 'cuda'")
    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        return Hardware(profile="cpu", fingerprint=hwprofiles.fingerprint("cpu"), device="cpu")
    if not torch.cuda.is_available():
        fail("--device", "'cuda' was asked for, but this machine has no CUDA GPU")
    profile = hwprofiles.for_device_name(torch.cuda.get_device_name(0)) or ""
    return Hardware(profile=profile, fingerprint=hwprofiles.fingerprint(profile) if profile else "", device="cuda")


def make_plan(model: str = "tiny", seq_len: int | None = None, global_batch_tokens: int | None = None,
              steps: int = 100, data: str = "default", device: str | None = None,
              overrides: list[str] = ()) -> Plan:
    """The plan `fastml plan` writes: `model` a preset or HF directory; `device` "cpu" or "cuda" (default: a GPU if
    there is one); `overrides` are `SECTION.FIELD=VALUE` assignments applied last (a pinned micro_batch_size
    re-derives grad_accum_steps)."""
    spec = resolve_model(model)
    hardware = detect_hardware(device)
    seq_len = seq_len or (TINY_SEQ_LEN if spec.name == "tiny" else DEFAULT_SEQ_LEN)
    check_range("--seq", seq_len, 1)
    global_batch_tokens = global_batch_tokens or SEQUENCES_PER_STEP * seq_len
    num_sequences = _sequences(global_batch_tokens, seq_len)
    # On a CPU every sequence of the step goes into one micro-batch; on a GPU, without a memory model yet, one.
    micro_batch_size = num_sequences if hardware.device == "cpu" else 1
    pinned = [o for o in overrides if o.replace(" ", "").startswith("knobs.micro_batch_size=")]
    if pinned:
        micro_batch_size = int(pinned[-1].partition("=")[2])
        check_range("knobs.micro_batch_size", micro_batch_size, 1)
    if num_sequences % micro_batch_size:
        fail("knobs.micro_batch_size", f"{micro_batch_size} must divide the {num_sequences} sequences of a step")
    plan = Plan(
        model=spec, hardware=hardware,
        training=Training(seq_len=seq_len, global_batch_tokens=global_batch_tokens, steps=steps, data=data,
                          lr=1e-3 if spec.name == "tiny" else 3e-4, warmup_steps=min(10, steps)),
        knobs=Knobs(micro_batch_size=micro_batch_size, grad_accum_steps=num_sequences // micro_batch_size))
    return with_overrides(plan, [o for o in overrides if o not in pinned])


def _sequences(global_batch_tokens: int, seq_len: int) -> int:
    check_range("--global-batch-tokens", global_batch_tokens, 1)
    if global_batch_tokens % seq_len:
        fail("--global-batch-tokens", f"{global_batch_tokens} must be a multiple of the sequence length {seq_len}")
    return global_batch_tokens // seq_len
