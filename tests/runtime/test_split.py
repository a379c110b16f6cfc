"""A model split into several files (llama.cpp's gguf-split, NAME-00001-of-0000N.gguf) is one
model wherever a model path is accepted: indexed from its first part, offloaded with stock's
bits, prepared, laddered, and refused with one clear line when a part is wrong or missing."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import gguf
import numpy as np
import openai
import pytest

import hobbitpy
from hobbitpy.files.model_file import layer_expert_bytes, model_fingerprint, model_parts
from hobbitpy.copies.prepare import EXPERT_SUFFIXES, prepare_companion

from conftest import MB, copy_gguf, run_logits
from serving import start_server, stop_server

MODEL = pathlib.Path(__file__).resolve().parents[2] / "models" / "ref-mixtral-Q8_0.gguf"
N_PARTS = 3
SPLIT_PROMPT = "And God said"


def split_model(src: pathlib.Path, name: pathlib.Path, n_parts: int) -> pathlib.Path:
    """`src` written again split into n_parts files, as llama.cpp's gguf-split writes one (the
    metadata in the first, the tensors in order over all, split.* keys in each); returns the
    first part, name's stem + -00001-of-0000N.gguf."""
    copy_gguf(src, name, split_max_tensors=-(-len(gguf.GGUFReader(src).tensors) // n_parts))
    return name.with_name(f"{name.stem}-00001-of-{n_parts:05d}.gguf")


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("split")
    first = split_model(MODEL, folder / "mixtral.gguf", N_PARTS)
    assert len(list(folder.glob("mixtral-0000?-of-00003.gguf"))) == N_PARTS
    return first


def test_the_parts_are_one_model(split):
    whole, parts = hobbitpy.inspect_model(MODEL), hobbitpy.inspect_model(split)
    assert parts.n_split == N_PARTS
    assert [pathlib.Path(p).name for p in model_parts(split)] == [f"mixtral-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    # the experts of every part are indexed, as in the one file
    for field in ("n_layer", "n_layer_moe", "n_expert", "expert_bytes", "expert_bytes_total", "min_budget_bytes",
                  "n_vocab", "n_ff_expert", "max_slice_bytes"):
        assert getattr(parts, field) == getattr(whole, field), field
    assert parts.file_bytes == sum(pathlib.Path(p).stat().st_size for p in model_parts(split))
    # the experts really are spread over the parts (else this tests one file)
    tensors = {p: gguf.GGUFReader(p).tensors for p in model_parts(split)}
    holding = {p for p, ts in tensors.items() if any(t.name.endswith(EXPERT_SUFFIXES) for t in ts)}
    assert len(holding) >= 2
    # one expert's bytes per MoE layer, from the header by the runtime's index: the tensors' bytes
    # over every part
    per_layer: dict[int, int] = {}
    for t in (t for ts in tensors.values() for t in ts if t.name.endswith(EXPERT_SUFFIXES)):
        per_layer[int(t.name.split(".")[1])] = per_layer.get(int(t.name.split(".")[1]), 0) + int(t.n_bytes) // whole.n_expert
    assert layer_expert_bytes(split).tolist() == [per_layer[il] for il in sorted(per_layer)]
    assert layer_expert_bytes(split).tolist() == layer_expert_bytes(MODEL).tolist()
    assert model_fingerprint(split) == model_fingerprint(MODEL)


@pytest.mark.parametrize("mode", ["gpu-centric", "cooperative"])
def test_offloaded_split_model_gives_stock_bits(split, mode):
    """Every expert read from the part that holds it, loaded or computed in place on that
    part's mapping: the logits of the one file under stock llama.cpp, bit for bit."""
    ref_scores, ref_text, ref_stats, info = run_logits(MODEL, hobbitpy.OffloadConfig(enabled=False))
    assert not ref_stats["offloaded"]
    scores, text, stats, _ = run_logits(split, hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes / MB, mode=mode))
    assert stats["offloaded"]
    assert stats["expert_inplace" if mode == "cooperative" else "expert_misses"] > 0
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text


def test_prepare_and_ladder_on_a_split_model(split, tmp_path):
    """prepare reads each expert tensor from its part: the same companion as of the one file;
    a ladder on the split model then gives the logits it gives on the one file."""
    of_whole = prepare_companion(MODEL, "Q2_K", tmp_path / "whole.experts-Q2_K.gguf", progress=False)
    of_split = prepare_companion(split, "Q2_K", tmp_path / "split.experts-Q2_K.gguf", progress=False)
    a = {t.name: t for t in gguf.GGUFReader(of_whole).tensors}
    b = {t.name: t for t in gguf.GGUFReader(of_split).tensors}
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name

    info = hobbitpy.inspect_model(split)
    # hits exact: a hit at another level than wanted is not upgraded in the background, whose
    # timing would make two runs differ (of one file as of two)
    ladder = dict(cache_mb=info.expert_bytes_total * 0.6 / MB, mode="gpu-centric", hits="exact")
    whole_scores, whole_text, _, _ = run_logits(MODEL, hobbitpy.OffloadConfig(low=str(of_whole), **ladder))
    split_scores, split_text, stats, _ = run_logits(split, hobbitpy.OffloadConfig(low=str(of_split), **ladder))
    assert stats["n_level"] == 2
    assert np.array_equal(split_scores.view(np.uint32), whole_scores.view(np.uint32))
    assert split_text == whole_text


def test_run_and_serve_give_the_split_model_the_text_of_the_one_file(split):
    """`hobbitpy run` and `hobbitpy serve` take the first part: at temperature 0 both give the
    text the one file gives under `run`, offloaded at 8 MB."""
    def run(model):
        proc = subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(model), "--prompt", SPLIT_PROMPT, "-n", "12",
                               "--no-echo", "--temp", "0", "--cache-mb", "8", "--threads", "2"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.rstrip("\n")

    whole = run(MODEL)
    assert whole and run(split) == whole
    proc, base = start_server(model=split)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        r = client.completions.create(model="ref-mixtral", prompt=SPLIT_PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"repeat_penalty": 1.0})  # run's (llama.cpp's) default
        assert r.choices[0].text == whole
    finally:
        stop_server(proc)


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hobbitpy", "run", *map(str, args), "-p", "Hi", "-n", "2"],
                          capture_output=True, text=True, timeout=300)


def test_a_wrong_or_missing_part_is_one_clear_line(split, tmp_path):
    second = split.with_name("mixtral-00002-of-00003.gguf")
    with pytest.raises(hobbitpy.ModelFileError, match=r"part 2 of a model split into 3 files; give its first part "
                                                      r"\(.*mixtral-00001-of-00003\.gguf\)"):
        hobbitpy.inspect_model(second)
    proc = _run(second)
    assert proc.returncode == 2 and "give its first part" in proc.stderr and "Traceback" not in proc.stderr

    # the third part gone: the error names it, before llama.cpp loads anything
    folder = tmp_path / "incomplete"
    folder.mkdir()
    for i in (1, 2):
        shutil.copy(split.with_name(f"mixtral-{i:05d}-of-00003.gguf"), folder)
    first = folder / "mixtral-00001-of-00003.gguf"
    with pytest.raises(hobbitpy.ModelFileError, match=r"part 3 of 3 of this split model: .*mixtral-00003-of-00003\.gguf: "
                                                      r"cannot open model file"):
        hobbitpy.inspect_model(first)
    proc = _run(first)
    assert proc.returncode == 2 and "mixtral-00003-of-00003.gguf" in proc.stderr and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [proc.stderr.splitlines()[-1]], proc.stderr

    # a first part renamed: llama.cpp could not find the others either
    renamed = folder / "renamed.gguf"
    shutil.copy(first, renamed)
    with pytest.raises(hobbitpy.ModelFileError, match="not named as llama.cpp finds the others"):
        hobbitpy.inspect_model(renamed)
