"""The ``gradscope`` command line.

Subcommands dispatch lazily, so ``gradscope info`` never imports torch or the trainer stack.
Every user error (bad file, bad flag) prints one line ``gradscope: error: ...`` and exits 2.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradscope.errors import GradscopeError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        print(f"gradscope: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _cmd_info(args: argparse.Namespace) -> int:
    from gradscope.runfile.info import render_info

    print(render_info(args.run))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from trainers.toy import run_demo

    run_demo(args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradscope", description="Gradient-dynamics diagnostics for multi-agent RL.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("info", help="print what a run file holds")
    p.add_argument("run", help="path to a run file (.h5)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="the main job: a small probed training run, then its summary")
    p.add_argument("--out", default="out/demo", help="folder for the demo's run files")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GradscopeError as exc:
        print(f"gradscope: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("gradscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
