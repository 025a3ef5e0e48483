"""The ``scaletrain`` command: one verb per module of commands/ (train and finetune, parity,
bench, schedule, plan, export, generate, eval, prepare, run, sweep), each adding its parser and
naming the function that runs it.

User mistakes (a ``UserError``, a bad flag) print one sentence on stderr and
exit with code 2, without a traceback; see CLI.md for the contract. A job
that fails (a rank died, the loss is not finite: ``JobFailed``) prints its
sentence and exits with code 1.
"""

from __future__ import annotations

import argparse
import os
import sys

# Before torch loads: its C++ side logs a warning with a stack trace for every
# socket a dead peer closed (the rendezvous store, gloo), pages of them before
# the one sentence that names the rank. Errors still show; a user's own
# TORCH_CPP_LOG_LEVEL=WARNING brings the warnings back. --debug-dist asks for
# them all (runtime/debug.py), and torch reads the level only when it loads.
if "--debug-dist" in sys.argv[1:]:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "INFO"
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from scaletrain.commands import (  # noqa: E402
    bench,
    evaluate,
    export,
    generate,
    parity,
    plan,
    prepare,
    run,
    schedule,
    sweep,
    train,
)
from scaletrain.errors import JobFailed, UserError  # noqa: E402

VERBS = (train, parity, bench, schedule, plan, export, prepare, run, sweep, generate, evaluate)  # in --help's order


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one sentence rather than usage plus error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaletrain", description="Train neural networks at scale, every technique "
                                                    "from scratch, checked against one device.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for verb in VERBS:
        verb.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"scaletrain {args.command}: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        print(f"scaletrain {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # its message, where a command gives one, says how to go on
        print(f"scaletrain {args.command}: {exc or 'interrupted.'}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of the output left (``| head``): stop quietly, as a shell tool does. Pointing
        # stdout at /dev/null keeps the interpreter's final flush from failing a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
