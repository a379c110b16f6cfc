"""One table defines every offload option: the CLI flags, the Llama keywords, the profile
fields, the C defaults and docs/OPTIONS.md all agree with it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from hobbitpy.binding import native
from hobbitpy.binding.native import error_buffer, ffi, lib, to_str
from hobbitpy.settings.config import (NONE_IS_OFF, RANGED_OPTIONS, HIT_POLICIES, MODES, PARAM_RANGES, POLICIES,
                                      OffloadConfig, option_of, options_table)
from hobbitpy.runtime.llama import OFFLOAD_KEYWORDS
from hobbitpy.plan.memory import ROW_READ_BYTES
from hobbitpy.plan.profile import PROFILE_SETTINGS

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_docs_options_page_is_the_table():
    page = (REPO / "docs" / "OPTIONS.md").read_text()
    from hobbitpy.settings.presets import presets_table

    tables = options_table() + "\n" + presets_table()
    assert page.endswith(tables), "docs/OPTIONS.md is stale: regenerate it from `hobbitpy options --markdown`"
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "options", "--markdown"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout == tables
    # for a terminal: no line wider than it, every flag and preset named
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "options"], capture_output=True, text=True, timeout=60,
                       env=os.environ | {"COLUMNS": "80"})
    assert p.returncode == 0 and max(map(len, p.stdout.splitlines())) <= 80
    assert all(option_of(f).flag is None or option_of(f).flag in p.stdout for f in dataclasses.fields(OffloadConfig))


def test_every_flag_and_keyword_comes_from_the_table():
    help_text = subprocess.run([sys.executable, "-m", "hobbitpy", "run", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for f in dataclasses.fields(OffloadConfig):
        opt = option_of(f)
        if opt.flag:
            assert opt.flag in help_text, opt.flag
        assert (f.name in PROFILE_SETTINGS) == opt.profile
    assert set(OFFLOAD_KEYWORDS) <= {f.name for f in dataclasses.fields(OffloadConfig)}
    # a flag sets the same field as the keyword
    from hobbitpy.cli.common import add_offload_args, offload_config_from_args

    p = argparse.ArgumentParser()
    add_offload_args(p)
    args = p.parse_args(["--cache-mb", "8", "--policy", "lfu", "--policy-seed", "7", "--io-threads", "1", "--prefetch",
                         "--no-warm", "--low", "Q2_K", "--t1", "0.5", "--hits", "exact", "--policy-weights", "0.1,0.2,0.3,0.4"])
    assert offload_config_from_args(args) == OffloadConfig(cache_mb=8, policy="lfu", seed=7, io_threads=1,
                                                           prefetch_layers=1, warm=False, low="Q2_K", t1=0.5,
                                                           hits="exact", policy_weights=(0.1, 0.2, 0.3, 0.4))
    assert offload_config_from_args(p.parse_args([])) == OffloadConfig()
    assert offload_config_from_args(p.parse_args(["--no-offload"])).enabled is False


def test_the_c_defaults_are_the_tables():
    c = lib.hobbit_default_params()
    d = OffloadConfig()
    assert abs(c.t1 - d.t1) < 1e-6 and abs(c.t2 - d.t2) < 1e-6  # C floats
    assert c.prefetch_layers == d.prefetch_layers and c.n_io_threads == d.io_threads
    assert bool(c.direct_io) == d.direct_io and bool(c.warm_low) == d.warm and c.seed == d.seed
    assert HIT_POLICIES[c.hit_policy] == d.hits and MODES[c.mode] == d.mode
    assert bool(c.prefill_popular_first) == (d.prefill_order == "popularity")
    assert c.neuron_threshold < 0 and d.neurons is None and abs(c.neuron_limit - d.neuron_limit) < 1e-6
    assert c.n_row_readers == d.row_readers and c.neuron_bridge == d.neuron_bridge
    w = c.policy_weights
    assert all(abs(a - b) < 1e-6 for a, b in zip((w.lru, w.lfu, w.lhu, w.fld), d.policy_weights))


def test_the_binding_is_the_header_itself():
    """cffi reads hobbit.h as installed beside the library (no copy of it to drift): every
    function, enum value and integer constant of the source header is in the binding, with
    the header's value, and the option names are the enums'."""
    header = (REPO / "native" / "include" / "hobbit.h").read_text()
    assert native.HEADER.read_text() == header, "the installed header is not the source's: rebuild"
    functions = re.findall(r"^HOBBIT_API [^;]*?\b(hobbit_\w+)\(", header, re.M)
    assert len(functions) > 30 and all(hasattr(lib, f) for f in functions)
    values = re.findall(r"^\s+(HOBBIT_[A-Z_]+)\s*=\s*(-?\d+)", header, re.M)
    assert len(values) > 20 and all(getattr(lib, name) == int(v) for name, v in values)
    built = re.search(r"#define HOBBIT_ROW_READ_BYTES \((\d+) \* (\d+)\)", header)
    assert int(built[1]) * int(built[2]) == lib.HOBBIT_ROW_READ_BYTES == ROW_READ_BYTES
    assert PARAM_RANGES["n_io_threads"].max == lib.HOBBIT_MAX_IO_THREADS and lib.HOBBIT_PREFETCH_WIDTH_FATE == -1
    assert MODES == ("gpu-centric", "cooperative", "auto", "balanced") and HIT_POLICIES == ("found", "upgrade", "exact", "at-least")
    assert POLICIES.index("hobbit") == POLICIES.index("weighted") + 1 and POLICIES[-2:] == ("score", "frequency")



def _c_refuses(field: str, value) -> str:
    """hobbit_request_offload's message for the default params with one field set ("" when it
    accepts them; the armed request is then cancelled)."""
    params = ffi.new("struct hobbit_params *", lib.hobbit_default_params())
    params.budget_bytes = 1 << 20
    setattr(params, field, int(value) if PARAM_RANGES[field].integer else value)
    err = error_buffer()
    status = lib.hobbit_request_offload(params, err, len(err))
    lib.hobbit_cancel_offload_request()
    return "" if status == lib.HOBBIT_STATUS_OK else to_str(err)


# what an option's end needs of the others to be a valid configuration
_BESIDE = {"t1": {"t2": 1.0}, "t2": {"t1": 0.0}, "t_mid": {"t1": 0.0, "t2": 1.0}, "prefill_low_share": {"low": "Q2_K"}}


def test_every_range_is_written_once_and_both_sides_keep_it():
    """The range of every numeric setting is the C API's table (hobbit_param_ranges): the C
    side refuses a value just outside it and takes its ends, OffloadConfig the same through its
    option; the defaults lie inside. A check added or changed on one side alone fails here."""
    # every ranged field is set by an option, or derived by Python (the budget from cache_mb,
    # the number of levels from low and mid)
    assert set(RANGED_OPTIONS.values()) | {"budget_bytes", "n_level"} == set(PARAM_RANGES)
    defaults = lib.hobbit_default_params()
    for field, allowed in PARAM_RANGES.items():
        if field != "budget_bytes":  # 0: the caller must choose one
            assert allowed.holds(getattr(defaults, field)), field
        step = 1 if allowed.integer else 1e-3
        for end in (allowed.min, allowed.max):
            if not math.isinf(end):
                assert _c_refuses(field, end) == "", (field, end)
        for outside in ([allowed.min - step] if not math.isinf(allowed.min) else []) + \
                       ([allowed.max + step] if not math.isinf(allowed.max) else []) + \
                       ([] if allowed.integer else [math.nan, math.inf]):
            assert _c_refuses(field, outside).startswith(f"hobbit_request_offload: {field} must be {allowed.text()}"), \
                (field, outside)
    for option, field in RANGED_OPTIONS.items():
        allowed = PARAM_RANGES[field]
        low = max(allowed.min, 0) if option in NONE_IS_OFF else allowed.min
        step = 1 if allowed.integer else 1e-3
        for end in (low, allowed.max):
            if not math.isinf(end):
                OffloadConfig(**{**_BESIDE.get(option, {}), option: int(end) if allowed.integer else end})
        outside = ([low - step] if not math.isinf(low) else []) + ([allowed.max + step] if not math.isinf(allowed.max) else [])
        for x in outside + ([] if allowed.integer else [math.nan]):
            with pytest.raises(ValueError, match=rf"^{option} must be "):
                OffloadConfig(**{**_BESIDE.get(option, {}), option: int(x) if allowed.integer else x})


def test_a_preset_lies_under_the_flags_and_keywords_and_replaces_the_profile(tmp_path):
    from hobbitpy.cli.common import add_offload_args, offload_config_from_args
    from hobbitpy.runtime.llama import offload_config_of
    from hobbitpy.settings.presets import PRESETS, preset_settings

    fate = OffloadConfig(**preset_settings("fate"))
    assert fate.policy == "arc" and fate.shallow_layers == 1 and fate.prefetch_layers == 1
    p = argparse.ArgumentParser()
    add_offload_args(p)
    # a preset chooses the configuration: the default's ladder stays out (auto off)
    assert offload_config_from_args(p.parse_args(["--preset", "fate", "--policy", "lru"])) == dataclasses.replace(
        fate, policy="lru", auto=False)
    # a profile next to the model would apply by itself; a preset replaces it
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    (tmp_path / "m.hobbit-profile.json").write_text("not read")
    assert offload_config_from_args(p.parse_args(["--preset", "lru"]), str(model), auto_profile=True) == OffloadConfig(
        **preset_settings("lru"), auto=False)
    assert offload_config_of(str(model), None, None, {"prefetch_layers": 2}, "fate") == dataclasses.replace(
        fate, prefetch_layers=2, auto=False)
    with pytest.raises(ValueError, match="no preset is named 'fat'"):
        offload_config_of(str(model), None, None, {}, "fat")
    with pytest.raises(TypeError, match="preset"):
        offload_config_of(str(model), OffloadConfig(), None, {}, "fate")
    help_text = subprocess.run([sys.executable, "-m", "hobbitpy", "run", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert all(name in help_text for name in PRESETS)
