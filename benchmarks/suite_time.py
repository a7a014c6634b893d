"""How long CI takes, as CI does it: a fresh clone of HEAD, `CI=true bash .ci/run` in it (a new virtual environment,
the install, then the README's test command), timed as a whole and the tests alone (pytest's own figure). Run it on
an idle machine of the kind CI uses (2 cores): the README's test command is meant to stay within 10 minutes there.
Writes benchmarks/results/suite_time.json.

    python benchmarks/suite_time.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import write_result

from fastml import hwprofiles

ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 600


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "fresh"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        start, load_before = time.perf_counter(), os.getloadavg()
        ci = subprocess.run(["bash", ".ci/run"], cwd=clone, env={**os.environ, "CI": "true"}, capture_output=True,
                            text=True)
        wall_s, load_after = time.perf_counter() - start, os.getloadavg()
    summary = ci.stdout.strip().splitlines()[-1] if ci.stdout.strip() else ""
    tests_s = re.search(r" in ([0-9.]+)s", summary)
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    figures = {"ci_exit_code": ci.returncode, "ci_wall_s": round(wall_s, 1),
               "tests_s": float(tests_s.group(1)) if tests_s else None, "pytest_summary": summary, **counts,
               "goal_tests_s": GOAL_S, "cpu": hwprofiles.cpu_model(), "cpus": len(os.sched_getaffinity(0)),
               "load_average_1_5_15_min": {"before": load_before, "after": load_after}}
    write_result("suite_time.json", figures)
    print(f"CI {'passed' if ci.returncode == 0 else 'FAILED'} in {wall_s:.0f} s; {summary}")
    if ci.returncode:
        print(ci.stdout[-3000:], ci.stderr[-3000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
