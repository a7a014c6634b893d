"""Is GPU training bit-for-bit repeatable? Runs the same small plan twice in one process, with flash attention
(the default) and with PyTorch's math attention, and compares the loss sequences. Writes
benchmarks/results/determinism-<gpu>.json.

    python benchmarks/determinism.py
"""

from __future__ import annotations

import json
from pathlib import Path

from record import gpu_tag, write_result
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastml.executor.loop.train import train
from fastml.plan import pinned
from fastml.planner.planner import make_plan


def losses(tag: str) -> list[float]:
    plan = make_plan(seq_len=512, global_batch_tokens=512 * 8, steps=8, gpus=1,
                     overrides=pinned(micro_batch_size=4)).plan
    log = Path(f"/tmp/determinism-{tag}.jsonl")
    train(plan, log_json=log, show_progress=False)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def main() -> None:
    rows = {}
    for backend in ("flash", "math"):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.MATH):
            a, b = losses(f"{backend}-a"), losses(f"{backend}-b")
        rows[backend] = {"identical": a == b, "first_difference_at_step": next(
            (i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None), "run_a": a, "run_b": b}
        print(backend, "identical" if a == b else f"differ from step {rows[backend]['first_difference_at_step']}")
    write_result(f"determinism-{gpu_tag()}.json", {"attention": rows})


if __name__ == "__main__":
    main()
