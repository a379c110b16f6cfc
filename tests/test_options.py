"""One table defines every offload option: the CLI flags, the Llama keywords, the profile
fields, the C defaults and docs/OPTIONS.md all agree with it."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import subprocess
import sys

from hobbitpy._native import lib
from hobbitpy.config import HIT_POLICIES, MAX_IO_THREADS, MODES, OffloadConfig, option_of, options_table
from hobbitpy.llama import OFFLOAD_KEYWORDS
from hobbitpy.profile import PROFILE_SETTINGS

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_docs_options_page_is_the_table():
    page = (REPO / "docs" / "OPTIONS.md").read_text()
    assert page.endswith(options_table()), "docs/OPTIONS.md is stale: regenerate it from `hobbitpy options`"
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "options"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == options_table()


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
    from hobbitpy.cli import add_offload_args, offload_config_from_args

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
    assert lib.HOBBIT_MAX_IO_THREADS == MAX_IO_THREADS
    w = c.policy_weights
    assert all(abs(a - b) < 1e-6 for a, b in zip((w.lru, w.lfu, w.lhu, w.fld), d.policy_weights))
