"""Shared fixtures: tiny MoE GGUF models made here, with a real tokenizer."""

from __future__ import annotations

import pathlib
import signal
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hobbitpy  # noqa: E402  (sets LLAMA_CPP_LIB_PATH before llama_cpp loads)
from hobbitpy._native import DATA_DIR  # noqa: E402
from hobbitpy.synthetic_moe import make_synthetic_moe  # noqa: E402

VOCAB = DATA_DIR / "ggml-vocab-llama-spm.gguf"
ARCHES = ["llama", "qwen2moe", "gpt-oss"]
MB = 1024 * 1024

PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"
CONTINUATION = " told stories about the storms he had seen and the fish that got away"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("models")


_built: dict[tuple, pathlib.Path] = {}


def tiny_model(model_dir: pathlib.Path, arch: str = "llama", **kw) -> pathlib.Path:
    """Build (once per session) a tiny MoE of this arch and shape."""
    key = (arch, tuple(sorted(kw.items())))
    if key not in _built:
        name = f"tiny-{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())) + ".gguf"
        _built[key] = make_synthetic_moe(model_dir / name, arch, vocab_gguf=VOCAB, **kw)
    return _built[key]


def run_logits(path, offload: hobbitpy.OffloadConfig, *, n_threads: int = 2):
    """Logits of a prompt evaluated as one batch, then of single-token decode steps;
    the greedy completion; and the cache statistics."""
    llm = hobbitpy.Llama(path, offload=offload, n_ctx=256, n_batch=256, logits_all=True,
                         verbose=False, n_threads=n_threads, n_threads_batch=n_threads)
    try:
        prompt = llm.tokenize(PROMPT.encode())
        decode = llm.tokenize(CONTINUATION.encode(), add_bos=False)[:10]
        llm.eval(prompt)
        for t in decode:
            llm.eval([t])
        scores = np.array(llm.scores[: llm.n_tokens], dtype=np.float32, copy=True)
        stats = llm.offload_stats()
        llm.reset()
        text = llm.create_completion(PROMPT, max_tokens=16, temperature=0.0)["choices"][0]["text"]
        return scores, text, stats, llm.model_info
    finally:
        llm.close()


def default_signals() -> None:
    """preexec_fn of a child a test interrupts with a signal: SIGINT's and SIGHUP's default
    dispositions, as in a terminal. A suite started in the background of a non-interactive
    shell inherits SIGINT ignored (Python then installs no KeyboardInterrupt handler in its
    children), and one started with nohup SIGHUP ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
