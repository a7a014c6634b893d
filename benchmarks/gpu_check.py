"""The GPU check at every hand-over: every GPU test, then a short training smoke run, on the lent GPU.

Runs `pytest -m gpu` (the tests CI skips for want of a GPU) and a 30-step run of the plan `fastml plan` makes for
this machine, and writes benchmarks/results/gpu_check.json (on a machine of several GPUs gpu_check-<gpu>x<N>.json,
apart from the one-GPU check of the hand-over): the commit, machine and date, passed / failed / skipped
with the name of every test that did not pass, and the smoke run's steady tokens/s. Exits 1 when a test failed.

    GIT_COMMIT=<the commit> python benchmarks/gpu_check.py    # on the GPU machine: its copy of the tree has no
                                                               # trustworthy git history (benchmarks/record.py)

`--tests-only` skips the smoke run (about a minute: a plan that measures the GPU, then 30 steps), for a session left
with too little device time for both; the file then says so (`smoke_run` null).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from record import machine_tag, write_result

ROOT = Path(__file__).resolve().parent.parent
SMOKE_STEPS = 30


def run_gpu_tests(report: Path) -> dict:
    """pytest over the tests marked `gpu`, read back from its JUnit XML report."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
               f"--junitxml={report}", "tests"]
    completed = subprocess.run(command, cwd=ROOT)
    outcomes = {"passed": [], "failed": [], "skipped": []}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes["failed"].append(name)
        elif case.find("skipped") is not None:
            outcomes["skipped"].append(name)
        else:
            outcomes["passed"].append(name)
    return {"pytest_exit_code": completed.returncode, "passed": len(outcomes["passed"]),
            "failed": len(outcomes["failed"]), "skipped": len(outcomes["skipped"]),
            "failed_tests": outcomes["failed"], "skipped_tests": outcomes["skipped"],
            "passed_tests": outcomes["passed"]}


def smoke_run(workdir: Path) -> dict:
    """`fastml plan` for this machine, then `fastml run` of it, as a user would type them."""
    plan, log = workdir / "plan.json", workdir / "log.jsonl"
    fastml = [sys.executable, "-m", "fastml"]
    subprocess.run([*fastml, "plan", "-o", str(plan)], cwd=workdir, check=True)
    subprocess.run([*fastml, "run", str(plan), "--steps", str(SMOKE_STEPS), "--no-progress", "--log-json", str(log)],
                   cwd=workdir, check=True)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steady = sorted(r["tokens_per_s"] for r in records[1:])
    return {"plan": json.loads(plan.read_text())["knobs"], "steps": len(records),
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
            "tokens_per_s": steady[len(steady) // 2],
            "predicted_tokens_per_s": (json.loads(plan.read_text()).get("predicted") or {}).get("tokens_per_s")}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; run it on the lent GPU", file=sys.stderr)
        return 2
    tests_only = "--tests-only" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        tests = run_gpu_tests(Path(tmp) / "junit.xml")
        smoke = None if tests_only else smoke_run(Path(tmp))
    name = f"gpu_check-{machine_tag()}.json" if torch.cuda.device_count() > 1 else "gpu_check.json"
    path = write_result(name, {**tests, "smoke_run": smoke})
    ran = "no smoke run (--tests-only)" if smoke is None else f"smoke run {smoke['tokens_per_s']:,.0f} tokens/s"
    print(f"gpu_check: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped; {ran}; "
          f"wrote {path}")
    return 1 if tests["failed"] or tests["pytest_exit_code"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
