"""The `fastml` command: each subcommand parses its arguments and calls one plain function.

Planner and executor are imported only by the subcommands that need them. A user error is one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from fastml.config import UserError, check_output_file, check_range, fail, gib, plural, say_on_stderr, show


def cmd_plan(args: argparse.Namespace) -> None:
    from rich.console import Console
    from fastml.plan import save_plan
    from fastml.planner import report
    from fastml.planner.planner import NoFeasiblePlan, make_plan, requested_model, reshaped_model
    from fastml.planner.request import RANKING_MODEL, PlanRequest

    console = Console(stderr=args.json)
    hardware = args.hw.split(",") if args.hw else [None]
    renamed = {"seq_len": "seq", "overrides": "set"}  # request field: argparse dest
    request = PlanRequest(**{f.name: getattr(args, renamed.get(f.name, f.name))
                             for f in dataclasses.fields(PlanRequest)})
    if args.model is None and args.init_from is None and len(hardware) > 1:
        request = dataclasses.replace(request, model=RANKING_MODEL)
        console.print(f"[yellow]note:[/] ranking the hardware for {RANKING_MODEL} (tiny, the default model, is too "
                      f"small to tell GPUs apart); name the model to train with --model")
    spec = reshaped_model(requested_model(request)[0], request.overrides)
    check_data(request.data, request.seq_len_for(spec.name), spec.vocab_size)  # before a search that may be long
    results = []
    for hw in hardware:
        try:
            with _trial_progress(console, hw) as on_trial:
                results.append((hw, make_plan(dataclasses.replace(request, hw=hw), on_trial=on_trial), ""))
        except NoFeasiblePlan as e:
            if len(hardware) == 1:
                raise
            results.append((hw, None, str(e)))
    feasible = [r for r in results if r[1] is not None]
    if not feasible:
        raise UserError("no feasible plan on any of " + ", ".join(hardware))
    hw, best, _ = min(feasible, key=lambda r: _usd_per_million_tokens(r[1].plan))
    check_data(best.plan.training.data, best.plan.training.seq_len, best.plan.model.vocab_size)  # after --set
    save_plan(best.plan, args.output)
    if best.stale_calibration:  # on stderr with --json
        console.print(f"[yellow]warning:[/] {best.stale_calibration}")
    for note in best.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if args.json:
        print(json.dumps(report.plan_json(best.plan, best.runners_up, best.limit), indent=2))
    else:
        report.print_plan(console, best.plan, best.runners_up, best.limit)
        if len(hardware) > 1:
            report.print_ranking(console, [(h or "here", r and r.plan, note) for h, r, note in results])
        if best.lower_precision:
            console.print("[yellow]note:[/] fits only with lower-precision knobs (fp8 matmuls or bf16 optimizer "
                          "states/master weights); pass --full-precision to refuse them")
    console.print(f"wrote {args.output}" + (f" (the cheapest: {hw})" if len(hardware) > 1 else ""))


def _usd_per_million_tokens(plan) -> float:
    """A plan's price; a CPU's plans are not priced, so they rank after every priced one."""
    return math.inf if plan.hardware.device == "cpu" else plan.predicted.usd_per_million_tokens


def cmd_explain(args: argparse.Namespace) -> None:
    from rich.console import Console
    from fastml.plan import load_plan
    from fastml.planner import report
    from fastml.planner.calibrate import stale_calibration
    from fastml.planner.explain import limit
    from fastml.planner.planner import predicted, replan
    from fastml.record import TRACE_FILE
    from fastml.planner.simulate import beside_measured, chrome_trace

    run_dir = Path(args.plan) if Path(args.plan).is_dir() else None
    plan = load_plan(run_dir / "plan.json" if run_dir else args.plan)
    candidate, problem, changed = replan(plan, args.hw)
    for note in (changed, stale_calibration(problem.machine.calibration, problem.machine.profile)):
        if note:
            Console(stderr=args.json).print(f"[yellow]warning:[/] {note}")
    if not candidate.feasible:
        raise UserError(f"{args.plan}: these knobs do not fit in memory on {plan.hardware.profile} "
                        f"(GPU over by {gib(candidate.gpu_over_bytes)}, host over by {gib(candidate.host_over_bytes)})")
    plan = dataclasses.replace(plan, predicted=predicted(problem, candidate, plan.training.eval_tokens))
    measured = run_dir / TRACE_FILE if run_dir and (run_dir / TRACE_FILE).is_file() else None
    if args.trace:
        trace = chrome_trace(candidate.simulation)
        Path(args.trace).write_text(json.dumps(beside_measured(trace, json.loads(measured.read_text()))
                                               if measured else trace))
    if args.json:
        print(json.dumps(report.plan_json(plan, limit=limit(problem, candidate))
                         | {"critical_path": candidate.simulation.critical_path}, indent=2))
        return
    console = Console()
    report.print_plan(console, plan, limit=limit(problem, candidate))
    console.print(f"critical path: {len(candidate.simulation.critical_path)} ops, from "
                  f"{candidate.simulation.critical_path[0]!r} to {candidate.simulation.critical_path[-1]!r}")
    if args.trace:
        beside = f", the measured step of {measured} beside the simulated one" if measured else (
            f" (simulated only: {run_dir} holds no measured step; `fastml run --trace-step N` records one)"
            if run_dir else "")
        console.print(f"wrote trace {args.trace}{beside} (open in https://ui.perfetto.dev)")


def cmd_calibrate(args: argparse.Namespace) -> None:
    from rich.console import Console
    from fastml.record import load_record
    from fastml.planner.calibrate import calibrate
    from fastml.planner.hardware import read_profile
    from fastml.planner import report
    from fastml.planner.planner import cpu_profile_for

    records = {(path.parent.name if path.name == "record.json" else path.stem): load_record(path)
               for path in _record_paths(args.records)}
    names = sorted({r.plan.hardware.profile for r in records.values()})
    on_cpu = all(r.plan.hardware.device == "cpu" for r in records.values())
    hw = args.hw or ("cpu" if on_cpu else names[0] if len(names) == 1 else None)
    if hw is None:
        fail("--hw", f"the records were planned for {', '.join(names)}: name the profile to calibrate")
    output = Path(args.output or f"{Path(hw).stem}-calibrated.json")
    check_output_file("-o", output)
    # This CPU's profile is measured for the records' own shapes (the plain "cpu" profile is measured for tiny's).
    profile = cpu_profile_for([r.plan for r in records.values()]) if hw == "cpu" and on_cpu else read_profile(hw)
    fitted, fits = calibrate(records, profile)
    output.write_text(json.dumps(fitted, indent=2) + "\n")
    report.print_calibration(Console(), fits, fitted["calibration"])
    print(f"wrote {output}: plan with --hw {output}")


def _record_paths(given: list[str]) -> list[Path]:
    """Record files, or run directories holding one (`fastml run --run-dir`)."""
    paths = [Path(p) / "record.json" if Path(p).is_dir() else Path(p) for p in given]
    for path in paths:
        if not path.is_file():
            fail(str(path), "no such run record (a record.json, or the run directory that holds it)")
    return paths


def cmd_profile(args: argparse.Namespace) -> None:
    from fastml.hwprofiles.profile import profile

    profile(args.output, quick=args.quick)


def check_data(data, seq_len: int, vocab_size: int) -> None:
    """The dataset (or each of a blend) exists, holds a sequence and fits the model's vocabulary: checked when
    planning rather than when the run starts. The default corpus alone is built on first use, by the run."""
    if data != "default":
        from fastml.executor.storage.data import open_training_data

        open_training_data(data, seq_len, vocab_size)


class SearchProgress:
    """The search's trials so far and the best tokens/s, once it has run for SHOW_AFTER_S: a live line on a
    terminal, else (a pipe, a log file) a plain line every LOG_EVERY_S. Called as `on_trial(done, trials, best)`
    (fastml.planner.planner.make_plan).

    rich draws a live display only on a terminal: the progress bar this replaces showed nothing in a pipe or a log
    but a blank line, and sat at 0 while the search seeded itself."""

    SHOW_AFTER_S = 1.0
    LOG_EVERY_S = 5.0

    def __init__(self, console, hw: str | None, clock=time.monotonic):
        self.console, self.clock = console, clock
        self.where = hw or "this machine"
        self.started_s = clock()
        self.live = None
        self.logged_s = None

    def __call__(self, done: int, trials: int, best_tokens_per_s: float) -> None:
        elapsed_s = self.clock() - self.started_s
        if elapsed_s < self.SHOW_AFTER_S:
            return
        best = f"best {best_tokens_per_s:,.0f} tokens/s" if best_tokens_per_s else "nothing fits yet"
        line = f"planning on {self.where}: trial {done}/{trials}, {best} ({elapsed_s:.0f} s)"
        if self.console.is_terminal and not self.console.is_dumb_terminal:
            self._show_live(line)
        elif self.logged_s is None or elapsed_s - self.logged_s >= self.LOG_EVERY_S:
            self.console.print(line, highlight=False)
            self.logged_s = elapsed_s

    def _show_live(self, line: str) -> None:
        from rich.live import Live
        from rich.text import Text

        if self.live is None:
            self.live = Live(console=self.console, transient=True, refresh_per_second=8, redirect_stdout=False,
                             redirect_stderr=False)
            self.live.start()
        self.live.update(Text(line))

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


@contextlib.contextmanager
def _trial_progress(console, hw: str | None):
    """The search's progress (`SearchProgress`), as a context manager yielding the per-trial callback."""
    progress = SearchProgress(console, hw)
    try:
        yield progress
    finally:
        progress.close()


def cmd_run(args: argparse.Namespace) -> None:
    from fastml.plan import load_plan, parse_assignment, with_overrides

    overrides = list(args.set)
    if args.checkpoint_dir is not None:
        overrides.append(f"training.checkpoint_dir={args.checkpoint_dir}")
    if args.checkpoint_interval is not None:
        overrides.append(f"training.checkpoint_interval={args.checkpoint_interval}")
    plan = with_overrides(load_plan(args.plan), overrides)  # before torch's import: a bad plan is said at once
    from fastml.executor.parallel.launch import WorkersFailed
    from fastml.executor.loop.train import TrainingStopped, train
    from fastml.executor.parallel.world import EXIT_OTHER_RANK, launched

    if args.gpu_mem is not None:
        from fastml.executor.loop.device import with_gpu_memory_cap
        from fastml.planner.hardware import parse_bytes

        plan = with_gpu_memory_cap(plan, parse_bytes(args.gpu_mem, "--gpu-mem"))
    world = launched()
    # Given here, the interval replaces a resumed run's; else the resumed run keeps its own.
    interval_given = any(parse_assignment(o)[:2] == ("training", "checkpoint_interval") for o in overrides)
    try:
        train(plan, steps=args.steps, log_json=args.log_json, show_progress=not args.no_progress,
              resume=args.resume, start_over=args.start_over, keep_checkpoints=args.keep_checkpoints,
              max_nonfinite_steps=args.max_nonfinite_steps, strict=args.strict, timeout_s=args.timeout,
              summary_json=args.summary_json, run_dir=args.run_dir or _new_run_dir(), trace_step=args.trace_step,
              checkpoint_interval=plan.training.checkpoint_interval if interval_given else None,
              tensorboard=args.tensorboard, wandb=args.wandb, sample_every=args.sample_every,
              sample_prompt=args.sample_prompt)
    except (TrainingStopped, WorkersFailed) as e:
        if world is None or world.main:  # every rank stops alike; rank 0 says why
            _say_failure(f"fastml: {e}")
        sys.exit(e.exit_code)
    except Exception as e:
        import torch.distributed as dist

        # NCCL reports a lost rank as a DistError, gloo as a RuntimeError naming its transport.
        lost = isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e))
        if world is None or not world.distributed or not lost:
            raise
        _say_failure(f"fastml: rank {world.rank}: lost contact with the other ranks ({_backend_says(e)})")
        sys.exit(EXIT_OTHER_RANK)


def _new_run_dir() -> Path:
    """runs/TIME in the working directory, TIME to the second; a suffix where two runs start in the same second."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, suffix = Path("runs") / stamp, 1
    while path.exists():
        suffix += 1
        path = Path("runs") / f"{stamp}-{suffix}"
    return path


def cmd_prepare(args: argparse.Namespace) -> None:
    from fastml.executor.storage.data import TokenData
    from fastml.executor.storage.prepare import prepare

    header = prepare(args.input, args.output, tokenizer=args.tokenizer, field=args.field,
                     validation_fraction=args.validation_fraction, validation_inputs=args.validation or [])
    print(f"wrote {args.output}: {plural(header['num_tokens'], 'token')} from "
          f"{plural(header['num_documents'], 'document')} (vocab {header['vocab_size']:,}, {header['dtype']})")
    validation = TokenData.open_validation(args.output, 1, header["vocab_size"])
    if validation is not None:
        held = validation.header
        print(f"  and a validation split of {plural(held.num_tokens, 'token')} from "
              f"{plural(held.num_documents, 'document')} in {validation.path}")


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from fastml.executor.model.generate import generate
    from fastml.executor.storage.checkpoints import load_for_inference, tokenizer_of
    from fastml.executor.storage.prepare import load_tokenizer

    named = args.tokenizer or tokenizer_of(args.checkpoint)
    if named is None:
        raise UserError(f"{args.checkpoint}: which tokenizer its weights were trained with is not known (a converted "
                        f"checkpoint); give --tokenizer tokenizer.json, or bytes")
    tokenizer = load_tokenizer(named)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_for_inference(args.checkpoint, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if tokenizer.vocab_size > model.spec.vocab_size:
        raise UserError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} tokens, more than the model's "
                        f"{model.spec.vocab_size:,}: not the one it was trained with")
    prompt = tokenizer.encode_batch([args.prompt])[0].tolist() or [tokenizer.eos_id]  # "": a document's start
    print(args.prompt, end="", flush=True)
    before = tokenizer.decode(prompt)
    made, shown = [], 0
    for token in generate(model, prompt, args.max_tokens, args.temperature, args.top_p, args.seed, tokenizer.eos_id,
                          tokenizer.vocab_size):
        made.append(token)
        # Decoded with the prompt: a token alone may be half a character, or lose the space before it.
        text = tokenizer.decode(prompt + made)[len(before):]
        if not text.endswith("\ufffd"):
            print(text[shown:], end="", flush=True)
            shown = len(text)
    print(tokenizer.decode(prompt + made)[len(before):][shown:])


def cmd_convert(args: argparse.Namespace) -> None:
    from fastml.executor.storage.hf import convert_from_hf, convert_to_hf

    if bool(args.from_hf) == bool(args.to_hf):
        raise UserError("convert: give either --from-hf DIR -o OUT, or CHECKPOINT --to-hf DIR")
    if args.from_hf:
        if not args.output:
            raise UserError("convert --from-hf: give the output checkpoint directory with -o")
        convert_from_hf(args.from_hf, args.output)
        print(f"wrote fastml checkpoint {args.output}")
    else:
        if not args.checkpoint:
            raise UserError("convert --to-hf: give the fastml checkpoint directory to convert")
        convert_to_hf(args.checkpoint, args.to_hf)
        print(f"wrote HF model {args.to_hf}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Bad command-line usage is a user error too: one line, exit code 2."""
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def check_args(args: argparse.Namespace) -> None:
    """The values argparse cannot check by type alone, each refused with the option's name before any work."""
    from fastml.plan import MAX_GLOBAL_BATCH_TOKENS, MAX_NUM_GPUS, MAX_STEPS
    from fastml.spec import MAX_SEQ_LEN

    # Counts, wherever a subcommand has them, within the same bounds as the plan's fields.
    counts = {"steps": (1, MAX_STEPS), "seq": (1, MAX_SEQ_LEN), "global_batch_tokens": (1, MAX_GLOBAL_BATCH_TOKENS),
              "gpus": (1, MAX_NUM_GPUS), "nodes": (1, MAX_NUM_GPUS), "trials": (1, None),
              "checkpoint_interval": (0, MAX_STEPS)}
    for name, (low, high) in counts.items():
        if getattr(args, name, None) is not None:
            check_range(_option(name), getattr(args, name), low, high)
    for name in ("gpu_mem", "host_mem"):
        value = getattr(args, name, None)
        if value is not None:
            from fastml.planner.hardware import parse_bytes

            check_range(_option(name), parse_bytes(value, _option(name)), 1)
    if getattr(args, "hw", None):
        from fastml import hwprofiles

        for hw in args.hw.split(","):
            if hw not in hwprofiles.names() and not hw.endswith(".json") and not Path(hw).is_file():
                fail("--hw", f"{show(hw)} is neither a shipped profile ({', '.join(hwprofiles.names())}) nor a "
                             "profile JSON file")
    if getattr(args, "study", None) and not Path(args.study).expanduser().parent.is_dir():
        fail("--study", f"{args.study}: its directory does not exist")
    for name in getattr(args, "writes", ()):  # the files a subcommand writes at its end
        if getattr(args, name) is not None:
            check_output_file("-o" if name == "output" else _option(name), getattr(args, name))


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _backend_says(error: Exception) -> str:
    """The first sentence of a collective backend's error, without the source file it names first."""
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", _one_line(str(error)))
    return text.split(". ")[0].rstrip(".")[:200]


def _say_failure(line: str) -> None:
    """Why the command failed, in one line on stderr. In a worker of torch's elastic launcher (torchrun, or `fastml
    run`'s own) also into the error file it gave the worker, in the layout of torch's ErrorHandler, so that the
    report torchrun prints after its workers have failed shows this line as the root cause, not a link to torch's
    documentation."""
    say_on_stderr(line)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError):  # the line above has said it
            Path(error_file).write_text(json.dumps({"message": {
                "message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}))


def _rank_prefix() -> str:
    """"rank N: " in a worker of a job of several ranks but rank 0, else nothing."""
    rank = os.environ.get("RANK")
    return f"rank {rank}: " if rank not in (None, "0") and os.environ.get("WORLD_SIZE", "1") != "1" else ""


def _one_line(message: str) -> str:
    """An error message as one line, whatever a user's path or value held."""
    return " ".join(message.splitlines())


def _add_plan_command(sub) -> None:
    from fastml import hwprofiles
    from fastml.planner.request import DEFAULT_MODEL, DEFAULT_SEQ_LEN, RANKING_MODEL, TINY_SEQ_LEN, PlanRequest

    plan = sub.add_parser("plan", help="search the fastest plan that fits and write it")
    plan.add_argument("--model", help=f"a preset name, or an HF model directory, whose weights the run then starts "
                                      f"from (default: the model of --init-from, else {DEFAULT_MODEL}; ranking "
                                      f"several --hw, {RANKING_MODEL})")
    plan.add_argument("--init-from", metavar="DIR",
                      help="start the run from these weights: a fastml checkpoint (`fastml convert --from-hf` "
                           "output, or a training checkpoint DIR/step-N of an earlier run) or an HF model directory; "
                           "'' for random weights (default: those of an HF --model, else random)")
    plan.add_argument("--seq", type=int,
                      help=f"sequence length (default: {TINY_SEQ_LEN} for tiny, else {DEFAULT_SEQ_LEN})")
    plan.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step, over all GPUs "
                                                                 "(default: 16 sequences per GPU)")
    plan.add_argument("--steps", type=int, default=PlanRequest.steps,
                      help=f"optimizer steps (default: {PlanRequest.steps})")
    plan.add_argument("--data", default=PlanRequest.data,
                      help="a directory from `fastml prepare` (default: Python's own source, shipped with it)")
    plan.add_argument("--hw", help=f"a profile ({', '.join(hwprofiles.names())}; cpu: this machine's CPU), a "
                                   "profile JSON file, or several separated by commas to rank them (default: this "
                                   "machine)")
    plan.add_argument("--gpus", type=int, help="GPUs per node (default: the profile's; for this machine, all of its "
                                               "GPUs); with --device cpu, CPU processes sharing this CPU")
    plan.add_argument("--nodes", type=int, help="nodes (default: 1; more need --hw)")
    plan.add_argument("--gpu-mem", help="cap the memory of each GPU, e.g. 16GiB")
    plan.add_argument("--host-mem", help="host memory per node, e.g. 256GiB (default: the profile's; for this "
                                         "machine, its memory)")
    plan.add_argument("--device", choices=["cpu", "cuda"], help="without --hw: plan for this machine's CPU or GPU")
    plan.add_argument("--no-profile", dest="measure", action="store_false",
                      help="on a GPU machine never profiled: plan with the shipped profile's figures instead of "
                           "measuring it first (about 20 s, once)")
    plan.add_argument("--trials", type=int, default=PlanRequest.trials,
                      help=f"search trials (default: {PlanRequest.trials})")
    plan.add_argument("--study", help="keep the search in this SQLite file, to resume or extend it")
    precision = plan.add_mutually_exclusive_group()
    precision.add_argument("--full-precision", dest="lower_precision", action="store_false", default=None,
                           help="never use fp8 matmuls or bf16 optimizer states")
    precision.add_argument("--lower-precision", dest="lower_precision", action="store_true",
                           help="search fp8 matmuls and bf16 optimizer states too (default: only if nothing else "
                                "fits)")
    plan.add_argument("--json", action="store_true", help="print the plan and runners-up as JSON")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="pin a value, e.g. --set knobs.micro_batch_size=8 (repeatable)")
    plan.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default: plan.json)")
    plan.set_defaults(func=cmd_plan, writes=("output",))


def _add_run_command(sub) -> None:
    run = sub.add_parser("run", help="train as a plan says")
    run.add_argument("plan", help="a plan.json")
    run.add_argument("--steps", type=int, help="optimizer steps (default: the plan's)")
    run.add_argument("--log-json", metavar="FILE", help="write one JSON object per optimizer step to FILE")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="override a value of the plan (repeatable)")
    run.add_argument("--no-progress", action="store_true", help="no live progress display")
    run.add_argument("--gpu-mem", help="cap this process's GPU memory, e.g. 16GiB, so that a large GPU behaves like a "
                                       "smaller one (overrides the plan's hardware.gpu_memory_bytes)")
    run.add_argument("--checkpoint-dir", help="write checkpoints here (overrides training.checkpoint_dir)")
    run.add_argument("--checkpoint-interval", type=int,
                     help="steps between checkpoints; 0: only at the end (overrides training.checkpoint_interval; "
                          "without it, --resume keeps the interval of the run it resumes)")
    run.add_argument("--keep-checkpoints", type=int, default=3,
                     help="keep the newest K intact checkpoints of the run (default: 3)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest intact checkpoint in the checkpoint directory (an error where it "
                          "holds none)")
    run.add_argument("--start-over", action="store_true",
                     help="start a new run in a checkpoint directory that holds an earlier run's checkpoints, moving "
                          "them into its old-run-TIME/ directory")
    run.add_argument("--max-nonfinite-steps", type=int, default=5,
                     help="stop after this many steps in a row with a NaN or infinite loss or gradient (default: 5)")
    run.add_argument("--strict", action="store_true",
                     help="refuse a plan made for another GPU than this machine's (else: warn); one this machine "
                          "cannot run (for a GPU it lacks) is refused either way")
    run.add_argument("--timeout", type=float, default=600,
                     help="with several GPUs: stop the job when its ranks wait this many seconds for one of them "
                          "(default: 600)")
    run.add_argument("--summary-json", metavar="FILE", help="write the run's summary (what the closing table "
                                                            "shows) as JSON to FILE")
    run.add_argument("--run-dir", help="the run's directory: its log (unless --log-json), plan and record, which "
                                       "`fastml calibrate` reads (default: runs/TIME)")
    run.add_argument("--trace-step", type=int, metavar="N",
                     help="trace optimizer step N with torch's profiler into the run directory's trace.json, which "
                          "`fastml explain RUN_DIR --trace` sets beside the simulated step (take one after the "
                          "first, which compiles; the traced step is left out of the steady-state figures)")
    run.add_argument("--tensorboard", metavar="DIR",
                     help="also write each step's figures as TensorBoard event files into DIR (needs tensorboard)")
    run.add_argument("--wandb", metavar="PROJECT",
                     help="also log each step's figures to this Weights & Biases project (needs wandb; "
                          "WANDB_MODE=offline keeps the run on disk)")
    run.add_argument("--sample-every", type=int, metavar="N",
                     help="print a greedy continuation of --sample-prompt every N steps (weights whole on one GPU)")
    run.add_argument("--sample-prompt", default="", metavar="TEXT",
                     help="the text samples continue (default: the start of a document)")
    run.set_defaults(func=cmd_run)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fastml", description="Plan and run memory- and communication-efficient LLM training.")
    sub = p.add_subparsers(dest="command", required=True)

    _add_plan_command(sub)
    explain = sub.add_parser("explain", help="the cost breakdown of a plan, re-simulated")
    explain.add_argument("plan", help="a plan.json, or a run's directory (`fastml run --run-dir`)")
    explain.add_argument("--json", action="store_true", help="machine-readable output")
    explain.add_argument("--trace", metavar="FILE", help="write the simulated step as a Chrome/Perfetto trace; for a "
                                                         "run traced with --trace-step, beside the measured step")
    explain.add_argument("--hw", help="the profile JSON file the plan was made with, when it is not a shipped one")
    explain.set_defaults(func=cmd_explain, writes=("trace",))

    cal = sub.add_parser("calibrate", help="fit a hardware profile to what runs on its machine measured")
    cal.add_argument("records", nargs="+", help="run records (record.json) or the run directories holding them")
    cal.add_argument("--hw", help="the profile to fit: a shipped name or a profile JSON file (default: the one the "
                                  "records' plans name)")
    cal.add_argument("-o", "--output", help="where to write the fitted profile (default: PROFILE-calibrated.json)")
    cal.set_defaults(func=cmd_calibrate)

    prof = sub.add_parser("profile", help="detect the GPUs and their topology, and write a hardware profile")
    prof.add_argument("-o", "--output", default="hwprofile.json", help="where to write it (default: hwprofile.json)")
    prof.add_argument("--quick", action="store_true", help="fewer sizes and smaller copies (under 20 s)")
    prof.set_defaults(func=cmd_profile, writes=("output",))

    _add_run_command(sub)
    prep = sub.add_parser("prepare", help="tokenize text, jsonl or parquet files into a training token file")
    prep.add_argument("--input", nargs="+", required=True, help="files or glob patterns ('docs/**/*.jsonl')")
    prep.add_argument("--tokenizer", help="an HF tokenizer.json (default: the built-in byte-level tokenizer)")
    prep.add_argument("--field", default="text", help="the text field of jsonl and parquet rows (default: text)")
    prep.add_argument("--validation-fraction", type=float, default=0.0, metavar="F",
                      help="hold out this fraction of the documents, evenly spaced, for the validation loss "
                           "(`fastml run` evaluates it; default: none)")
    prep.add_argument("--validation", nargs="+", metavar="FILE",
                      help="files or patterns held out whole for the validation loss")
    prep.add_argument("-o", "--output", required=True, help="output directory")
    prep.set_defaults(func=cmd_prepare)

    gen = sub.add_parser("generate", help="continue a prompt with a trained model (a quick look at what it learned)")
    gen.add_argument("checkpoint", help="a fastml checkpoint (a training one, CHECKPOINT_DIR/step-N) or an HF model "
                                        "directory")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-tokens", type=int, default=100, help="tokens to generate at most (default: 100)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0 (default) takes the most likely token each time; above, samples at this temperature")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens whose "
                                                              "probabilities add up to this (default: 1, all)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling's seed (default: 0)")
    gen.add_argument("--tokenizer", help="an HF tokenizer.json, or bytes (default: the one the checkpoint's data "
                                         "was prepared with)")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="convert between HF safetensors models and fastml checkpoints")
    conv.add_argument("checkpoint", nargs="?", help="a fastml checkpoint directory (with --to-hf): `--from-hf` output, "
                                                   "or a training checkpoint CHECKPOINT_DIR/step-N")
    conv.add_argument("--from-hf", metavar="DIR", help="an HF model directory to import")
    conv.add_argument("--to-hf", metavar="DIR", help="write the checkpoint as an HF model directory")
    conv.add_argument("-o", "--output", help="output checkpoint directory (with --from-hf)")
    conv.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_args(args)
        args.func(args)
    except UserError as e:
        _say_failure(f"fastml: {_rank_prefix()}error: {_one_line(str(e))}")
        return 2
    except OSError as e:  # a path the user gave: a missing directory for -o, no permission, a full disk
        where = f"{e.filename}: " if e.filename else ""
        _say_failure(f"fastml: {_rank_prefix()}error: {_one_line(where + (e.strerror or str(e)))}")
        return 2
    except KeyboardInterrupt:
        say_on_stderr(f"fastml: {_rank_prefix()}interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
