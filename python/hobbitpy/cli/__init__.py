"""The hobbitpy command line: a thin shell over the Python API, one module per command
(each adds its parser and handles its arguments); what they share is in common.py."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys

from . import bench, calibrate, evaluate, imatrix, inflate, options, plot, prepare, run, serve, simulate, trace, tune
from .common import log

# in the order `hobbitpy --help` lists them
COMMANDS = (run, serve, inflate, prepare, imatrix, calibrate, tune, bench, trace, simulate, plot, options, evaluate)


def main(argv: list[str] | None = None) -> int:
    from hobbitpy import __version__

    parser = argparse.ArgumentParser(prog="hobbitpy", description="Run MoE GGUF models larger than memory.")
    parser.add_argument("--version", action="version", version=f"hobbitpy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage and the closest flag it has
        _refuse_unknown(sub.choices[args.command], unknown)
    # notes go to stderr through logging (this call's stderr); -q keeps only errors
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hobbitpy: %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.ERROR if getattr(args, "quiet", False) else logging.INFO)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except BrokenPipeError:
        # the reader went away (`| head`): nothing more to say, and nothing to flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports SIGPIPE


def _refuse_unknown(command_parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    flags = [s for action in command_parser._actions for s in action.option_strings]
    first = unknown[0].split("=", 1)[0]
    close = difflib.get_close_matches(first, flags, n=1, cutoff=0.6) if first.startswith("-") else []
    command_parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {close[0]}?)" if close else ""))
