"""One rank of a test job: trains each plan of a JSON spec in turn, so that one start of a job's processes serves
several comparisons (tests/test_distributed.py, tests/test_gpu_distributed.py).

    torchrun --standalone --nproc-per-node N tests/run_plans.py SPEC.json

SPEC is {"runs": [{"plan": PLAN, "log": FILE, "resume": false, "deterministic": false, "run_dir": null, "faults": ""},
...]}; rank 0 writes each run's JSON-lines log (and its record into "run_dir", where given). "deterministic" runs
attention through PyTorch's math kernels and torch's deterministic algorithms elsewhere, so that two runs of the same
sums on a GPU agree bit for bit. "faults" is FASTML_FAULTS for that run alone (executor/loop/faults.py). An fp8 plan
on a CPU runs its matmuls emulated at unit scale (tests/emulated_fp8.py).
"""

import contextlib
import json
import os
import sys

from fastml.plan import plan_from_dict
from fastml.executor.loop import faults
from fastml.executor.loop.train import train
from emulated_fp8 import emulated_fp8  # beside this file, on the path of a script run from here
from test_gpu import deterministic


@contextlib.contextmanager
def injected(spec: str):
    """FASTML_FAULTS=spec during one run; the faults are read once a process (cached), so the cache goes too."""
    os.environ[faults.ENV] = spec
    faults._planned.cache_clear()
    try:
        yield
    finally:
        del os.environ[faults.ENV]
        faults._planned.cache_clear()


for run in json.loads(open(sys.argv[1]).read())["runs"]:
    plan = plan_from_dict(run["plan"])
    on_cpu_in_fp8 = plan.hardware.device == "cpu" and plan.knobs.matmul_dtype == "fp8"
    with (deterministic() if run.get("deterministic") else contextlib.nullcontext(),
          injected(run["faults"]) if run.get("faults") else contextlib.nullcontext(),
          emulated_fp8(unit_scale=True) if on_cpu_in_fp8 else contextlib.nullcontext()):
        train(plan, log_json=run["log"], show_progress=False, resume=run.get("resume", False),
              timeout_s=run.get("timeout_s", 120), run_dir=run.get("run_dir"))
