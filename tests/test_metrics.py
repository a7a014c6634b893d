"""`fastml run --tensorboard DIR` and `--wandb PROJECT` (executor/loop/metrics.py): the event files a run writes,
read back with tensorboard's own reader, hold every figure of the run's log at every step it was measured
(TensorBoard stores float32: compared at that precision); a Weights & Biases run in offline mode (no network) holds
every figure's name and value in its record file (wandb keeps no Python reader of that file: its bytes are searched
for them); a flag whose package is missing is refused before any work."""

from __future__ import annotations

import dataclasses
import glob
import json

import pytest

from fastml.config import UserError
from fastml.plan import MEMORY_CATEGORIES, TIME_COMPONENTS, Predicted
from fastml.executor.loop import metrics
from fastml.executor.loop.train import train
from test_validation import dataset, validated_plan  # noqa: F401 (dataset is a fixture)

PREDICTED = Predicted(step_time_s=0.25, tokens_per_s=1024.0, mfu=0.0, peak_memory_bytes=0,
                      memory_bytes=dict.fromkeys(MEMORY_CATEGORIES, 0),
                      host_memory_bytes=dict.fromkeys(MEMORY_CATEGORIES, 0), time_s=dict.fromkeys(TIME_COMPONENTS, 0.0),
                      usd_per_million_tokens=0.0, kwh_per_million_tokens=0.0)


def test_a_run_writes_every_figure_to_tensorboard(tmp_path, dataset):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = dataclasses.replace(validated_plan(dataset, tmp_path / "ck"), predicted=PREDICTED)
    log = tmp_path / "log.jsonl"
    train(plan, log_json=log, show_progress=False, tensorboard=str(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    written = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    measured = {tag for key, tag in metrics.SCALARS.items() if any(r.get(key) is not None for r in records)}
    assert set(written) == measured | {metrics.PREDICTED_STEP}
    # On a CPU no GPU memory is measured, nor MFU where its profile has no peak: None in the log, not written.
    assert set(metrics.SCALARS.values()) - measured <= {"memory/peak_gpu_bytes", "perf/mfu"}
    for key, tag in metrics.SCALARS.items():
        logged = {r["step"]: r[key] for r in records if r.get(key) is not None}
        assert written.get(tag, {}) == pytest.approx(logged, rel=1e-6), tag
    assert list(written["val/loss"]) == [2, 4]
    assert written[metrics.PREDICTED_STEP] == {step: 0.25 for step in range(1, 5)}


def test_an_offline_wandb_run_holds_every_figure(tmp_path, dataset, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = tmp_path / "log.jsonl"
    train(dataclasses.replace(validated_plan(dataset, tmp_path / "ck"), predicted=PREDICTED), log_json=log,
          show_progress=False, wandb="fastml-test")
    [run_file] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    saved = open(run_file, "rb").read()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for key, tag in metrics.SCALARS.items():
        values = [r[key] for r in records if r.get(key) is not None]
        assert not values or tag.encode() in saved, tag
        assert all(json.dumps(v).encode() in saved for v in values), tag
    assert metrics.PREDICTED_STEP.encode() in saved


def test_a_missing_package_is_one_line_before_any_work(monkeypatch, tmp_path, dataset):  # noqa: F811
    found = metrics.importlib.util.find_spec
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None if name == "wandb" else found(name))
    with pytest.raises(UserError, match=r"--wandb: needs the wandb package: pip install wandb \(or fastml\[logging\]\)"):
        train(validated_plan(dataset, tmp_path / "ck"), show_progress=False, wandb="project")
    assert not (tmp_path / "ck").exists()
