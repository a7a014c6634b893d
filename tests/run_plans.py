"""One rank of a test job: trains each plan of a JSON spec in turn, so that one start of a job's processes serves
several comparisons (tests/test_distributed.py, tests/test_gpu_distributed.py).

    torchrun --standalone --nproc-per-node N tests/run_plans.py SPEC.json

SPEC is {"runs": [{"plan": PLAN, "log": FILE, "resume": false, "deterministic": false, "run_dir": null, "faults": ""},
...]}; rank 0 writes each run's JSON-lines log (and its record into "run_dir", where given). "deterministic" runs
attention through PyTorch's math kernels and torch's deterministic algorithms elsewhere, so that two runs of the same
sums on a GPU agree bit for bit. "faults" is FASTML_FAULTS for that run alone (executor/loop/faults.py).
"""

import contextlib
import json
import os
import sys

from fastml.plan import plan_from_dict
from fastml.executor.loop import faults
from fastml.executor.loop.train import train
from test_gpu import deterministic  # beside this file, on the path of a script run from here


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
    with (deterministic() if run.get("deterministic") else contextlib.nullcontext(),
          injected(run["faults"]) if run.get("faults") else contextlib.nullcontext()):
        train(plan_from_dict(run["plan"]), log_json=run["log"], show_progress=False, resume=run.get("resume", False),
              timeout_s=run.get("timeout_s", 120), run_dir=run.get("run_dir"))
