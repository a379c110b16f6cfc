"""Files hobbitpy reads that it did not write, or wrote to a disk that failed: a trace cut
short, damaged, zip-bombed or inconsistent, a profile of the wrong types, and outputs on a
full disk. Each is one line naming the file (exit 2 from the CLI), a HobbitError from the
Python API (a FileExistsError for a name taken), and leaves no file behind."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import resource
import signal
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from hobbitpy import HobbitError
from hobbitpy.bench.bench_output import BenchResult, write_outputs
from hobbitpy.system.outputs import OutputExistsError, OutputWriteError
from hobbitpy.plan.profile import load_profile, profile_path, resolve_offload
from hobbitpy.measure.trace import record_trace
from hobbitpy.files.trace_file import load_trace

from conftest import tiny_model

PROMPTS = ["Once upon a time", "The quick brown fox"]


def _hobbitpy(*args, preexec_fn=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hobbitpy", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def _one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """The CLI's answer to bad input: exit 2, one `hobbitpy: error:` line holding every needle
    (after the progress bar of the work done before, if any)."""
    lines = [line for line in p.stderr.strip().splitlines() if not re.search(r"\d+%\|", line)]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("hobbitpy: error: "), p.stderr[-2000:]
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def trace_file(model_dir, tmp_path_factory) -> pathlib.Path:
    """A real trace of a tiny model (its predicted experts hold -1 past the last layer)."""
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    record_trace(tiny_model(model_dir, "llama"), PROMPTS, n_predict=4, n_ctx=128, n_threads=2).save(path)
    return path


def _rewritten(trace_file: pathlib.Path, dst: pathlib.Path, meta=None, **arrays) -> pathlib.Path:
    """The trace with some arrays (or its meta) replaced, saved as numpy saves any .npz."""
    with np.load(trace_file) as z:
        saved = {k: z[k] for k in z.files}
    saved.update(arrays)
    if meta is not None:
        saved["meta"] = np.array(json.dumps(meta(json.loads(str(saved["meta"])))))
    np.savez_compressed(dst, **saved)
    return dst


def test_a_real_trace_still_loads(trace_file):
    t = load_trace(trace_file)
    assert t.n_tokens > 0 and t.experts.shape[1:] == (t.meta["n_moe_layer"], t.meta["n_expert_used"])
    assert (t.predicted == -1).any() and t.experts.min() >= 0


@pytest.mark.parametrize("damage", ["cut in the middle", "bytes zeroed in the middle"])
def test_a_cut_or_damaged_trace_is_one_line(trace_file, tmp_path, damage):
    data = bytearray(trace_file.read_bytes())
    middle = len(data) // 2
    bad = tmp_path / "bad.npz"
    bad.write_bytes(data[:middle] if damage == "cut in the middle" else data[:middle] + bytes(64) + data[middle + 64:])
    with pytest.raises(HobbitError, match="bad.npz: a trace cut short or damaged"):
        load_trace(bad)
    _one_line_error(_hobbitpy("plot", bad), "bad.npz: a trace cut short or damaged")
    _one_line_error(_hobbitpy("simulate", bad, "--budget-mb", "8"), "bad.npz: a trace cut short or damaged")
    assert not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize("name,value", [("experts", 8), ("experts", -5), ("predicted", 8), ("predicted", -2)])
def test_expert_ids_out_of_range_are_refused_naming_the_array(trace_file, tmp_path, name, value):
    # 8 experts: ids 0..7, -1 the "none" marker; -5 became expert 0 or 3 silently, 8 an IndexError
    with np.load(trace_file) as z:
        ids = z[name].copy()
    ids[(3, 1) + (0,) * (ids.ndim - 2)] = value
    bad = _rewritten(trace_file, tmp_path / "ids.npz", **{name: ids})
    with pytest.raises(HobbitError, match=f"ids.npz: the {name} array holds expert {value} at "):
        load_trace(bad)
    _one_line_error(_hobbitpy("simulate", bad, "--budget-mb", "8"), "ids.npz", f"{name} array holds expert {value}")


def _set(key, value):
    return lambda meta: {**meta, key: value}


INCONSISTENT = {  # what changes: (how, what the message names)
    "probs of 7 experts": (dict(probs=lambda a: a[:, :, :7]), "the probs array"),
    "tokens one short": (dict(tokens=lambda a: a[:-1]), "the tokens array"),
    "weights of one expert a token": (dict(weights=lambda a: a[:, :, :1]), "the weights array"),
    "predicted 3 layers ahead, meta 4": (dict(predicted=lambda a: a[:, :, :3]), "the predicted array"),
    "experts as floats": (dict(experts=lambda a: a.astype(np.float32)), "the experts array"),
    "meta's n_expert a string": (dict(meta=_set("n_expert", "8")), "n_expert must be"),
    "meta's top-k above its experts": (dict(meta=_set("n_expert_used", 9)), "n_expert_used must be 1..8"),
    "meta a list": (dict(meta=lambda meta: [meta]), "its meta is not a JSON object"),
}


@pytest.mark.parametrize("case", INCONSISTENT)
def test_arrays_inconsistent_with_each_other_or_the_meta_are_one_line(trace_file, tmp_path, case):
    change, message = INCONSISTENT[case]
    with np.load(trace_file) as z:
        arrays = {k: f(z[k]) for k, f in change.items() if k != "meta"}
    bad = _rewritten(trace_file, tmp_path / "odd.npz", meta=change.get("meta"), **arrays)
    with pytest.raises(HobbitError, match="odd.npz: ") as e:
        load_trace(bad)
    assert message in str(e.value)
    _one_line_error(_hobbitpy("simulate", bad, "--budget-mb", "8"), "odd.npz", message)


@pytest.fixture(scope="module")
def zip_bomb(tmp_path_factory) -> pathlib.Path:
    """A trace of 10 MB whose arrays, all zeros and consistent with its meta, take 2.24 GiB."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    n, L, E, k, D = 9_200_000, 4, 8, 2, 4
    meta = {"trace_version": 1, "model": "bomb.gguf", "n_moe_layer": L, "n_expert": E, "n_expert_used": k,
            "lookahead": D, "expert_bytes": 1 << 20}
    arrays = {"experts": ((n, L, k), np.int32), "weights": ((n, L, k), np.float32), "probs": ((n, L, E), np.float16),
              "predicted": ((n, L, D, k), np.int32), "seq_start": ((n,), np.uint8), "tokens": ((n,), np.int32)}
    zeros = bytes(16 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, (shape, dtype) in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(
                    f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
                left = int(np.prod(shape)) * np.dtype(dtype).itemsize
                while left:
                    f.write(zeros[:min(left, len(zeros))])
                    left -= min(left, len(zeros))
        with z.open("meta.npy", "w") as f:
            np.lib.format.write_array(f, np.array(json.dumps(meta)))
    assert path.stat().st_size < 12 << 20
    assert sum(i.file_size for i in zipfile.ZipFile(path).infolist()) > 2 << 30
    return path


# the child reads the trace under an address-space limit of 512 MiB above what its imports
# took: what reading the bomb asked for (2.24 GiB) is a MemoryError there, not the host's memory
BOUNDED_READ = """
import resource, sys
from hobbitpy import HobbitError
from hobbitpy.cli import main
from hobbitpy.files.trace_file import load_trace
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
if sys.argv[1] == "api":
    try:
        load_trace(sys.argv[2])
    except HobbitError as e:
        print("refused:", e)
else:
    sys.exit(main(["simulate", sys.argv[2], "--budget-mb", "8"]))
"""


def test_a_zip_bombed_trace_is_refused_before_anything_is_allocated(zip_bomb):
    p = subprocess.run([sys.executable, "-c", BOUNDED_READ, "api", str(zip_bomb)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.startswith(f"refused: {zip_bomb}: its arrays would take 2.24 GiB"), \
        (p.stdout, p.stderr[-2000:])
    p = subprocess.run([sys.executable, "-c", BOUNDED_READ, "cli", str(zip_bomb)], capture_output=True, text=True,
                       timeout=120)
    _one_line_error(p, "bomb.npz: its arrays would take 2.24 GiB", "zip bomb")


WRONG_TYPES = [({"policy_weights": 5}, "policy_weights must be a list of 4 numbers, got 5"),
               ({"t1": "0.5"}, 't1 must be a number, got "0.5"'),
               ({"low": {}}, "low must be a string or null, got {}"),
               ({"t2": [0.9]}, "t2 must be a number, got [0.9]"),
               ({"policy": 3}, "policy must be a string or null, got 3"),
               ({"warm": "no"}, 'warm must be true or false, got "no"'),
               ({"prefetch_layers": 1.5}, "prefetch_layers must be an integer, got 1.5"),
               ({"importance": [[1.0, "a"]]}, "importance must be a list of lists of numbers or null"),
               ({"t1": 2.0}, "t1 must be in [0, 1], got 2.0")]


@pytest.mark.parametrize("settings,message", WRONG_TYPES, ids=[next(iter(s)) + "=" + json.dumps(next(iter(s.values())))
                                                               for s, _ in WRONG_TYPES])
def test_a_profile_value_of_the_wrong_type_is_one_line_naming_the_file_and_field(model_dir, tmp_path, settings,
                                                                                message):
    model = tmp_path / "m.gguf"
    model.symlink_to(tiny_model(model_dir, "llama"))
    profile = profile_path(model)  # applied by itself, as calibrate and tune leave it
    profile.write_text(json.dumps({"hobbitpy_profile": 1, "model": "m.gguf", "model_bytes": model.stat().st_size,
                                   "settings": settings}))
    with pytest.raises(HobbitError) as e:
        load_profile(profile, model)
    assert str(e.value).startswith(f"{profile}: {message}")
    with pytest.raises(HobbitError, match="m.hobbit-profile.json: "):
        resolve_offload(model)
    _one_line_error(_hobbitpy("run", model, "-p", "Hi", "-n", "1", "-q"), str(profile), message)


def _result(padding: int = 0) -> BenchResult:
    """A bench result with nothing to draw (no capped row), its JSON padding bytes long at least."""
    return BenchResult(model="m.gguf", machine={}, disk_bytes_per_s=1e9, disk_direct=False, cap_method="none",
                       rows=[{"cap_mb": 0, "configs": [], "padding": "x" * padding}])


def test_bench_json_is_never_written_through_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "bench-out"
    out.mkdir()
    (out / "bench.json").symlink_to(victim)
    with pytest.raises(OutputExistsError, match="bench.json: already exists"):
        write_outputs(_result(), out)
    assert victim.read_text() == "keep me\n" and (out / "bench.json").is_symlink()
    assert write_outputs(_result(), tmp_path / "fresh") == [tmp_path / "fresh" / "bench.json"]
    assert json.loads((tmp_path / "fresh" / "bench.json").read_text())["model"] == "m.gguf"


def test_bench_pictures_are_never_written_through_a_symlink(model_dir, tmp_path):
    """bench.png is drawn in memory and written as a new file, as bench.json is."""
    row = {"cap": "100MB", "cap_mb": 100.0,
           "configs": [{"config": "stock", "decode_tok_s": 5.0, "min_decode_tok_s": 4.0, "max_decode_tok_s": 6.0}]}
    result = BenchResult(model=str(tiny_model(model_dir, "llama")), machine={}, disk_bytes_per_s=1e9,
                         disk_direct=False, cap_method="none", rows=[row])
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"keep me")
    out = tmp_path / "bench-out"
    out.mkdir()
    (out / "bench.png").symlink_to(victim)
    with pytest.raises(OutputExistsError, match="bench.png: already exists"):
        write_outputs(result, out)
    assert victim.read_bytes() == b"keep me" and (out / "bench.png").is_symlink()
    fresh = tmp_path / "fresh"
    assert write_outputs(result, fresh) == [fresh / "bench.json", fresh / "bench.png"]
    assert (fresh / "bench.png").read_bytes().startswith(b"\x89PNG")


@pytest.fixture
def full_disk(tmp_path) -> pathlib.Path:
    """A file system of 1 MiB (a tmpfs: the tests run as root) filled to its last block."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(64 << 10))
            except OSError as e:
                assert e.errno == errno.ENOSPC
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_bench_json_on_a_full_disk_leaves_nothing(full_disk):
    with pytest.raises(OutputWriteError, match="bench.json: cannot write it \\(No space left on device\\)") as e:
        write_outputs(_result(100_000), full_disk / "bench-out")
    assert isinstance(e.value, HobbitError) and e.value.errno == errno.ENOSPC
    assert os.listdir(full_disk / "bench-out") == []


def test_trace_on_a_full_disk_is_one_line_and_leaves_nothing(model_dir, tmp_path, full_disk):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = full_disk / "t.npz"
    p = _hobbitpy("trace", tiny_model(model_dir, "llama"), "--prompts", prompts, "--out", out, "-n", "2", "--ctx", "128")
    _one_line_error(p, f"{out}: cannot write it (No space left on device)")
    assert os.listdir(full_disk) == ["filler"]


def test_inflate_on_a_full_disk_is_one_line(model_dir, full_disk):
    # refused by the free-space check before the first byte (a traceback before: an OSError)
    out = full_disk / "wide.gguf"
    _one_line_error(_hobbitpy("inflate", tiny_model(model_dir, "llama"), out, "--n-ff", "512"), f"{out} needs ")
    assert os.listdir(full_disk) == ["filler"]


def _file_size_limit(limit: int):
    def apply():
        # a write past the limit fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("command", ["inflate", "prepare"])
def test_a_write_failing_midway_is_one_line_and_leaves_nothing(model_dir, tmp_path, command):
    # the disk's free space passes the check, then the write fails (RLIMIT_FSIZE: EFBIG, as
    # ENOSPC or EIO would): a traceback from inflate before, a line without the file from prepare
    model = tiny_model(model_dir, "llama")
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "new.gguf"
    args = ("inflate", model, out, "--n-ff", "512") if command == "inflate" else ("prepare", model, "--out", out)
    p = _hobbitpy(*args, preexec_fn=_file_size_limit(1 << 20))  # past the header (0.7 MB): in the tensors
    _one_line_error(p, f"{out}: cannot write it (File too large)")
    assert os.listdir(folder) == []
