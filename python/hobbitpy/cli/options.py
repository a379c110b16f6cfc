"""`hobbitpy options`: every offload option and preset, for a terminal or as Markdown."""

from __future__ import annotations

import shutil
import textwrap


def add_parser(sub) -> None:
    p = sub.add_parser("options", help="every option of how experts are served",
                       description="Print every offload option: its flag, its keyword in hobbitpy.Llama and "
                                   "OffloadConfig, its default and what it does; then the presets.")
    p.add_argument("--markdown", action="store_true", help="as the Markdown tables of docs/OPTIONS.md")
    p.set_defaults(func=_options)


def _options(args) -> int:
    from hobbitpy.settings.config import options_table
    from hobbitpy.settings.presets import presets_table

    if args.markdown:
        print(options_table() + "\n" + presets_table(), end="")
    else:
        print(terminal_listing(shutil.get_terminal_size().columns), end="")
    return 0


def terminal_listing(width: int) -> str:
    """The options and presets wrapped to the terminal: a line of flag, keyword and default,
    then what it does, indented."""
    import dataclasses

    from hobbitpy.settings.config import OffloadConfig, default_text, option_of
    from hobbitpy.settings.presets import PRESETS

    width = max(40, width)
    indent = "    "
    out = ["offload options (flag, keyword, default):", ""]
    for f in dataclasses.fields(OffloadConfig):
        opt = option_of(f)
        flag = (opt.flag + (f" {opt.metavar}" if opt.metavar else "")) if opt.flag else "(Python and profiles only)"
        default = "on" if f.default is True else "off" if f.default is False else default_text(f)
        out += textwrap.wrap(f"{flag}  ({f.name}; default {default})", width, subsequent_indent=indent)
        out += textwrap.wrap(opt.help, width, initial_indent=indent, subsequent_indent=indent)
    out += ["", "presets (--preset NAME):", ""]
    for name, preset in PRESETS.items():
        out.append(name[:width])
        settings = ", ".join(f"{k}={v}" for k, v in preset.settings.items())
        out += textwrap.wrap(f"{preset.what} ({settings})", width, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(out) + "\n"
