"""`hobbitpy plot`: a trace drawn as selections per expert, reuse distances and hit-ratio
curves; the numbers behind the picture are the trace's own and the simulator's."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hobbitpy.analysis.simulate import simulate
from hobbitpy.measure.trace import read_prompts, record_trace
from hobbitpy.analysis.trace_plot import hit_ratio_curves, reuse_distances, selection_shares

from conftest import hand_trace

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "ref-mixtral-Q8_0.gguf"


def test_shares_and_reuse_distances_of_a_hand_made_trace():
    # one layer, top-1: experts 0 0 1 0 | new sequence: 1 1
    t = hand_trace([[[0]], [[0]], [[1]], [[0]], [[1]], [[1]]], n_expert=4, seq_start=[1, 0, 0, 0, 1, 0])
    assert np.allclose(selection_shares(t), [[0.5, 0.5, 0.0, 0.0]])
    distances, first = reuse_distances(t)
    assert sorted(distances.tolist()) == [1, 1, 2] and first == 3  # 0@0, 1@2, 1@4 are first in their sequence


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plot") / "t.npz"
    record_trace(MODEL, read_prompts(REPO / "models" / "trace-prompts.txt")[:8], n_predict=16, n_ctx=256,
                 n_threads=2).save(path)
    return path


def test_curves_end_at_the_simulators_hit_ratio(trace_file):
    from hobbitpy.files.trace_file import load_trace

    t = load_trace(trace_file)
    ends, curves = hit_ratio_curves(t, 8.0, ("lru", "belady"))
    assert ends[-1] == t.n_tokens
    for p in ("lru", "belady"):
        assert curves[p][-1] == pytest.approx(simulate(t, 8.0, p).hit_ratio)
        assert np.all((curves[p] >= 0) & (curves[p] <= 1))
    assert np.all(curves["belady"] >= curves["lru"] - 1e-12)  # the optimum of every prefix


def test_plot_writes_a_new_png_and_refuses_to_overwrite(trace_file, tmp_path):
    out = tmp_path / "t.png"
    cmd = [sys.executable, "-m", "hobbitpy", "plot", str(trace_file), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    before = out.read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr and out.read_bytes() == before
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"no")
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "plot", str(bad), "--out", str(tmp_path / "b.png")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bad.npz: not a hobbitpy trace" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "b.png").exists()
