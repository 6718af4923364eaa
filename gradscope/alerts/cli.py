"""Alert flags shared by ``gradscope train`` and ``gradscope watch``, and the ``watch`` command."""
from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Sequence

from gradscope.alerts.rules import DEFAULT_RULES, Rule, load_rules, parse_rule
from gradscope.errors import ConfigError


def add_alert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--alert", action="append", default=[], metavar="'RULE[: ACTION,...]'",
                        help="alert rule, repeatable, e.g. 'coherence[voter] > 0.75 for 10: warn,stop' "
                             "(docs/alerts.md); without it: the default rules and --alerts' only")
    parser.add_argument("--alerts", default=None, metavar="FILE.yaml", help="alert rules from a YAML file (without it: none from a file)")
    parser.add_argument("--default-alerts", action=argparse.BooleanOptionalAction, default=True,
                        help="the built-in rules for amplification, capture, cliffs and non-finite "
                             "gradients (warn + record); --no-default-alerts turns them off")


def collect_rules(texts: Sequence[str], file: str | None, defaults: bool) -> list[Rule]:
    """Default rules (unless turned off), then the file's, then ``--alert`` ones. ConfigError on a
    bad rule or file (for an ``--alert`` rule, ``--alert: <why>``: a config file's location can follow)."""
    rules = list(DEFAULT_RULES) if defaults else []
    if file:
        rules += load_rules(file)
    for text in texts:
        try:
            rules.append(parse_rule(text))
        except ConfigError as exc:
            raise ConfigError(f"--alert: {exc}") from None
    return rules


def watch_main(args: argparse.Namespace) -> int:
    from gradscope.alerts.watch import watch
    from gradscope.errors import RunFileError
    from gradscope.runfile import open_run

    # Ctrl-C always interrupts (exit 130), also when this process inherited SIGINT ignored (nohup, `&` in a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rules = collect_rules(args.alert, args.alerts, args.default_alerts)
    deadline = time.monotonic() + args.wait
    while True:  # a missing or broken file fails here, as one line (after --wait seconds of retries)
        try:
            open_run(args.run).close()
            break
        except RunFileError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(args.poll)
    watch(args.run, rules, poll=args.poll, idle=args.idle, echo=lambda line: print(line, flush=True))
    return 0

