"""Run records and `fastml calibrate`: every run writes its record; calibration recovers known terms from synthetic
records (made by the simulator with those terms) and refuses records of another machine."""

import dataclasses
import json
import subprocess
import sys

import pytest
from in_process import fastml_here
from small_model import EVAL_TOKENS

from fastml import hwprofiles
from fastml.config import UserError
from fastml.hwprofiles.schema import Calibration
from fastml.plan import Hardware, Knobs, Plan, Training
from fastml.record import Measured, RunMachine, RunRecord, load_record
from fastml.spec import PRESETS
from fastml.planner.calibrate import MODEL_VERSION, _predict, calibrate, stale_calibration, with_calibration
from fastml.planner.planner import make_plan
from fastml.planner.hardware import load_machine

TRUE = Calibration(forward=0.8, compute=1.25, cpu_optimizer=1.5, transfer=1.6, layer_overhead_s=2e-4, step_overhead_s=0.03,
                   compiled_activations=0.85, fragmentation=0.05)
# (model, micro-batch, accumulation, recompute, compile, other knobs): compute- and copy-bound, compiled or not
CASES = [("tinyllama-1.1b", 8, 2, (), False, {}), ("tinyllama-1.1b", 4, 4, ("block",), True, {}),
         ("qwen2.5-0.5b", 16, 1, (), True, {}), ("qwen2.5-0.5b", 2, 8, ("ffn",), False, dict(offload_residuals=1.0)),
         ("llama-3.2-1b", 4, 4, ("block",), True, dict(offload_gradients=1.0)),
         ("tinyllama-1.1b", 1, 16, ("attention",), True, dict(offload_weights=0.5)),
         ("qwen2.5-0.5b", 4, 2, (), True, dict(offload_optimizer=1.0, offload_master=1.0))]


def case_plan(model, micro, accum, recompute, compiled, knobs) -> Plan:
    return Plan(model=PRESETS[model], training=Training(seq_len=2048, global_batch_tokens=2048 * micro * accum),
                hardware=Hardware(profile="h200", device="cuda"),
                knobs=Knobs(micro_batch_size=micro, grad_accum_steps=accum, recompute=recompute, compile=compiled,
                            **knobs))


def synthetic_records(profile: dict, device_name: str = "NVIDIA H200") -> dict[str, RunRecord]:
    """What runs of CASES would measure on a machine that behaves as the simulator does with TRUE."""
    truth = with_calibration(profile, TRUE)
    records = {}
    for i, case in enumerate(CASES):
        plan = case_plan(*case)
        p = _predict(plan, truth)
        measured = Measured(step_time_s=p.step_s, tokens_per_s=plan.training.global_batch_tokens / p.step_s, mfu=None,
                            peak_memory_bytes=p.peak_bytes, memory_bytes=None, host_memory_bytes=None)
        records[f"run{i}"] = RunRecord(plan=plan, machine=RunMachine(device="cuda", device_name=device_name,
                                                                     num_devices=1, host="h"),
                                       steps=10, date="2026-12-01", measured=measured)
    return records


def test_calibration_recovers_known_terms_from_synthetic_records():
    """The GPU's work and the copies' factors, on a profile whose passes are never the host's (host_overhead, whose
    max with the GPU's work the linear fit does not model)."""
    profile = {k: v for k, v in hwprofiles.load("h200").items() if k != "host_overhead"}
    fitted, fits = calibrate(synthetic_records(profile), profile)
    terms = fitted["calibration"]
    for name in ("forward", "compute", "cpu_optimizer", "layer_overhead_s", "step_overhead_s", "compiled_activations", "fragmentation"):
        assert terms[name] == pytest.approx(getattr(TRUE, name), rel=0.05), name
    assert terms["transfer"] == pytest.approx(TRUE.transfer, rel=0.15)  # seen only where copies are exposed
    assert terms["records"] == len(CASES)
    assert all(abs(fit.step_errors[0]) > 0.15 for fit in fits)  # far off before
    assert all(abs(fit.step_errors[1]) < 0.03 and abs(fit.peak_errors[1]) < 0.01 for fit in fits)
    # The fitted profile is a profile: plans made with it predict what the records measured.
    machine = load_machine(fitted, 1)
    assert machine.calibration == Calibration(**terms)


def test_the_fitted_memory_predicts_no_record_low():
    """Peaks measured 2% above and below the model: a least-squares fit predicts some of them low, so
    fragmentation rises until the one it predicts lowest is met exactly, and none is predicted below its
    measurement."""
    profile = {k: v for k, v in hwprofiles.load("h200").items() if k != "host_overhead"}
    records = {name: dataclasses.replace(r, measured=dataclasses.replace(
                   r.measured, peak_memory_bytes=int(r.measured.peak_memory_bytes * (1.02 if i % 2 else 0.98))))
               for i, (name, r) in enumerate(synthetic_records(profile).items())}
    _, fits = calibrate(records, profile)
    lowest = min(fit.peak_errors[1] for fit in fits)
    assert lowest == pytest.approx(0.0, abs=1e-6)


def test_a_term_no_record_tells_keeps_its_value():
    """Without a record whose optimizer steps on the CPU, nothing tells cpu_optimizer: it stays 1."""
    profile = hwprofiles.load("h200")
    records = {name: r for name, r in synthetic_records(profile).items() if not r.plan.knobs.offload_optimizer}
    fitted, _ = calibrate(records, profile)
    assert fitted["calibration"]["cpu_optimizer"] == 1.0


def test_records_of_another_machine_are_refused():
    profile = hwprofiles.load("h200")
    with pytest.raises(UserError, match="run0: ran on 'NVIDIA A100-SXM4-80GB' .* not on the machine of profile h200"):
        calibrate(synthetic_records(profile, device_name="NVIDIA A100-SXM4-80GB"), profile)
    record = synthetic_records(profile)["run0"]
    on_a_cpu = dataclasses.replace(record, machine=RunMachine(device="cpu", device_name="AMD EPYC", num_devices=1,
                                                              host="h"))
    with pytest.raises(UserError, match="run0: ran on a CPU, but h200 is a CUDA profile"):
        calibrate({"run0": on_a_cpu}, profile)


# What the uncalibrated models predict for CASES and an fp8 plan on the h200 profile (step seconds, peak bytes), as
# shipped and with measured tables (below), by MODEL_VERSION: a change that moves them makes every earlier
# calibration stale.
FP8_CASE = ("llama-3.1-8b", 2, 4, ("norm",), True,
            dict(matmul_dtype="fp8", lm_head_chunks=4, optimizer_dtype="bf16", master_dtype="bf16"))
PREDICTED = {4: [(0.497311, 47144206336), (0.613789, 21551841280), (0.297575, 101236307968),
                 (0.488174, 16540612608), (0.703937, 31282118656), (1.0552, 20287520768),
                 (0.286562, 25309076992), (1.13007, 84350648320),
                 # with MEASURED_TABLES
                 (0.556309, 47144206336), (0.691176, 21551841280), (0.285896, 101236307968),
                 (0.484109, 16540612608), (0.714138, 31282118656), (1.0552, 20287520768),
                 (0.281831, 25309076992), (1.14825, 84350648320)],
             5: [(0.497311, 47144206336), (0.613789, 21551841280), (0.297575, 101236307968),
                 (0.488174, 16540612608), (0.703937, 31038832640), (1.0552, 20287520768),
                 (0.286562, 25309076992), (1.13007, 84875984896),
                 # with MEASURED_TABLES
                 (0.556309, 47144206336), (0.691176, 21551841280), (0.285896, 101236307968),
                 (0.484109, 16540612608), (0.714138, 31038832640), (1.0552, 20287520768),
                 (0.281831, 25309076992), (1.14825, 84875984896)],
             6: [(0.488997, 42099507200), (0.606482, 19149619200), (0.257361, 51780909056),
                 (0.448869, 10596923392), (0.670924, 21090992128), (1.0552, 19771621376),
                 (0.26665, 13149429248), (1.0757, 83070861312),
                 # with MEASURED_TABLES
                 (0.547995, 42099507200), (0.682987, 19149619200), (0.245682, 51780909056),
                 (0.444804, 10596923392), (0.681125, 21090992128), (1.0552, 19771621376),
                 (0.261919, 13149429248), (1.09388, 83070861312)],
             7: [(0.488997, 42099507200), (0.606482, 19149619200), (0.257361, 51780909056),
                 (0.448869, 10596923392), (0.670924, 21090992128), (1.0552, 19771621376),
                 (0.26665, 13149429248), (1.0624, 83070861312),
                 # with MEASURED_TABLES
                 (0.547995, 42099507200), (0.682987, 19149619200), (0.245682, 51780909056),
                 (0.444804, 10596923392), (0.681125, 21090992128), (1.0552, 19771621376),
                 (0.261919, 13149429248), (1.08058, 83070861312)],
             8: [(0.488997, 42099507200), (0.606482, 19149619200), (0.257361, 51780909056),
                 (0.448869, 10596923392), (0.670924, 21090992128), (1.0552, 19771621376),
                 (0.279661, 13149429248), (1.0624, 83070861312),
                 # with MEASURED_TABLES
                 (0.547995, 42099507200), (0.682987, 19149619200), (0.245682, 51780909056),
                 (0.444804, 10596923392), (0.681125, 21090992128), (1.0552, 19771621376),
                 (0.274931, 13149429248), (1.08058, 83070861312)],
             9: [(0.488997, 42099507200), (0.606482, 19095027712), (0.257361, 50792843520),
                 (0.448869, 10582243328), (0.670924, 21090992128), (1.0552, 19595444224),
                 (0.279661, 13149429248), (1.0624, 82852757504),
                 # with MEASURED_TABLES
                 (0.547995, 42099507200), (0.682987, 19095027712), (0.245682, 50792843520),
                 (0.444804, 10582243328), (0.681125, 21090992128), (1.0552, 19595444224),
                 (0.274931, 13149429248), (1.08058, 82852757504)]}


MEASURED_TABLES = {"attention_shapes": [[64, 1024, 0.28], [64, 8192, 0.4], [128, 2048, 0.38]],
                   "gemm_shapes": [[8192, 2048, 2048, 0.57], [8192, 11264, 2048, 0.64], [8192, 32000, 2048, 0.58]],
                   "backward_gemm_shapes": [[8192, 2048, 2048, 0.6], [8192, 32000, 2048, 0.55]]}
"""Rates of a measured profile's tables (fastml profile), for the pinned predictions to price through them too."""


def test_the_model_version_names_what_the_models_predict():
    """The models' predictions on the shipped profile's rates, without its calibration (a refit moves those, not
    the models)."""
    shipped = with_calibration(hwprofiles.load("h200"), Calibration())
    measured = shipped | {"gpu": shipped["gpu"] | MEASURED_TABLES}
    predicted = [_predict(case_plan(*case), profile) for profile in (shipped, measured)
                 for case in [*CASES, FP8_CASE]]
    moved = "the planner's predictions moved: bump MODEL_VERSION in planner/calibrate.py and pin its predictions here"
    assert MODEL_VERSION in PREDICTED, moved
    assert [(float(f"{p.step_s:.6g}"), p.peak_bytes) for p in predicted] == PREDICTED[MODEL_VERSION], moved


def test_a_calibration_of_other_models_is_said_to_be_stale(tmp_path):
    """A profile fitted to another version of the planner's models (or before versions were kept) plans with a
    warning that says what to do; one fitted by this fastml, or not calibrated, plans without one."""
    profile = hwprofiles.load("h200")
    fitted, _ = calibrate(synthetic_records(profile), profile)
    assert fitted["calibration"]["model_version"] == MODEL_VERSION
    stale = with_calibration(fitted, Calibration(**fitted["calibration"] | {"model_version": 0}))
    for name, data in (("fitted", fitted), ("stale", stale), ("uncalibrated", profile)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    notes = {name: make_plan(model="tiny", hw=str(tmp_path / f"{name}.json"), gpus=1, trials=5).stale_calibration
             for name in ("fitted", "stale", "uncalibrated")}
    assert notes["fitted"] is None and notes["uncalibrated"] is None
    assert notes["stale"] == stale_calibration(Calibration(**stale["calibration"]), "h200")
    assert "fitted to an unversioned one" in notes["stale"] and "`fastml calibrate`" in notes["stale"]
    planned = fastml("plan", "--model", "tiny", "--hw", "stale.json", "--gpus", "1", "--trials", "5", "-o",
                     "p.json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "warning: h200's calibration was fitted to an unversioned one" in " ".join(planned.stdout.split())
    as_json = fastml("plan", "--model", "tiny", "--hw", "stale.json", "--gpus", "1", "--trials", "5", "--json",
                     "-o", "p.json", cwd=tmp_path)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)  # the JSON alone on stdout, the warning beside
    assert "fitted to an unversioned one" in " ".join(as_json.stderr.split())
    explained = fastml("explain", "p.json", "--hw", "stale.json", "--json", cwd=tmp_path)
    assert explained.returncode == 0 and json.loads(explained.stdout), explained.stderr
    assert "fitted to an unversioned one" in " ".join(explained.stderr.split())


def fastml(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastml", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def plan_here(tmp_path) -> int:
    """A CPU plan of the tiny model at sequence 64 with a short final evaluation, planned in this process."""
    return fastml_here("plan", "--device", "cpu", "--seq", "64", "--trials", "10", "--set",
                       f"training.eval_tokens={EVAL_TOKENS}", "-o", "p.json", cwd=tmp_path).returncode


def test_every_run_writes_a_record_that_calibrate_reads(tmp_path):
    """`fastml run` writes its log, plan and record into its run directory; `fastml calibrate` fits this CPU's
    profile to two runs (without --hw: REVIEW 10, "'detected-cpu' is not a shipped profile") and says the errors
    before and after, each run by its whole name (REVIEW 22: they were cut short)."""
    assert plan_here(tmp_path) == 0
    names = ("20261202-051234-first", "20261202-051234-second")
    for name in names:  # in this process (a run's start costs seconds); `fastml calibrate` below runs as a process
        ran = fastml_here("run", "p.json", "--steps", "4", "--no-progress", "--run-dir", name, cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
        assert f"run record: {name}/record.json" in ran.stdout
    record = load_record(tmp_path / names[0] / "record.json")
    log = [json.loads(line) for line in (tmp_path / names[0] / "log.jsonl").read_text().splitlines()]
    assert record.steps == len(log) == 4 and record.machine.device == "cpu"
    assert record.measured.step_time_s == sorted(r["step_time_s"] for r in log[1:])[1]  # the steady median
    assert record.plan.model.name == "tiny" and record.measured.memory_bytes is None  # a CPU has no GPU memory
    calibrated = fastml("calibrate", *names, cwd=tmp_path)
    assert calibrated.returncode == 0, calibrated.stderr
    assert "mean absolute error of step time:" in calibrated.stdout and "after" in calibrated.stdout
    assert all(name in calibrated.stdout for name in names), calibrated.stdout
    assert json.loads((tmp_path / "cpu-calibrated.json").read_text())["calibration"]["records"] == 2


def test_a_traced_step_is_set_beside_the_simulated_one(tmp_path):
    """`fastml run --trace-step N` writes step N as torch's profiler saw it into the run directory; `fastml explain
    RUN_DIR --trace` writes one Chrome trace of the simulated step (process 0) and the measured one after it, both
    starting at 0."""
    assert plan_here(tmp_path) == 0
    ran = fastml("run", "p.json", "--steps", "3", "--no-progress", "--run-dir", "r", "--trace-step", "2",
                 cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "USDT" not in ran.stderr  # REVIEW: the profiler's "USDT: ... profiler_start" lines
    log = [json.loads(line) for line in (tmp_path / "r" / "log.jsonl").read_text().splitlines()]
    assert [r.get("traced", False) for r in log] == [False, True, False]
    assert load_record(tmp_path / "r" / "record.json").measured.step_time_s == log[2]["step_time_s"]  # not traced
    explained = fastml_here("explain", "r", "--trace", "both.json", cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    assert "the measured step of r/trace.json beside the simulated one" in " ".join(explained.stdout.split())
    events = json.loads((tmp_path / "both.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names[0] == "simulated" and all(n.startswith("measured") for pid, n in names.items() if pid != 0)
    simulated = [e for e in events if e.get("ph") == "X" and e["pid"] == 0]
    measured = [e for e in events if e.get("ph") == "X" and e["pid"] != 0]
    assert min(e["ts"] for e in simulated) == 0 and min(e["ts"] for e in measured) == 0
    assert any(e["name"] == "Optimizer.step#AdamW.step" for e in measured)  # the step's own ops, measured
    assert any(e["name"].startswith("fwd L0") for e in simulated)


def test_a_measured_process_without_a_name_is_named_by_its_pid():
    """REVIEW: a process of the measured trace showed as "measured: " (the profiler names some processes "")."""
    from fastml.planner.simulate import beside_measured

    measured = {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 7, "args": {"name": ""}},
                                {"name": "process_name", "ph": "M", "pid": 8, "args": {"name": "python"}},
                                {"name": "k", "ph": "X", "pid": 9, "tid": 0, "ts": 5.0, "dur": 1.0}]}
    events = beside_measured({"traceEvents": []}, measured)["traceEvents"]
    assert sorted(e["args"]["name"] for e in events if e.get("name") == "process_name") == [
        "measured: process 7", "measured: process 9", "measured: python", "simulated"]


def test_a_trace_needs_a_run_directory_and_a_step_that_runs(tmp_path):
    assert plan_here(tmp_path) == 0
    ran = fastml_here("run", "p.json", "--steps", "3", "--no-progress", "--trace-step", "4", cwd=tmp_path)
    assert ran.returncode != 0 and "--trace-step: 4 is outside the allowed range [1, 3]" in ran.stderr
