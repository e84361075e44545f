"""`llmsim`: the command line on top of the model, the experiments, calibration
and validation. Every command exits non-zero with a one-line reason on bad
input."""
from __future__ import annotations

import argparse
import os
import sys

from sim.conditions import CONDITIONS

from . import args, calibrate_cmds, experiment_cmds, model_cmds, scenario_cmds, stack_cmds, validate_cmds, verdict_cmds


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise args.UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="llmsim", description="Simulate a vLLM engine behind retrying clients and an "
                                           "overload-control proxy: does service come back after a burst?")
    sub = ap.add_subparsers(dest="command", parser_class=_Parser, required=True)
    for group in (model_cmds, scenario_cmds, stack_cmds, experiment_cmds, validate_cmds, calibrate_cmds,
                  verdict_cmds):
        group.add_subcommands(sub)
    return ap


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
        if getattr(a, "condition", None) is not None and a.condition not in CONDITIONS:
            raise args.UsageError(f"unknown condition {a.condition!r}; valid: {', '.join(CONDITIONS)}")
        args.check_output(getattr(a, "json", None))
        return a.fn(a)
    except args.UsageError as e:
        print(f"llmsim: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmsim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:             # output piped into a reader that stopped (e.g. head)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
