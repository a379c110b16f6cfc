"""`hobbitpy options`: every offload option and preset as Markdown tables."""

from __future__ import annotations



def add_parser(sub) -> None:
    p = sub.add_parser("options", help="every option of how experts are served, as a Markdown table",
                       description="Print every offload option: its keyword in hobbitpy.Llama and OffloadConfig, its "
                                   "flag, its default, whether a profile sets it, and what it does; then the presets (docs/OPTIONS.md).")
    p.set_defaults(func=_options)


def _options(args) -> int:
    from hobbitpy.config import options_table
    from hobbitpy.presets import presets_table

    print(options_table() + "\n" + presets_table(), end="")
    return 0
