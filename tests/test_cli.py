"""End to end through the `fastml` command: plan, run, and user errors as one line with exit code 2."""

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from in_process import fastml_here


def fastml(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastml", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def fastml_all(*commands, cwd) -> list[subprocess.CompletedProcess]:
    """Several `fastml` commands at once: a start is seconds of imports on one core, so two cores start two."""
    started = [subprocess.Popen([sys.executable, "-m", "fastml", *args], cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for args in commands]
    done = []
    for args, process in zip(commands, started):
        out, err = process.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """`fastml plan -o p.json` then `fastml run p.json` for 8 steps: the directory, and the two commands' results."""
    path = tmp_path_factory.mktemp("main-job")
    planned = fastml("plan", "-o", "p.json", cwd=path)
    ran = fastml("run", "p.json", "--steps", "8", "--log-json", "log.jsonl", "--no-progress", cwd=path)
    return path, planned, ran


def test_plan_then_run_trains_and_the_loss_falls(main_job):
    """The main job as the README gives it: the last 3 of 8 steps average at least 10% below the first 3 (about 23%
    below on the 2-core machine the tests are developed on)."""
    tmp_path, planned, result = main_job
    assert planned.returncode == 0, planned.stderr
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("step", "loss", "lr", "step_time_s", "tokens_per_s", "mfu", "peak_gpu_memory_bytes",
                "peak_host_memory_bytes"):
        assert key in records[0]
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last <= 0.9 * first, (first, last)
    # The report on stdout (`> out.txt` keeps it); notes and progress on stderr.
    assert "knobs: " in result.stdout and "measured" in result.stdout and "run record: runs/" in result.stdout
    assert "measured" not in result.stderr and "knobs: " not in result.stderr


def one_line_error(result, *fragments):
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_user_errors_are_one_line(tmp_path):
    (tmp_path / "bad.json").write_text('{"model": ')
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    missing, bad, gpt9, seq, recompute, hf = fastml_all(
        ["run", "missing.json"], ["run", "bad.json"], ["plan", "--model", "gpt-9"], ["plan", "--seq", "abc"],
        ["plan", "--set", "knobs.recompute=everything"], ["plan", "--model", "hf"], cwd=tmp_path)
    one_line_error(missing, "missing.json", "no such plan file")
    one_line_error(bad, "not valid JSON")
    one_line_error(gpt9, "gpt-9", "neither a preset")
    one_line_error(seq, "invalid int value")
    one_line_error(recompute, "knobs.recompute[0]")
    one_line_error(hf, "model_type 'gpt2' is not supported")


def test_data_is_checked_when_planning(tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    prepared, nowhere, planned, nothing = fastml_all(
        ["prepare", "--input", "short.txt", "-o", "short"], ["plan", "--data", "nowhere", "-o", "refused.json"],
        ["plan", "--trials", "10", "-o", "p.json"], ["prepare", "--input", "nothing-*.txt", "-o", "x"], cwd=tmp_path)
    assert prepared.returncode == 0 and planned.returncode == 0, prepared.stderr + planned.stderr
    one_line_error(nowhere, "nowhere", "not a directory")
    one_line_error(nothing, "nothing-*.txt")
    short, ran = fastml_all(["plan", "--data", "short", "-o", "refused.json"],
                            ["run", "p.json", "--steps", "1", "--set", "training.data=short"], cwd=tmp_path)
    one_line_error(short, "short", "seq_len 256 needs")
    assert not (tmp_path / "refused.json").exists()
    one_line_error(ran, "tokens")  # the plan did not name the data: the run checks again


def test_vocab_mismatch_is_refused_when_planning(tmp_path):
    """(The data prepared in this process: `fastml prepare` runs as a command in the test above.)"""
    from fastml.cli import main

    (tmp_path / "t.txt").write_text("some text " * 200)
    assert main(["prepare", "--input", str(tmp_path / "t.txt"), "-o", str(tmp_path / "d")]) == 0
    one_line_error(fastml("plan", "--data", "d", "--set", "model.vocab_size=128", "-o", "p.json", cwd=tmp_path),
                   "vocab size 257", "the model has 128")


def test_prepare_counts_one_document_as_one(tmp_path, capsys):
    """REVIEW: "1 documents"."""
    from fastml.cli import main

    (tmp_path / "one.txt").write_text("a single document " * 20)
    assert main(["prepare", "--input", str(tmp_path / "one.txt"), "-o", str(tmp_path / "data")]) == 0
    assert "361 tokens from 1 document (vocab 257" in capsys.readouterr().out  # 360 bytes and an end of text


def test_plan_output_starts_at_once_with_a_readable_parameter_count(main_job):
    # A search longer than SearchProgress.SHOW_AFTER_S (on a loaded 2-core machine) prints its progress lines before
    # the plan, by design, which is not what this test is about: they are left out.
    _, result, _ = main_job
    assert result.returncode == 0, result.stderr
    output = "".join(line for line in result.stdout.splitlines(keepends=True) if not line.startswith("planning on "))
    assert output.startswith("tiny (3.21M parameters), seq 256"), result.stdout


def test_plan_help_names_every_profile_and_the_batch_per_gpu():
    from fastml.cli import parser

    text = " ".join(parser()._subparsers._group_actions[0].choices["plan"].format_help().split())
    assert ", cpu, " in text and ", h200, " in text
    assert "(default: 16 sequences per GPU)" in text


def test_pytest_shows_skip_reasons(tmp_path):
    """The README runs `python -m pytest -q`: GPU tests skipped on a CPU machine say why."""
    (tmp_path / "test_skips.py").write_text("import pytest\n\n\ndef test_x():\n    pytest.skip('no GPU here')\n")
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(pyproject), "--rootdir", str(tmp_path),
                             "-p", "no:cacheprovider", str(tmp_path / "test_skips.py")], capture_output=True,
                            text=True, timeout=120)
    assert "no GPU here" in result.stdout, result.stdout


def test_dollars_per_million_tokens_print_one_way():
    from rich.console import Console
    from fastml.planner import report
    from fastml.planner.planner import make_plan

    plan = make_plan(model="tiny", hw="h200", gpus=1, trials=5).plan
    for usd, shown in ((1234.5, "$1234.50"), (0.0123, "$0.0123")):
        priced = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, usd_per_million_tokens=usd))
        breakdown, ranking = io.StringIO(), io.StringIO()
        report.print_breakdown(Console(file=breakdown, width=300), priced)
        report.print_ranking(Console(file=ranking, width=300), [("h200", priced, "")])
        assert shown in breakdown.getvalue() and shown in ranking.getvalue()


def test_search_progress_shows_after_a_second_then_every_few_seconds():
    """Off a terminal (a pipe, a log): a plain line once the search has run a second, then one every 5 s."""
    from rich.console import Console
    from fastml.cli import SearchProgress

    out = io.StringIO()
    seconds = iter([0.0, 0.5, 1.2, 3.0, 6.5])
    progress = SearchProgress(Console(file=out, width=200), "h200", clock=lambda: next(seconds))
    progress(1, 300, 0.0)
    assert out.getvalue() == ""
    progress(2, 300, 0.0)
    progress(3, 300, 1500.0)
    progress(4, 300, 2000.0)
    progress.close()
    assert out.getvalue().splitlines() == ["planning on h200: trial 2/300, nothing fits yet (1 s)",
                                           "planning on h200: trial 4/300, best 2,000 tokens/s (6 s)"]


def test_search_progress_is_a_live_line_on_a_terminal():
    from rich.console import Console
    from fastml.cli import SearchProgress

    out = io.StringIO()
    seconds = iter([0.0, 0.5, 1.5])
    progress = SearchProgress(Console(file=out, width=200, force_terminal=True), None,
                              clock=lambda: next(seconds))
    progress(1, 300, 100.0)
    assert out.getvalue() == ""
    progress(2, 300, 1234.0)
    progress.close()
    assert "planning on this machine: trial 2/300, best 1,234 tokens/s" in out.getvalue()


def test_gpu_plan_on_a_cpu_machine_is_refused(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    refused, planned = fastml_all(["plan", "--device", "cuda"],
                                  ["plan", "--set", "hardware.device=cuda", "--trials", "10", "-o", "p.json"],
                                  cwd=tmp_path)
    one_line_error(refused, "--device", "no CUDA GPU")
    assert planned.returncode == 0, planned.stderr
    # (In this process: a refused `fastml run` of a plan for other hardware runs as a command below.)
    one_line_error(fastml_here("run", "p.json", cwd=tmp_path), "hardware.device", "no")


def test_plan_json_explain_and_trace(tmp_path):
    result = fastml("plan", "--model", "llama-3.1-8b", "--hw", "h200", "--gpus", "1", "--trials", "60", "--json",
                    "-o", "p.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    predicted = printed["plan"]["predicted"]
    assert set(predicted["memory_bytes"]) == {"weights", "master_weights", "gradients", "optimizer_states",
                                              "activations", "workspace", "comm_buffers"}
    assert set(predicted["time_s"]) == {"compute", "recompute", "exposed_comm", "exposed_offload", "optimizer",
                                        "other"}
    assert predicted["usd_per_million_tokens"] > 0 and predicted["kwh_per_million_tokens"] > 0
    assert json.loads((tmp_path / "p.json").read_text()) == printed["plan"]
    assert printed["limit"].startswith("limited by ") and printed["why"]
    assert len(printed["runners_up"]) == 3
    explained = fastml("explain", "p.json", "--json", "--trace", "t.json", cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr
    again = json.loads(explained.stdout)
    assert again["plan"]["predicted"]["step_time_s"] == pytest.approx(predicted["step_time_s"])
    assert again["critical_path"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    table = fastml("explain", "p.json", cwd=tmp_path)
    assert table.returncode == 0 and "step time by component" in table.stdout


def test_no_feasible_plan_is_one_line(tmp_path):
    one_line_error(fastml_here("plan", "--model", "llama-3.1-70b", "--hw", "rtx4090", "--gpus", "1", "--host-mem",
                               "64GiB", "--trials", "40", cwd=tmp_path), "no feasible plan", "host memory", "--host-mem",
                   "--set knobs.master_dtype=bf16 ")


def test_several_machines_are_ranked_by_cost(tmp_path):
    result = fastml_here("plan", "--model", "tinyllama-1.1b", "--hw", "h200,h100-sxm,rtx4090", "--gpus", "1",
                         "--trials", "40", "-o", "p.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ranked by cost per million tokens" in result.stdout
    assert "limited by " in result.stdout and "the first runner-up" in result.stdout
    for name in ("h200", "h100-sxm", "rtx4090"):
        assert name in result.stdout


def test_a_ranking_shows_the_gpus_and_ranks_a_model_that_tells_gpus_apart(tmp_path):
    """REVIEW 17: the ranking had no GPU count and ranked the tiny default model, which tells GPUs apart by nothing but
    their price. Without --model it ranks RANKING_MODEL, and says so."""
    from rich.console import Console
    from fastml.planner import report
    from fastml.planner.planner import make_plan
    from fastml.planner.request import RANKING_MODEL

    result = fastml_here("plan", "--hw", "h200,rtx4090", "--trials", "20", "-o", "p.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"note: ranking the hardware for {RANKING_MODEL}" in " ".join(result.stdout.split())
    assert json.loads((tmp_path / "p.json").read_text())["model"]["name"] == RANKING_MODEL
    plans = [make_plan(model="tiny", hw="h100-sxm", gpus=8, nodes=nodes, trials=5).plan for nodes in (1, 2)]
    out = io.StringIO()
    report.print_ranking(Console(file=out, width=300), [("one", plans[0], ""), ("two", plans[1], "")])
    rows = ([cell.strip() for cell in re.split("[│┃]", line)] for line in out.getvalue().splitlines())
    cells = {row[1]: row[2] for row in rows if len(row) > 2}
    assert cells == {"hardware": "GPUs", "one": "8", "two": "2 x 8"}


def test_a_plan_for_other_hardware_does_not_run_here(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert fastml_here("plan", "--model", "tiny", "--hw", "h200", "--trials", "20", "-o", "p.json",
                       cwd=tmp_path).returncode == 0
    one_line_error(fastml("run", "p.json", "--steps", "1", cwd=tmp_path), "hardware.device")


def test_profile_writes_a_loadable_profile(tmp_path):
    """`fastml profile` measures this CPU (GPU machines: tests/test_profile.py) into a profile that plans."""
    from fastml.hwprofiles.profile import detect_topology
    from fastml.planner.hardware import load_machine

    before = detect_topology()["host"]["memory_bytes"]
    result = fastml("profile", "-o", "hw.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "hw.json").read_text())["name"]
    host_memory = load_machine(str(tmp_path / "hw.json")).node.host_memory_bytes
    after = detect_topology()["host"]["memory_bytes"]
    assert min(before, after) <= host_memory <= max(before, after)  # a VM's memory may change meanwhile
    assert fastml_here("plan", "--hw", "hw.json", "--trials", "10", "-o", "p.json", cwd=tmp_path).returncode == 0


def test_the_suite_keeps_out_of_the_users_cache():
    """REVIEW 7: the test above overwrote the user's cached CPU profile (`fastml profile` with the FASTML_CACHE the
    suite inherited). tests/conftest.py gives the session its own cache, which the `fastml` subprocesses inherit."""
    import os
    from fastml import hwprofiles

    users = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastml"
    session = hwprofiles.cache_dir()
    assert session.resolve() != users.resolve() and session.name.startswith("fastml-test-cache-")
    assert os.environ["FASTML_CACHE"] == str(session)


def test_a_cpu_among_ranked_machines_and_a_missing_fp8(tmp_path):
    ranked, fp8 = fastml_all(["plan", "--model", "tiny", "--hw", "cpu,h200", "--gpus", "1", "--trials", "10", "-o",
                              "p.json"],
                             ["plan", "--hw", "a100-80gb", "--gpus", "1", "--set", 'knobs.matmul_dtype="fp8"',
                              "--trials", "10"], cwd=tmp_path)
    assert ranked.returncode == 0, ranked.stderr
    assert "A CPU's plans are not priced" in ranked.stdout and "the cheapest: h200" in ranked.stdout
    assert "1 (CPU)" in ranked.stdout
    one_line_error(fp8, "knobs.matmul_dtype", "no fp8 tensor cores")


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_a_low_precision_pin_on_a_cpu_is_one_line_naming_it(tmp_path, dtype):
    """REVIEW 8: an Optuna traceback (22-39 lines) before the error, which named bf16 and "this GPU" when fp8 was asked
    for on a CPU."""
    result = fastml("plan", "--device", "cpu", "--set", f"knobs.matmul_dtype={dtype}", cwd=tmp_path)
    one_line_error(result, f"knobs.matmul_dtype: '{dtype}': this CPU computes in fp32 only")
    assert "GPU" not in result.stderr
