"""`fastml` commands run in the test's own process, through fastml.cli.main: a `fastml run` started as a process spends
seconds (most of its time, on the 2-core test machine) importing torch and its compiler, which this process imported
once. Each command still runs as a real process in at least one test (plan, run, profile and explain in
tests/test_cli.py, calibrate in tests/test_calibrate.py, generate in tests/test_generate.py, convert in
tests/test_distributed.py, prepare in tests/test_cli.py)."""

import contextlib
import io
import os
import subprocess
from pathlib import Path


def fastml_here(*args, cwd: Path) -> subprocess.CompletedProcess:
    """`fastml ARGS` in the working directory `cwd`, in this process: its exit code, stdout and stderr, as a process's
    would be."""
    from fastml.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(arg) for arg in args])
            except SystemExit as e:  # argparse's usage errors, and cmd_run's exit codes
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["fastml", *args], code, out.getvalue(), err.getvalue())
