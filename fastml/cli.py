"""The `fastml` command: each subcommand parses its arguments and calls one plain function.

Planner and executor are imported only by the subcommands that need them. A user error is one line on stderr
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from fastml.config import UserError


def cmd_plan(args: argparse.Namespace) -> None:
    from fastml.planner.defaults import make_plan
    from fastml.plan import save_plan

    plan = make_plan(model=args.model, seq_len=args.seq, global_batch_tokens=args.global_batch_tokens,
                     steps=args.steps, data=args.data, device=args.device, overrides=args.set)
    save_plan(plan, args.output)
    k, h = plan.knobs, plan.hardware
    print(f"wrote {args.output}: {plan.model.name} ({plan.model.num_params() / 1e6:,.1f}M parameters) on "
          f"{h.device} ({h.profile or 'unknown GPU'}), seq {plan.training.seq_len}, "
          f"{plan.training.global_batch_tokens:,} tokens/step = micro-batch {k.micro_batch_size} x "
          f"{k.grad_accum_steps} accumulation steps, recompute {list(k.recompute) or 'none'}")


def cmd_run(args: argparse.Namespace) -> None:
    from fastml.plan import load_plan, with_overrides
    from fastml.executor.train import train

    plan = with_overrides(load_plan(args.plan), args.set)
    train(plan, steps=args.steps, log_json=args.log_json, show_progress=not args.no_progress)


def cmd_prepare(args: argparse.Namespace) -> None:
    from fastml.executor.data import prepare

    header = prepare(args.input, args.output, tokenizer=args.tokenizer, field=args.field)
    print(f"wrote {args.output}: {header['num_tokens']:,} tokens from {header['num_documents']:,} documents "
          f"(vocab {header['vocab_size']:,}, {header['dtype']})")


def cmd_convert(args: argparse.Namespace) -> None:
    from fastml.executor.checkpoint import convert_from_hf, convert_to_hf

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
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fastml", description="Plan and run memory- and communication-efficient LLM training.")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="write a training plan for a model on this machine")
    plan.add_argument("--model", default="tiny", help="a preset name or an HF model directory (default: tiny)")
    plan.add_argument("--seq", type=int, help="sequence length (default: 256 for tiny, else 2048)")
    plan.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (default: 16 sequences)")
    plan.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    plan.add_argument("--data", default="default",
                      help="a directory from `fastml prepare` (default: Python's own source, shipped with it)")
    plan.add_argument("--device", choices=["cpu", "cuda"], help="train on this (default: a GPU if there is one)")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="pin a value, e.g. --set knobs.micro_batch_size=8 (repeatable)")
    plan.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default: plan.json)")
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="train as a plan says")
    run.add_argument("plan", help="a plan.json")
    run.add_argument("--steps", type=int, help="optimizer steps (default: the plan's)")
    run.add_argument("--log-json", metavar="FILE", help="write one JSON object per optimizer step to FILE")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="override a value of the plan (repeatable)")
    run.add_argument("--no-progress", action="store_true", help="no live progress display")
    run.set_defaults(func=cmd_run)

    prep = sub.add_parser("prepare", help="tokenize text, jsonl or parquet files into a training token file")
    prep.add_argument("--input", nargs="+", required=True, help="files or glob patterns ('docs/**/*.jsonl')")
    prep.add_argument("--tokenizer", help="an HF tokenizer.json (default: the built-in byte-level tokenizer)")
    prep.add_argument("--field", default="text", help="the text field of jsonl and parquet rows (default: text)")
    prep.add_argument("-o", "--output", required=True, help="output directory")
    prep.set_defaults(func=cmd_prepare)

    conv = sub.add_parser("convert", help="convert between HF safetensors models and fastml checkpoints")
    conv.add_argument("checkpoint", nargs="?", help="a fastml checkpoint directory (with --to-hf)")
    conv.add_argument("--from-hf", metavar="DIR", help="an HF model directory to import")
    conv.add_argument("--to-hf", metavar="DIR", help="write the checkpoint as an HF model directory")
    conv.add_argument("-o", "--output", help="output checkpoint directory (with --from-hf)")
    conv.set_defaults(func=cmd_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"fastml: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastml: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
