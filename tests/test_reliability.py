"""Faults during training: SIGKILL mid-step and mid-checkpoint, corrupted checkpoints, NaN losses, signals; and one
run per checkpoint directory: fresh starts, --start-over, what --resume may change, pruning.

The fault runs go through the real `fastml` command, with faults injected by FASTML_FAULTS (executor/loop/faults.py); the
checkpoint-directory tests train tiny plans in this process. Runs that do not wait for each other start together: a
start is seconds of imports on one core, and the test machine has two."""

import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from fastml.config import UserError
from fastml.plan import load_plan
from fastml.planner.planner import make_plan
from fastml.executor.storage import checkpoints as run_checkpoints
from fastml.executor import train
from fastml.executor.loop import faults
from fastml.executor.model.transformer import build_model, materialize
from fastml.executor.memory.optim import lr_at
from fastml.executor.parallel.world import World
from fastml.executor.storage.tensordir import read_manifest
from in_process import fastml_here
from small_model import SMALL_OVERRIDES

STEPS = 8


def fastml(*args, cwd, faults="", wait=True):
    env = dict(os.environ, FASTML_FAULTS=faults)
    command = [sys.executable, "-m", "fastml", *args]
    if not wait:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory):
    """A small CPU plan (planned in this process: `fastml plan` runs as a command in tests/test_cli.py), then the
    runs killed mid-step (at step 5) and mid-checkpoint (of step 4) as processes and, in this process meanwhile, an
    uninterrupted run ("reference") and one stopped after 6 of its 8 steps ("six"): the directory, and the runs by
    name."""
    from fastml.cli import main

    path = tmp_path_factory.mktemp("reliability")
    pins = [arg for pin in SMALL_OVERRIDES for arg in ("--set", pin)]
    assert main(["plan", "--device", "cpu", "--seq", "64", "--global-batch-tokens", "256", "--steps", str(STEPS),
                 *pins, "-o", str(path / "plan.json")]) == 0
    started = {"kill-mid-step": run(path, "kill-mid-step", faults="kill-mid-step@5", wait=False),
               "kill-mid-checkpoint": run(path, "kill-mid-checkpoint", faults="kill-mid-checkpoint@4", wait=False)}
    here = {"reference": run(path, "reference", here=True), "six": run(path, "six", "--steps", "6", here=True)}
    return path, {**here, **{name: finished(process) for name, process in started.items()}}


@pytest.fixture(scope="module")
def workdir(first_runs):
    """The plan, and the losses of an uninterrupted run of it."""
    path, runs = first_runs
    assert runs["reference"].returncode == 0, runs["reference"].stderr
    return path


def run(path, name, *extra, faults="", wait=True, here=False):
    """Its own run directory: runs started in one second in one directory would share the one named after it.
    `here`: in this process (tests/in_process.py), without faults."""
    args = ("run", "plan.json", "--checkpoint-dir", f"ck-{name}", "--checkpoint-interval", "2", "--log-json",
            f"{name}.jsonl", "--no-progress", "--run-dir", f"runs/{name}", *extra)
    if here:
        assert not faults
        return fastml_here(*args, cwd=path)
    return fastml(*args, cwd=path, faults=faults, wait=wait)


def losses(path, name):
    return [json.loads(line)["loss"] for line in (Path(path) / f"{name}.jsonl").read_text().splitlines()]


def checkpoints(path, name):
    return sorted(p.name for p in (Path(path) / f"ck-{name}").iterdir() if not p.name.startswith("."))


def hidden(path, name):
    return sorted(p.name for p in (Path(path) / f"ck-{name}").iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("fault, survivors", [("kill-mid-step@5", ["step-00000002", "step-00000004"]),
                                               ("kill-mid-checkpoint@4", ["step-00000002"])])
def test_resume_after_sigkill_repeats_the_same_losses(workdir, first_runs, fault, survivors):
    name = fault.split("@")[0]
    killed = first_runs[1][name]  # run with FASTML_FAULTS=fault
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert checkpoints(workdir, name) == survivors  # a checkpoint being written is never visible half-done
    leftovers = hidden(workdir, name)
    assert len(leftovers) == (name == "kill-mid-checkpoint")  # its hidden temporary directory
    resumed = run(workdir, name, "--resume", here=True)  # `fastml run --resume` as a process: the tests below
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stderr.replace("\n", "")  # the console wraps long lines
    assert hidden(workdir, name) == [] and all("removed" in said and leftover in said for leftover in leftovers)
    assert f"resumed from {Path('ck-' + name) / survivors[-1]}" in resumed.stderr.replace("\n", "")
    assert losses(workdir, name) == losses(workdir, "reference")


DAMAGES = ["truncate", "flip", "delete", "no-meta"]


@pytest.fixture(scope="module")
def damaged_resumed(workdir, first_runs):
    """For each damage, a copy of the checkpoints of the run stopped after 6 of its 8 steps (steps 2, 4, 6) and of
    its log, the newest checkpoint damaged so, then resumed: the first damage by a `fastml run --resume` process,
    the others in this process meanwhile. The resumed runs by damage."""
    assert first_runs[1]["six"].returncode == 0, first_runs[1]["six"].stderr
    started = {}
    for damage in DAMAGES:
        name = f"damage-{damage}"
        shutil.copytree(Path(workdir, "ck-six"), Path(workdir, f"ck-{name}"))
        shutil.copy(Path(workdir, "six.jsonl"), Path(workdir, f"{name}.jsonl"))
        newest = Path(workdir, f"ck-{name}", "step-00000006")
        target = newest / {"truncate": "model.safetensors", "flip": "optimizer.safetensors",
                           "delete": "rng.safetensors", "no-meta": "fastml.json"}[damage]
        if damage == "truncate":
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        elif damage == "flip":
            data = bytearray(target.read_bytes())
            data[-10] ^= 0xFF
            target.write_bytes(bytes(data))
        else:
            target.unlink()
        started[damage] = run(workdir, name, "--resume", wait=False, here=damage != DAMAGES[0])
    return {damage: finished(result) if isinstance(result, subprocess.Popen) else result
            for damage, result in started.items()}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(workdir, damaged_resumed, damage):
    name = f"damage-{damage}"
    resumed = damaged_resumed[damage]
    assert resumed.returncode == 0, resumed.stderr
    stderr = resumed.stderr.replace("\n", "")
    assert "skipping checkpoint" in stderr and "step-00000004" in stderr
    assert losses(workdir, name) == losses(workdir, "reference")


@pytest.fixture(scope="module")
def nan_runs(workdir):
    """Two runs started together: a NaN loss at step 3, checkpointing every step ("nan"); NaN losses from step 3 on,
    at most 3 in a row ("nans")."""
    started = {"nan": fastml("run", "plan.json", "--checkpoint-dir", "ck-nan", "--checkpoint-interval", "1",
                             "--log-json", "nan.jsonl", "--no-progress", "--steps", "4", "--run-dir", "runs/nan",
                             cwd=workdir, faults="nan-loss@3", wait=False),
               "nans": fastml("run", "plan.json", "--checkpoint-dir", "ck-nans", "--checkpoint-interval", "2",
                              "--no-progress", "--max-nonfinite-steps", "3", "--run-dir", "runs/nans", cwd=workdir,
                              faults="nan-loss@3-8", wait=False)}
    return {name: finished(process) for name, process in started.items()}


def test_a_nan_step_is_skipped_and_leaves_the_state_untouched(workdir, nan_runs):
    result = nan_runs["nan"]
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (workdir / "nan.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, False]
    assert records[2]["loss"] is None
    before, after = (Path(workdir, "ck-nan", f"step-0000000{i}") for i in (2, 3))
    for file in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(before / file), load_file(after / file)
        assert all((a[k] == b[k]).all() for k in a), file
    assert re.search(r"steps skipped \(loss or gradient not finite\)\s*│\s*1\s*│", result.stdout)


def test_too_many_nan_steps_in_a_row_stop_the_run(nan_runs):
    result = nan_runs["nans"]
    assert result.returncode == 3, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "step 5: loss or gradient norm not finite 3 steps in a row" in last
    assert "ck-nans/step-00000004" in last


def test_sigterm_finishes_the_step_checkpoints_and_resumes(workdir):
    """SIGTERM in the middle of step 3 (sent by the process itself at a known step: sent from here once the log had
    a line, it came after the last of this small run's steps now and then on a busy machine)."""
    stopped = fastml("run", "plan.json", "--checkpoint-dir", "ck-term", "--log-json", "term.jsonl", "--no-progress",
                     cwd=workdir, faults="sigterm@3")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert "stopped by SIGTERM" in stopped.stderr and "--resume" in stopped.stderr
    assert len((workdir / "term.jsonl").read_text().splitlines()) == 3  # the step it was in finished
    assert checkpoints(workdir, "term") == ["step-00000003"]
    resumed = fastml_here("run", "plan.json", "--checkpoint-dir", "ck-term", "--log-json", "term.jsonl",
                          "--no-progress", "--resume", cwd=workdir)  # (a resume as a process: the tests above)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(workdir, "term") == losses(workdir, "reference")


def test_a_plan_for_other_hardware_warns_or_is_refused(workdir):
    plan = json.loads((workdir / "plan.json").read_text())
    plan["hardware"]["profile"] = "rtx4090"
    (workdir / "other.json").write_text(json.dumps(plan))
    refused = fastml("run", "other.json", "--steps", "1", "--strict", "--run-dir", "runs/refused", cwd=workdir,
                     wait=False)
    warned = fastml_here("run", "other.json", "--steps", "1", "--no-progress", "--run-dir", "runs/warned", cwd=workdir)
    refused = finished(refused)
    assert warned.returncode == 0 and "made for rtx4090" in warned.stderr.replace("\n", " ")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "hardware.profile" in refused.stderr


def test_a_training_checkpoint_exports_to_hf(workdir):
    from fastml.executor.storage.hf import convert_to_hf, load_pretrained
    from fastml.executor.storage.tensordir import load_checkpoint

    checkpoint = Path(workdir, "ck-reference", f"step-{STEPS:08d}")
    convert_to_hf(checkpoint, workdir / "hf")
    _, state, _ = load_checkpoint(checkpoint)
    loaded = load_pretrained(workdir / "hf").state_dict()
    assert state.keys() == loaded.keys() and all((state[k] == loaded[k]).all() for k in state)


def test_resuming_a_finished_run_trains_nothing(workdir):
    """(In this process: the resumes above run as commands.)"""
    plan = load_plan(workdir / "plan.json")
    plan = dataclasses.replace(plan, training=dataclasses.replace(
        plan.training, checkpoint_dir=str(workdir / "ck-reference"), checkpoint_interval=2))
    assert f"already at step {STEPS} of {STEPS}: nothing to train" in train_quietly(plan, resume=True)


def test_a_new_run_into_a_used_checkpoint_dir_is_refused_in_one_line(workdir):
    """Through the CLI: exit 2 and one line; --start-over is wired through to the run (in a copy, at once, through
    fastml.cli.main in this process)."""
    shutil.copytree(workdir / "ck-reference", workdir / "ck-again")
    refused = run(workdir, "reference", wait=False)
    again = run(workdir, "again", "--start-over", "--steps", "2", here=True)  # in this process, meanwhile
    refused = finished(refused)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "fastml: error: ck-reference: holds 3 checkpoints (steps 4, 6, 8) of an earlier run; continue that run with "
        "--resume, or start a new one with --start-over (which moves them into a new directory "
        "ck-reference/old-run-TIME)"]
    assert again.returncode == 0, again.stderr
    (aside,) = Path(workdir, "ck-again").glob("old-run-*")
    assert checkpoints(workdir, "again") == [aside.name, "step-00000002"]
    assert sorted(p.name for p in aside.iterdir()) == checkpoints(workdir, "reference")


# ---- one run per checkpoint directory, in-process --------------------------------------------------------------

def tiny_plan(root, steps=8, *overrides):
    return make_plan(seq_len=32, global_batch_tokens=64, steps=steps, device="cpu", overrides=[
        *SMALL_OVERRIDES, f"training.checkpoint_dir={root}", "training.checkpoint_interval=2", *overrides]).plan


def train_quietly(plan, **kwargs) -> str:
    """Trains in this process; returns what the run printed, as one line."""
    output = io.StringIO()
    train(plan, show_progress=False, console=Console(file=output, width=10_000), **kwargs)
    return output.getvalue().replace("\n", " ")


def steps_in(root) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step-"))


def run_ids(root) -> set[str]:
    return {read_manifest(path).training.run_id for path in Path(root).glob("step-*")}


def snapshot_of(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture
def test_hooks_set(monkeypatch):
    monkeypatch.setenv("FASTML_FAULTS", "nan-loss@99")
    monkeypatch.setenv("FASTML_TEST_ONE_GPU", "1")
    faults._planned.cache_clear()
    yield
    faults._planned.cache_clear()


def test_a_test_hook_set_by_accident_is_said_first(tmp_path, test_hooks_set):
    """FASTML_FAULTS and FASTML_TEST_ONE_GPU change a run: whoever sets one by accident reads it before anything.
    (Unset or empty, nothing is said: test_a_new_run_into_a_used_checkpoint_dir_is_refused_in_one_line.)"""
    said = train_quietly(tiny_plan(tmp_path / "ck", 1))
    assert said.startswith(
        "warning: FASTML_FAULTS=nan-loss@99 is set: a hook of fastml's tests that injects faults (kills, signals, NaN "
        "losses, hangs) into this run; unset it unless you are testing fastml warning: FASTML_TEST_ONE_GPU=1 is set: a hook "
        "of fastml's tests that puts every rank of a node on GPU 0; unset it unless you are testing fastml ")


def test_a_fresh_run_refuses_a_directory_holding_checkpoints(tmp_path):
    train_quietly(tiny_plan(tmp_path / "ck", 4))
    before = snapshot_of(tmp_path / "ck")
    with pytest.raises(UserError, match=r"ck: holds 2 checkpoints \(steps 2, 4\) of an earlier run; continue that run "
                                        r"with --resume, or start a new one with --start-over"):
        train_quietly(tiny_plan(tmp_path / "ck", 4))
    assert snapshot_of(tmp_path / "ck") == before
    with pytest.raises(UserError, match="--start-over: contradicts --resume"):
        train_quietly(tiny_plan(tmp_path / "ck", 4), resume=True, start_over=True)
    with pytest.raises(UserError, match="--start-over: needs a checkpoint directory"):
        train_quietly(tiny_plan(tmp_path / "ck", 4, "training.checkpoint_dir=null"), start_over=True)


def test_start_over_moves_the_old_run_aside_and_resume_continues_the_new_one(tmp_path):
    """The reused directory of REVIEW's new user: the new run's checkpoints survive its pruning, and --resume takes
    the new run's newest, not the old run's."""
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 8), keep_checkpoints=3)
    old = snapshot_of(root)
    (old_run,) = run_ids(root)
    said = train_quietly(tiny_plan(root, 4), start_over=True, keep_checkpoints=3)
    (aside,) = root.glob("old-run-*")
    assert f"moved 3 checkpoints (steps 4, 6, 8) of the earlier run to {aside}" in said
    assert snapshot_of(aside) == old  # moved whole, nothing deleted
    assert steps_in(root) == ["step-00000002", "step-00000004"]
    (new_run,) = run_ids(root)
    assert new_run != old_run
    said = train_quietly(tiny_plan(root, 6), resume=True)
    assert f"resumed from {root / 'step-00000004'} (step 4)" in said
    assert run_ids(root) == {new_run}  # a resumed run keeps its identity


def test_resume_refuses_a_plan_that_computes_something_else(tmp_path):
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 4))
    for override, message in [("training.seed=1", "training.seed: was 0 when .*step-00000004 was written and is 1 "
                                                  "now; resuming would not continue the same run: resume with 0, or "
                                                  "start a new run with --start-over instead of --resume"),
                              ("training.weight_decay=0.5", "training.weight_decay: was 0.1 .* is 0.5 now"),
                              ("model.norm_eps=1e-6", "model.norm_eps: was 1e-05 .* is 1e-06 now")]:
        with pytest.raises(UserError, match=message):
            train_quietly(tiny_plan(root, 6, override), resume=True)
    assert steps_in(root) == ["step-00000002", "step-00000004"]


def test_resume_applies_and_says_a_changed_lr_schedule(tmp_path):
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 4))
    changed = tiny_plan(root, 6, "training.lr=0.0005", "training.warmup_steps=2")
    said = train_quietly(changed, resume=True, log_json=tmp_path / "log.jsonl")
    assert ("resuming with a changed lr schedule, applied from step 5 on: training.steps 4 -> 6, training.lr 0.001 -> "
            "0.0005, training.warmup_steps 4 -> 2") in said
    logged = [json.loads(line)["lr"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged == [lr_at(4, changed.training), lr_at(5, changed.training)]


def test_resume_allows_knobs_that_change_no_math_and_says_so(tmp_path):
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 6, "knobs.micro_batch_size=1"), log_json=tmp_path / "a.jsonl", keep_checkpoints=3)
    reference = losses(tmp_path, "a")
    for lost in ("step-00000004", "step-00000006"):
        shutil.rmtree(root / lost)
    said = train_quietly(tiny_plan(root, 6, "knobs.micro_batch_size=2", 'knobs.recompute=["block"]',
                                   "knobs.lm_head_chunks=2"),
                         resume=True, log_json=tmp_path / "a.jsonl", checkpoint_interval=1)
    assert ("resuming with changes that leave the math and the data order as they were: training.checkpoint_interval "
            "2 -> 1, knobs.micro_batch_size 1 -> 2, knobs.grad_accum_steps 2 -> 1, knobs.recompute () -> ('block',), "
            "knobs.lm_head_chunks 1 -> 2") in said
    # The same sequences in the same order: equal up to the order of the sums.
    assert losses(tmp_path, "a") == pytest.approx(reference, rel=1e-5)


def test_a_resumed_run_checkpoints_as_the_run_it_resumes_unless_given_a_new_interval(tmp_path):
    """REVIEW: `--resume` without repeating `--checkpoint-interval` set it back to the plan file's 0 (the end only),
    announced among the changes but easy to miss."""
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 4))  # every 2 steps
    said = train_quietly(tiny_plan(root, 8, "training.checkpoint_interval=0"), resume=True, keep_checkpoints=10)
    assert "resuming with the run's checkpoint interval: every 2 steps (--checkpoint-interval N changes it)" in said
    assert steps_in(root) == [f"step-0000000{i}" for i in (2, 4, 6, 8)]
    said = train_quietly(tiny_plan(root, 11), resume=True, keep_checkpoints=10, checkpoint_interval=0)
    assert "training.checkpoint_interval 2 -> 0" in said
    assert steps_in(root)[-1:] == ["step-00000011"] and "step-00000010" not in steps_in(root)


def test_pruning_keeps_intact_checkpoints_and_removes_damaged_ones(tmp_path):
    """REVIEW's new user: pruning kept the damaged newest checkpoints and deleted the intact older ones."""
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 8), keep_checkpoints=4)
    flip_a_byte(root / "step-00000008" / "optimizer.safetensors")
    said = train_quietly(tiny_plan(root, 7), resume=True, keep_checkpoints=2)
    assert "skipping checkpoint" in said and "removing damaged checkpoint" in said
    assert steps_in(root) == ["step-00000006", "step-00000007"]


def test_resume_refuses_when_no_checkpoint_is_intact(tmp_path):
    root = tmp_path / "ck"
    train_quietly(tiny_plan(root, 2))
    flip_a_byte(root / "step-00000002" / "model.safetensors")
    with pytest.raises(UserError, match="ck: none of its 1 checkpoints is intact .* --start-over instead of --resume"):
        train_quietly(tiny_plan(root, 4), resume=True)


def test_pruning_never_touches_another_runs_checkpoints(tmp_path):
    """Two runs writing into one directory at once (the start check cannot see a run that starts at the same time):
    each prunes only its own checkpoints, neither overwrites the other's, and --resume refuses to pick one."""
    plan = tiny_plan(tmp_path / "ck")
    model = materialize(build_model(plan.model), "cpu", torch.float32, seed=0)
    first, second = (run_checkpoints.Run(plan, run_id, keep=1, say=lambda message: None)
                     for run_id in ("first", "second"))
    for step, run_ in [(1, first), (2, second), (3, first), (4, second), (5, first)]:
        run_.save(model, NoOptimizerState(), run_checkpoints.Position(step, step))
    assert steps_in(tmp_path / "ck") == ["step-00000004", "step-00000005"]
    with pytest.raises(UserError, match="step-00000005: was written by run first, not by this run"):
        second.save(model, NoOptimizerState(), run_checkpoints.Position(5, 5))
    with pytest.raises(UserError, match=r"holds the checkpoints of 2 runs \(first, second\)"):
        train_quietly(plan, resume=True)


def test_each_rank_restores_its_own_rng_state(tmp_path):
    """Rank r's states are in rng-RRRRR.safetensors (rank 0's in rng.safetensors): rank 1 resumes its own, not rank
    0's; a rank the checkpoint has none for (written by fewer ranks) starts them as a new run does, from
    training.seed + rank. (tests/test_distributed.py: 2 ranks write their own.)"""
    plan = tiny_plan(tmp_path / "ck", 2)
    train_quietly(plan)
    path = tmp_path / "ck" / "step-00000002"
    torch.manual_seed(123)
    save_file({"cpu": torch.get_rng_state()}, path / "rng-00001.safetensors")
    expected = {1: torch.rand(4)}
    torch.manual_seed(plan.training.seed + 2)
    expected[2] = torch.rand(4)
    model = materialize(build_model(plan.model), "cpu", torch.float32, seed=0)
    for rank in (1, 2):
        torch.manual_seed(7)
        run_checkpoints.Run(plan, "r", 1, say=lambda message: None, restore_from=path,
                            saved=read_manifest(path).training,
                            world=World(rank=rank, size=3, local_rank=rank, local_size=3)).restore(
            model, NoOptimizerState())
        assert torch.equal(torch.rand(4), expected[rank]), rank


class NoOptimizerState:
    def wait(self):
        pass

    def state_tensors(self):
        return {"step/none": torch.zeros(1)}

    def state_ranges(self):
        return {}

    def load_state(self, read):
        pass


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
