"""hobbitpy prepare: companion files holding only the experts, in a lower precision."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest

import hobbitpy
from hobbitpy.binding import ggml
from hobbitpy import cli
from hobbitpy.copies import companions, prepare
from hobbitpy.files.gguf_fields import field_value
from hobbitpy.copies.companions import companion_fallbacks
from hobbitpy.copies.prepare import EXPERT_SUFFIXES, prepare_companion
from hobbitpy.files.synthetic_moe import make_synthetic_moe

from conftest import default_signals

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
DEEPSEEK_Q8 = MODELS / "ref-deepseek-Q8_0.gguf"
DEEPSEEK_F16 = MODELS / "ref-deepseek-F16.gguf"
MIXTRAL_Q8 = MODELS / "ref-mixtral-Q8_0.gguf"

# relative RMS error of each tensor against the F16 weights, per type written; measured
# on ref-deepseek from F16 and from Q8_0: Q2_K 0.297, Q4_0 0.086, Q4_K 0.072, Q5_0 0.043.
# A transposed, misordered or misaligned layout is off by about 1.4.
MAX_REL_RMS = {"Q2_K": 0.32, "Q4_0": 0.095, "Q4_K": 0.08, "Q5_0": 0.05}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny")


def tiny_moe(folder: pathlib.Path, arch: str, **kw) -> pathlib.Path:
    """A tiny random MoE with ref-mixtral's 4096-token vocabulary: the gguf package
    parses conftest's 32k-token llama-spm vocabulary for a second at every read."""
    path = folder / (f"{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())) + ".gguf")
    return path if path.exists() else make_synthetic_moe(path, arch, vocab_gguf=MIXTRAL_Q8, **kw)


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def values(t) -> np.ndarray:
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)


def rel_rms(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.sum((a - ref) ** 2) / np.sum(ref ** 2)))


def check_companion(companion, model, reference, target: str, fallback: dict[str, str]) -> None:
    """Exactly the model's expert tensors, in its order and shapes, of the target type (or
    the fallback type for those tensor kinds), close to the reference weights."""
    model_reader, reader = gguf.GGUFReader(model), gguf.GGUFReader(companion)
    expected = [t for t in model_reader.tensors if t.name.endswith(EXPERT_SUFFIXES)]
    assert [t.name for t in reader.tensors] == [t.name for t in expected]
    ref = tensors(reference)
    for t, m in zip(reader.tensors, expected):
        assert list(t.shape) == list(m.shape)
        kind = t.name.split(".", 2)[2]
        assert t.tensor_type.name == fallback.get(kind, target), t.name
        error = rel_rms(values(t), values(ref[t.name]))
        assert error < MAX_REL_RMS[t.tensor_type.name], (t.name, t.tensor_type.name, error)

    # every field of the model, unchanged, plus the companion's own
    for key, field in model_reader.fields.items():
        if not key.startswith("GGUF."):
            assert field_value(reader.fields[key]) == field_value(field), key
    own = set(reader.fields) - set(model_reader.fields)
    assert own <= {companions.KEY_OF, companions.KEY_SOURCE, companions.KEY_TYPE, companions.KEY_FALLBACKS, companions.KEY_OF_FINGERPRINT}
    assert field_value(reader.fields[companions.KEY_OF])[0] == pathlib.Path(model).name.encode()
    assert field_value(reader.fields[companions.KEY_OF_FINGERPRINT])[0] == hobbitpy.files.model_file.model_fingerprint(model).encode()
    assert field_value(reader.fields[companions.KEY_TYPE])[0] == target.encode()
    assert companion_fallbacks(companion) == {t.name: fallback[t.name.split(".", 2)[2]]
                                              for t in reader.tensors if t.name.split(".", 2)[2] in fallback}

    # the native indexer takes it as the model's experts
    a, b = hobbitpy.inspect_model(model), hobbitpy.inspect_model(companion)
    assert (b.arch, b.n_layer, b.n_layer_moe, b.n_expert, b.n_expert_used, b.n_embd) == \
        (a.arch, a.n_layer, a.n_layer_moe, a.n_expert, a.n_expert_used, a.n_embd)
    assert b.expert_bytes_total < a.expert_bytes_total


# (the second pair, the same path with other types: in the slow run)
@pytest.mark.parametrize("target, down", [("Q2_K", "Q4_0"), pytest.param("Q4_K", "Q5_0", marks=pytest.mark.slow)])
def test_from_f16_source(tmp_path, target, down):
    # ref-deepseek's experts have n_ff 128: the down projections' rows are not whole
    # 256-value blocks and fall back as llama-quant.cpp does
    out = prepare_companion(DEEPSEEK_Q8, target, tmp_path / "c.gguf", source_path=DEEPSEEK_F16, progress=False)
    check_companion(out, DEEPSEEK_Q8, DEEPSEEK_F16, target, {"ffn_down_exps.weight": down})


def test_requantized_from_the_model(tmp_path):
    out = prepare_companion(DEEPSEEK_Q8, "Q2_K", tmp_path / "c.gguf", progress=False)
    check_companion(out, DEEPSEEK_Q8, DEEPSEEK_F16, "Q2_K", {"ffn_down_exps.weight": "Q4_0"})
    assert field_value(gguf.GGUFReader(out).fields[companions.KEY_SOURCE])[0] == DEEPSEEK_Q8.name.encode()


def test_only_expert_weights(tiny_dir, tmp_path):
    # gpt-oss has expert biases (they stay in the model); n_embd 128: gate/up rows fall back
    model = tiny_moe(tiny_dir, "gpt-oss")
    out = prepare_companion(model, "Q2_K", tmp_path / "c.gguf", progress=False)
    names = list(tensors(out))
    assert names and all(n.endswith(EXPERT_SUFFIXES) for n in names)
    assert len(names) == 3 * hobbitpy.inspect_model(model).n_layer_moe
    check_companion(out, model, model, "Q2_K", {"ffn_gate_exps.weight": "Q4_0", "ffn_up_exps.weight": "Q4_0"})


def test_source_of_another_model_is_refused(tiny_dir, tmp_path):
    with pytest.raises(hobbitpy.ModelFileError) as e:
        prepare_companion(DEEPSEEK_Q8, "Q2_K", tmp_path / "c.gguf", source_path=MIXTRAL_Q8, progress=False)
    assert str(DEEPSEEK_Q8) in str(e.value) and str(MIXTRAL_Q8) in str(e.value)
    assert "architecture llama, the model's is qwen2moe" in str(e.value)
    # same architecture, other sizes
    tiny = tiny_moe(tiny_dir, "llama")
    with pytest.raises(hobbitpy.ModelFileError, match="embedding_length 128, the model's is 256") as e:
        prepare_companion(MIXTRAL_Q8, "Q2_K", tmp_path / "c.gguf", source_path=tiny, progress=False)
    assert str(tiny) in str(e.value) and "shape [128, 256, 8], the model's is [256, 512, 8]" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_bad_input(tiny_dir, tmp_path):
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match=str(existing)):
        prepare_companion(DEEPSEEK_Q8, "Q2_K", existing, progress=False)
    assert existing.read_bytes() == b"keep"
    with pytest.raises(ValueError, match="unknown expert type 'Q9_K'"):
        prepare_companion(DEEPSEEK_Q8, "Q9_K", tmp_path / "c.gguf", progress=False)
    with pytest.raises(ValueError, match="IQ2_XXS needs an importance matrix"):
        prepare_companion(DEEPSEEK_Q8, "IQ2_XXS", tmp_path / "c.gguf", progress=False)
    with pytest.raises(hobbitpy.ModelFileError, match="not a GGUF file"):
        prepare_companion(existing, "Q2_K", tmp_path / "c.gguf", progress=False)
    with pytest.raises(hobbitpy.ModelFileError, match="missing.gguf: cannot open"):
        prepare_companion(tmp_path / "missing.gguf", "Q2_K", tmp_path / "c.gguf", progress=False)
    with pytest.raises(hobbitpy.ModelFileError, match="no routed expert tensors"):
        prepare_companion(tiny_moe(tiny_dir, "llama", n_expert=0), "Q2_K", tmp_path / "c.gguf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.gguf"]


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    real_quantize = prepare._quantize
    calls = []

    def fail_on_second_tensor(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_quantize(*args)

    monkeypatch.setattr(prepare, "_quantize", fail_on_second_tensor)
    with pytest.raises(KeyboardInterrupt):
        prepare_companion(DEEPSEEK_Q8, "Q4_0", tmp_path / "c.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli(tmp_path, capsys):
    model = tmp_path / DEEPSEEK_Q8.name
    shutil.copy(DEEPSEEK_Q8, model)
    proc = subprocess.run([sys.executable, "-m", "hobbitpy", "prepare", str(model), "--mid", "Q4_K", "--threads", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    low, mid = tmp_path / "ref-deepseek-Q8_0.experts-Q2_K.gguf", tmp_path / "ref-deepseek-Q8_0.experts-Q4_K.gguf"
    assert f"wrote {low}" in proc.stdout and f"wrote {mid}" in proc.stdout
    assert "6 tensors (ffn_down_exps.weight) written as Q4_0" in proc.stdout
    assert "6 tensors (ffn_down_exps.weight) written as Q5_0" in proc.stdout
    assert {t.tensor_type.name for t in tensors(mid).values()} == {"Q4_K", "Q5_0"}

    assert cli.main(["prepare", str(model), "--low", "Q2_K", "--mid", "Q4_K", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--out names one file" in capsys.readouterr().err
    # an existing output is reported before anything is written
    assert cli.main(["prepare", str(model), "--low", "Q3_K", "--mid", "Q4_K"]) == 2
    assert f"{mid}: already exists" in capsys.readouterr().err
    assert not (tmp_path / "ref-deepseek-Q8_0.experts-Q3_K.gguf").exists()


def _ggml_q2_k(values: np.ndarray) -> np.ndarray:
    return ggml.quantize_rows(values, gguf.GGMLQuantizationType.Q2_K)


def test_ggml_quantizes_as_gguf_does():
    # the binding of ggml's quantizer, against gguf-py's numpy Q8_0 (the same rounding)
    values = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert np.array_equal(ggml.quantize_rows(values, q8), gguf.quants.quantize(values, q8))


def test_fast_q2_k_writes_ggml_bytes():
    """libhobbit's Q2_K quantizer (what prepare uses without an importance matrix) writes
    exactly the blocks ggml's reference quantizer writes, on weights of every shape of
    distribution and on sub-blocks that are flat, all zero, all equal, positive, tiny, huge."""
    rng = np.random.default_rng(7)
    n = 2048
    cases = {
        "normal": rng.standard_normal((64, n)),
        "heavy tails": rng.standard_t(3, (64, n)) * 0.02,
        "positive": np.abs(rng.standard_normal((16, n))) + 0.5,
        "tiny": rng.standard_normal((16, n)) * 1e-7,
        "huge": rng.standard_normal((16, n)) * 1e5,
        "few levels": rng.integers(-3, 4, (16, n)) * 0.25,
    }
    mixed = rng.standard_normal((16, n))
    mixed[0] = 0  # whole rows of zeros
    mixed[1, :256] = -1.5  # a super-block of one negative value: every sub-block flat
    mixed[2, ::16] = 0  # zeros inside sub-blocks
    mixed[3] = np.repeat(rng.standard_normal(n // 16), 16)  # each sub-block one value
    mixed[4, :16] = 3.0  # one flat positive sub-block among normal ones
    cases["flat and zero sub-blocks"] = mixed
    for name, values in cases.items():
        values = np.ascontiguousarray(values, dtype=np.float32)
        fast = np.empty_like(_ggml_q2_k(values))
        assert prepare._quantize_rows(values, gguf.GGMLQuantizationType.Q2_K, fast) == fast.nbytes
        assert np.array_equal(fast, _ggml_q2_k(values)), name


def test_ggml_reads_back_what_gguf_reads():
    # the dequantizer prepare reads its source with: ggml's to_float, against gguf-py's numpy one
    for path in (DEEPSEEK_Q8, DEEPSEEK_F16):
        for t in list(tensors(path).values())[:12]:
            raw = np.asarray(t.data).view(np.uint8).reshape(-1, t.n_bytes // (t.n_elements // int(t.shape[0])))
            n_per_row = int(t.shape[0])
            got = ggml.rows_as_float(raw, int(t.tensor_type), n_per_row)
            assert np.array_equal(got, values(t).reshape(got.shape).astype(np.float32)), t.name


def _partials(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".partial"))


def test_sigterm_and_sighup_leave_no_partial_file(tmp_path):
    # IQ4_XS is ggml's slowest quantizer without a matrix: seconds for this model, time to signal it
    model = tmp_path / MIXTRAL_Q8.name
    shutil.copy(MIXTRAL_Q8, model)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "prepare", str(model), "--low", "IQ4_XS"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
        deadline = time.monotonic() + 60
        while not _partials(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # into the quantizing
        assert proc.poll() is None, "prepare ended before it could be signalled"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        assert sorted(p.name for p in tmp_path.iterdir()) == [model.name]


def test_partial_files_of_dead_runs_are_removed(tmp_path):
    out = tmp_path / "c.gguf"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)  # a process that has ended (its id not reused this soon)
    dead = tmp_path / f".c.gguf.{dead_pid}.k2j4abcd.partial"
    alive = tmp_path / f".c.gguf.{os.getpid()}.zz9_abcd.partial"  # a run still going: kept
    other = tmp_path / f".d.gguf.{dead_pid}.k2j4abcd.partial"  # another output's: not this run's to judge
    for p in (dead, alive, other):
        p.write_bytes(b"x" * 1000)
    prepare_companion(DEEPSEEK_Q8, "Q2_K", out, progress=False)
    assert out.is_file() and not dead.exists() and alive.exists() and other.exists()


def test_not_enough_disk_is_one_line_before_any_work(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    # a real file system with 1 MB free: the companion needs ~7 MB
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        out = small / "c.gguf"
        start = time.monotonic()
        assert cli.main(["prepare", str(DEEPSEEK_Q8), "--out", str(out)]) == 2
        assert time.monotonic() - start < 10
        assert list(small.iterdir()) == []
        proc = subprocess.run([sys.executable, "-m", "hobbitpy", "prepare", str(DEEPSEEK_Q8), "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(out) in lines[0] and "GB free" in lines[0] and "needs" in lines[0], proc.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
