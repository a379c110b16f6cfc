"""What a generation does with a setting it leaves out, and which values are refused: one
table for `hobbitpy run`, `hobbitpy serve` and `hobbitpy.Llama` alike, llama.cpp's defaults
(common.h's `common_params_sampling`, `n_predict` -1), where llama-cpp-python gives each
surface its own (16 tokens for a completion, to the end of the context for a chat; a chat's
temperature 0.2; its server's repeat penalty 1.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

TO_THE_END = -1  # max_tokens: until the end of the text or of the context


@dataclass(frozen=True)
class GenerationDefault:
    name: str       # create_completion's keyword (the API and the server's JSON field)
    flag: str       # `run`'s flag (llama.cpp's)
    value: float | int
    meaning: str


GENERATION_DEFAULTS = (
    GenerationDefault("max_tokens", "-n", TO_THE_END, "tokens to generate; -1: until the end of the text or of "
                                                      "the context; 0 is refused (it asks for nothing)"),
    GenerationDefault("temperature", "--temp", 0.8, "temperature; 0 or less: greedy"),
    GenerationDefault("top_k", "--top-k", 40, "sample among the k likeliest; 0: all"),
    GenerationDefault("top_p", "--top-p", 0.95, "nucleus sampling threshold"),
    GenerationDefault("min_p", "--min-p", 0.05, "drop tokens below P times the likeliest"),
    GenerationDefault("repeat_penalty", "--repeat-penalty", 1.0, "penalty for repeated tokens; 1: none"),
    GenerationDefault("presence_penalty", "--presence-penalty", 0.0, "penalty for a token seen, -2..2"),
    GenerationDefault("frequency_penalty", "--frequency-penalty", 0.0, "penalty per earlier use, -2..2"),
)
DEFAULTS = {d.name: d.value for d in GENERATION_DEFAULTS}


def generation_error(settings: dict) -> str | None:
    """Why these generation settings (keywords of create_completion, any subset, stop among
    them) cannot be used, in one sentence naming the setting; None when they can. Not a number,
    or not finite, is refused everywhere."""
    for name in DEFAULTS:
        value = settings.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
    max_tokens, top_k = settings.get("max_tokens"), settings.get("top_k")
    if max_tokens is not None and (max_tokens != int(max_tokens) or (max_tokens < 1 and max_tokens != TO_THE_END)):
        return f"max_tokens must be at least 1, or -1 (until the end of the text or of the context), got {max_tokens}"
    if top_k is not None and (top_k != int(top_k) or top_k < 0):
        return f"top_k must be a whole number, 0 or more, got {top_k}"
    for name in ("top_p", "min_p"):
        if settings.get(name) is not None and not 0 <= settings[name] <= 1:
            return f"{name} must be in [0, 1], got {settings[name]}"
    if settings.get("repeat_penalty") is not None and settings["repeat_penalty"] <= 0:
        return f"repeat_penalty must be above 0, got {settings['repeat_penalty']}"
    for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's range, as llama-cpp-python's server checks it
        if settings.get(name) is not None and not -2 <= settings[name] <= 2:
            return f"{name} must be in [-2, 2], got {settings[name]}"
    stop = settings.get("stop")
    if stop == "" or (isinstance(stop, list) and "" in stop):  # it would end every text before its first token
        return "stop needs some text: an empty stop string ends the text before it starts"
    return None


def for_llama_cpp_python(settings: dict) -> dict:
    """The settings as llama-cpp-python's create_completion reads them: to the end is its
    max_tokens None; a temperature below 0 is greedy, as llama.cpp's (llama-cpp-python samples
    without a temperature there)."""
    out = dict(settings)
    if out.get("max_tokens") == TO_THE_END:
        out["max_tokens"] = None
    if out.get("temperature") is not None and out["temperature"] < 0:
        out["temperature"] = 0.0
    return out


def defaults_table() -> str:
    """docs/GUIDE.md's table of the shared defaults (a test keeps the page equal to it)."""
    rows = ["| setting (API, server) | `run` | default | |", "|---|---|---|---|"]
    rows += [f"| `{d.name}` | `{d.flag}` | {d.value} | {d.meaning} |" for d in GENERATION_DEFAULTS]
    return "\n".join(rows)
