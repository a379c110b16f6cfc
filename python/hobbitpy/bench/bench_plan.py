"""What `hobbitpy bench` will run: the configurations (stock, uniform quants, hobbitpy's), the
memory caps, the context every run uses, the files a run may read, and what refuses a cap
before any run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..copies.companions import default_companion_path, resolve_levels
from ..errors import HobbitError
from ..files.model_file import model_parts
from ..plan.memory import ContextShape, context_sizes
from ..runtime.default_ladder import LOW_TYPES, applies
from ..settings.config import MAX_MEAN_KL, MB, OffloadConfig

STOCK = "stock"


# prompt lengths whose time to first token every run measures (--prompt-tokens; the papers
# add 512: stock runs then get the ubatch the planner sizes to the cap, bench_worker)
PROMPT_TOKENS = (16, 128)


def bench_context_shape(n_predict: int, prompt_tokens: tuple[int, ...], beams: int = 1) -> ContextShape:
    """The context every benchmark run uses: room for the longest prompt, or the shortest and the
    decode (of every beam: each beam's tokens take cells of their own)."""
    return ContextShape(n_ctx=max(min(prompt_tokens) + beams * n_predict, max(prompt_tokens)) + 8, n_batch=512)


@dataclass
class BenchConfig:
    name: str
    offload: dict | None  # OffloadConfig fields; None = stock llama.cpp
    model: str | None = None  # another file of the model (a uniform quant); None = the benchmarked one

    def offload_config(self, cache_mb: float | None):
        """The OffloadConfig of this configuration with another budget (None: from memory)."""
        fields = dict(self.offload, cache_mb=cache_mb, policy_weights=tuple(self.offload["policy_weights"]))
        if fields["level_shares"] is not None:
            fields["level_shares"] = tuple(fields["level_shares"])
        return OffloadConfig(**fields)


@dataclass
class Cap:
    label: str             # "none", "0.55" (of the model size) or "1000MB"
    limit_bytes: int | None


def parse_caps(fractions: list[str], mbs: list[float], model_bytes: int) -> list[Cap]:
    caps = []
    for f in fractions:
        if f == "none":
            caps.append(Cap("none", None))
            continue
        try:
            v = float(f)
        except ValueError:
            v = math.nan
        if not 0 < v <= 4:
            raise ValueError(f"--caps: a cap is a fraction of the model's file in (0, 4], or none; got {f!r}")
        caps.append(Cap(f"{v:g}", int(v * model_bytes)))
    caps += [Cap(f"{mb:g}MB", int(mb * MB)) for mb in mbs]
    return caps


def config_files(model: str, cfg: BenchConfig) -> set[str]:
    """Every file a run of this configuration may read."""
    if cfg.offload is None:
        return set(model_parts(cfg.model or model))
    offload = cfg.offload_config(cfg.offload["cache_mb"])
    levels = resolve_levels(model, offload.high_file, offload.mid, offload.low, offload.high_flag)
    # the default's low copies, where it chooses one (made in its first run when missing: default_ladder.py)
    default_lows = [default_companion_path(model, low) for low in LOW_TYPES] if applies(offload) else []
    return {*model_parts(cfg.model or model), *(p for p in levels if p is not None),
            *(str(low) for low in default_lows if low.is_file())}


def check_caps(info, caps: list[Cap], shape: ContextShape, process_bytes: int) -> None:
    """Refuse, before any run, a cap below what a run's process holds before its first expert:
    process_bytes (Python, llama.cpp) and the context's buffers. Such a cap would only get
    every run killed."""
    minimum = process_bytes + context_sizes(info, shape).total
    for cap in caps:
        if cap.limit_bytes is not None and cap.limit_bytes < minimum:
            raise HobbitError(f"cap {cap.label} ({cap.limit_bytes / MB:.0f} MB) is below the {minimum / MB:.0f} MB a run "
                              f"needs before any weight (the process and the context's buffers): every run would be "
                              f"killed; use caps of at least {minimum / MB:.0f} MB")


def is_lossy(cfg: BenchConfig) -> bool:
    """May the configuration's tokens differ from stock's (another file, another precision,
    substitution)?"""
    return cfg.model is not None or (cfg.offload is not None and cfg.offload_config(None).lossy)


TUNED = "tuned"


@dataclass
class TuneRequest:
    """Run `tune` at every cap's memory and benchmark its pick there as the configuration "tuned"."""
    text: str
    candidates: list[str] | None = None  # names as tune prints them; None: all
    max_tokens: int = 1024
    max_mean_kl: float = MAX_MEAN_KL
