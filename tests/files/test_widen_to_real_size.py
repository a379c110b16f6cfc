"""scripts/widen_to_real_size.py: a real-size file made from the small model's own-size Q4_K_M
(the seed a repository keeps) is the file made from its F32 weights, byte for byte."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from hobbitpy.files.synthetic_moe import make_synthetic_moe

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "widen_to_real_size.py"


def widen(src: pathlib.Path, dst: pathlib.Path, n_embd: int, n_ff: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(src), str(dst), "--n-embd", str(n_embd), "--n-ff",
                           str(n_ff), *flags], capture_output=True, text=True, timeout=300)


def test_the_seed_widens_to_the_same_bytes_as_the_weights(tmp_path):
    small = make_synthetic_moe(tmp_path / "small.gguf", "llama", n_layer=2, n_embd=256, n_ff=256, expert_type="F32")
    for src, dst, n_embd, n_ff in ((small, "seed.gguf", 256, 256), (small, "from-weights.gguf", 1024, 512),
                                   (tmp_path / "seed.gguf", "from-seed.gguf", 1024, 512)):
        proc = widen(src, tmp_path / dst, n_embd, n_ff)
        assert proc.returncode == 0, proc.stderr
    seed, a, b = (tmp_path / n for n in ("seed.gguf", "from-weights.gguf", "from-seed.gguf"))
    assert a.read_bytes() == b.read_bytes()
    # a file quantized otherwise is no seed of this file type: refused by name, nothing written
    proc = widen(seed, tmp_path / "no.gguf", 1024, 512, "--ftype", "Q3_K_M")
    assert proc.returncode == 2 and "weight is Q4_K, not F32, F16 or the Q3_K of Q3_K_M" in proc.stderr
    assert not (tmp_path / "no.gguf").exists()
