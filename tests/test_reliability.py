"""Faults during training: SIGKILL mid-step and mid-checkpoint, corrupted checkpoints, NaN losses, signals.

The runs go through the real `fastml` command; faults are injected with FASTML_FAULTS (executor/faults.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

STEPS = 8


def fastml(*args, cwd, faults="", wait=True):
    env = dict(os.environ, FASTML_FAULTS=faults)
    command = [sys.executable, "-m", "fastml", *args]
    if not wait:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A small CPU plan, and the losses of an uninterrupted run of it."""
    path = tmp_path_factory.mktemp("reliability")
    assert fastml("plan", "--device", "cpu", "--seq", "64", "--global-batch-tokens", "256", "--steps", str(STEPS),
                  "-o", "plan.json", cwd=path).returncode == 0
    result = run(path, "reference")
    assert result.returncode == 0, result.stderr
    return path


def run(path, name, *extra, faults=""):
    return fastml("run", "plan.json", "--checkpoint-dir", f"ck-{name}", "--checkpoint-interval", "2",
                  "--log-json", f"{name}.jsonl", "--no-progress", *extra, cwd=path, faults=faults)


def losses(path, name):
    return [json.loads(line)["loss"] for line in (Path(path) / f"{name}.jsonl").read_text().splitlines()]


def checkpoints(path, name):
    return sorted(p.name for p in (Path(path) / f"ck-{name}").iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("fault, survivors", [("kill-mid-step@5", ["step-00000002", "step-00000004"]),
                                               ("kill-mid-checkpoint@4", ["step-00000002"])])
def test_resume_after_sigkill_repeats_the_same_losses(workdir, fault, survivors):
    name = fault.split("@")[0]
    killed = run(workdir, name, faults=fault)
    assert killed.returncode == -signal.SIGKILL
    assert checkpoints(workdir, name) == survivors  # a checkpoint being written is never visible half-done
    resumed = run(workdir, name, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {Path('ck-' + name) / survivors[-1]}" in resumed.stderr.replace("\n", "")
    assert losses(workdir, name) == losses(workdir, "reference")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no-meta"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(workdir, damage):
    name = f"damage-{damage}"
    assert run(workdir, name, "--steps", "6").returncode == 0
    newest = Path(workdir, f"ck-{name}", "step-00000006")
    target = newest / {"truncate": "model.safetensors", "flip": "optimizer.safetensors", "delete": "rng.safetensors",
                       "no-meta": "fastml.json"}[damage]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    resumed = run(workdir, name, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    stderr = resumed.stderr.replace("\n", "")
    assert "skipping checkpoint" in stderr and "step-00000004" in stderr
    assert losses(workdir, name) == losses(workdir, "reference")


def test_a_nan_step_is_skipped_and_leaves_the_state_untouched(workdir):
    result = fastml("run", "plan.json", "--checkpoint-dir", "ck-nan", "--checkpoint-interval", "1", "--log-json",
                    "nan.jsonl", "--no-progress", "--steps", "4", cwd=workdir, faults="nan-loss@3")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (workdir / "nan.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, False]
    assert records[2]["loss"] is None
    before, after = (Path(workdir, "ck-nan", f"step-0000000{i}") for i in (2, 3))
    for file in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(before / file), load_file(after / file)
        assert all((a[k] == b[k]).all() for k in a), file
    assert re.search(r"steps skipped \(loss or gradient not finite\)\s*│\s*1\s*│", result.stderr)


def test_too_many_nan_steps_in_a_row_stop_the_run(workdir):
    result = fastml("run", "plan.json", "--checkpoint-dir", "ck-nans", "--checkpoint-interval", "2", "--no-progress",
                    "--max-nonfinite-steps", "3", cwd=workdir, faults="nan-loss@3-8")
    assert result.returncode == 3
    last = result.stderr.strip().splitlines()[-1]
    assert "step 5: loss or gradient norm not finite 3 steps in a row" in last
    assert "ck-nans/step-00000004" in last


def test_sigterm_finishes_the_step_checkpoints_and_resumes(workdir):
    process = fastml("run", "plan.json", "--checkpoint-dir", "ck-term", "--log-json", "term.jsonl", "--no-progress",
                     cwd=workdir, wait=False)
    log = workdir / "term.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr and "--resume" in stderr
    done = len(log.read_text().splitlines())
    assert checkpoints(workdir, "term") == [f"step-{done:08d}"]
    resumed = fastml("run", "plan.json", "--checkpoint-dir", "ck-term", "--log-json", "term.jsonl", "--no-progress",
                     "--resume", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(workdir, "term") == losses(workdir, "reference")


def test_a_plan_for_other_hardware_warns_or_is_refused(workdir):
    plan = json.loads((workdir / "plan.json").read_text())
    plan["hardware"]["profile"] = "rtx4090"
    (workdir / "other.json").write_text(json.dumps(plan))
    warned = fastml("run", "other.json", "--steps", "1", "--no-progress", cwd=workdir)
    assert warned.returncode == 0 and "made for rtx4090" in warned.stderr.replace("\n", " ")
    refused = fastml("run", "other.json", "--steps", "1", "--strict", cwd=workdir)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "hardware.profile" in refused.stderr


def test_a_training_checkpoint_exports_to_hf(workdir):
    from fastml.executor.hf import convert_to_hf, load_checkpoint, load_pretrained

    checkpoint = Path(workdir, "ck-reference", f"step-{STEPS:08d}")
    convert_to_hf(checkpoint, workdir / "hf")
    _, state, _ = load_checkpoint(checkpoint)
    loaded = load_pretrained(workdir / "hf").state_dict()
    assert state.keys() == loaded.keys() and all((state[k] == loaded[k]).all() for k in state)


def test_resuming_a_finished_run_trains_nothing(workdir):
    result = run(workdir, "reference", "--resume")
    assert result.returncode == 0, result.stderr
    assert f"already at step {STEPS} of {STEPS}: nothing to train" in result.stderr.replace("\n", " ")
