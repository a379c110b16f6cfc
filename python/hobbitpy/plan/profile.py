"""Policy profiles: what `hobbitpy calibrate` found for one model, as a JSON file next to
it (``MODEL.hobbit-profile.json``), which `hobbitpy run` applies by itself.

A profile holds the settings (low-precision level, thresholds T1/T2, eq. 3 weights)
and, for the record, how they were measured. Where settings come from, in one place
(`resolve_offload`): the built-in defaults, under the profile, under a preset, under the
flags or keywords given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
import json
import logging
import os
import pathlib

from ..settings.config import MB, OffloadConfig, option_of, settings_of_json
from ..errors import HobbitError
from .memory import available_memory_bytes
from ..system.outputs import write_new
from ..settings.presets import preset_settings

log = logging.getLogger("hobbitpy")

PROFILE_VERSION = 1

# the OffloadConfig fields a profile may set (their Option says so)
PROFILE_SETTINGS = tuple(f.name for f in fields(OffloadConfig) if option_of(f).profile)


@dataclass
class Profile:
    model: str                     # file name of the model it was calibrated for
    model_bytes: int               # its size: a profile of another file of the same name is refused
    settings: dict                 # OffloadConfig fields (PROFILE_SETTINGS)
    calibration: dict = field(default_factory=dict)  # how they were found: perplexities, sweeps, policy search

    def save(self, path: str | os.PathLike, replace: bool = False) -> pathlib.Path:
        """Write the profile to a new file (with replace, over a regular file; never through a symlink)."""
        return write_new(path, json.dumps({"hobbitpy_profile": PROFILE_VERSION, **asdict(self)}, indent=2) + "\n",
                         replace)


def resolve_offload(model_path: str | os.PathLike | None, *, profile: str | os.PathLike | None = None,
                    profile_next_to_model: bool = True, preset: str | None = None,
                    settings: dict | None = None) -> tuple[OffloadConfig, pathlib.Path | None]:
    """The one order settings come in, for `run`, `serve`, `eval` and `hobbitpy.Llama` alike:
    the built-in defaults, under the profile (the one named, else the one next to the model
    unless profile_next_to_model is False, a preset is asked for, offload is turned off or it
    stands aside: tuned for less memory than the whole model now has),
    under the preset, under the settings given (flags, keywords). A profile or a preset
    chooses the configuration, so the default ladder stays out (auto off). Returns the
    configuration and the profile applied, if any."""
    settings = settings or {}
    beside = None
    if (profile is None and profile_next_to_model and model_path is not None and preset is None
            and settings.get("enabled", True) is not False):
        beside = profile_path(model_path)
        profile = beside if beside.exists() else None
    chosen = {}
    if profile is not None:
        loaded = load_profile(profile, model_path)
        if beside is not None and _stands_aside(loaded, beside, model_path):
            profile = None
        else:
            chosen.update(loaded.settings, auto=False)
    if preset is not None:
        chosen.update(preset_settings(preset), auto=False)
    return OffloadConfig(**{**chosen, **settings}), None if profile is None else pathlib.Path(profile)


def _stands_aside(profile: Profile, path: pathlib.Path, model_path: str | os.PathLike) -> bool:
    """Whether the profile next to the model (read from path) gives way to the default: it was
    tuned for a memory smaller than the one available now, where the whole model's file fits
    (its lossy ladder was the price of less memory; with every expert resident the default is
    exact). Says so."""
    tuned_mb = profile.calibration.get("memory_mb")
    if not isinstance(tuned_mb, (int, float)):  # tuned for the memory of its time: not known to be less
        return False
    available = available_memory_bytes()
    if tuned_mb * MB >= available or os.path.getsize(model_path) >= available:
        return False
    log.info(f"{path} stands aside: tuned for {tuned_mb:.0f} MB, and the whole model fits in the "
             f"{available / MB:.0f} MB available now (--profile {path} applies it)")
    return True


def profile_path(model_path: str | os.PathLike) -> pathlib.Path:
    """Where calibrate writes a model's profile and run looks for it."""
    model = pathlib.Path(model_path)
    return model.with_name(f"{model.stem}.hobbit-profile.json")


def load_profile(path: str | os.PathLike, model_path: str | os.PathLike | None) -> Profile:
    """Read a profile and check it belongs to this model (when model_path is given);
    raises HobbitError naming the file."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HobbitError(f"{path}: cannot read the profile ({e})") from None
    if not isinstance(data, dict) or data.get("hobbitpy_profile") != PROFILE_VERSION:
        raise HobbitError(f"{path}: not a hobbitpy profile (version {PROFILE_VERSION})")
    try:
        profile = Profile(model=data["model"], model_bytes=int(data["model_bytes"]), settings=dict(data["settings"]),
                          calibration=dict(data.get("calibration", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise HobbitError(f"{path}: incomplete profile ({e})") from None
    unknown = set(profile.settings) - set(PROFILE_SETTINGS)
    if unknown:
        raise HobbitError(f"{path}: unknown settings {', '.join(sorted(unknown))}")
    try:
        profile.settings = settings_of_json(profile.settings)
        OffloadConfig(auto=False, **profile.settings)  # the values' ranges, and how they go together
    except ValueError as e:
        raise HobbitError(f"{path}: {e}") from None
    size = os.path.getsize(model_path) if model_path is not None else profile.model_bytes
    if profile.model_bytes != size:
        raise HobbitError(f"{path}: calibrated for {profile.model} of {profile.model_bytes} bytes, but {model_path} "
                          f"has {size} bytes; calibrate this model again")
    return profile
