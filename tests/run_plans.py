"""One rank of a test job: trains each plan of a JSON spec in turn, so that one start of a job's processes serves
several comparisons (tests/test_distributed.py).

    torchrun --standalone --nproc-per-node N tests/run_plans.py SPEC.json

SPEC is {"runs": [{"plan": PLAN, "log": FILE, "resume": false}, ...]}; rank 0 writes each run's JSON-lines log.
"""

import json
import sys

from fastml.plan import plan_from_dict
from fastml.executor.train import train

for run in json.loads(open(sys.argv[1]).read())["runs"]:
    train(plan_from_dict(run["plan"]), log_json=run["log"], show_progress=False, resume=run.get("resume", False),
          timeout_s=run.get("timeout_s", 120))
