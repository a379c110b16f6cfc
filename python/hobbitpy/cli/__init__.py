"""The hobbitpy command line: a thin shell over the Python API, one module per command
(each adds its parser and handles its arguments); what they share is in common.py."""

from __future__ import annotations

import argparse
import logging
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
    args = parser.parse_args(argv)
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
