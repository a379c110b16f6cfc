"""Shared fixtures: tiny MoE GGUF models made here, with a real tokenizer."""

from __future__ import annotations

import functools
import pathlib
import signal
import subprocess
import sys

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hobbitpy  # noqa: E402  (sets LLAMA_CPP_LIB_PATH before llama_cpp loads)
from hobbitpy.binding.native import DATA_DIR  # noqa: E402
from hobbitpy.copies.prepare import prepare_companion  # noqa: E402
from hobbitpy.files.gguf_fields import field_value  # noqa: E402
from hobbitpy.files.synthetic_moe import FEATURE_ARCHES, make_synthetic_moe  # noqa: E402
from hobbitpy.files.trace_file import TRACE_VERSION, Trace  # noqa: E402

VOCAB = DATA_DIR / "ggml-vocab-llama-spm.gguf"
# the architectures every feature's tests run on; the others have their exactness test
# (tests/runtime/test_architectures.py)
ARCHES = list(FEATURE_ARCHES)
MB = 1024 * 1024

# a short text to score (eval's windows of 32 tokens)
EVAL_TEXT = ("The keeper climbed the stairs of the tower every evening, lit the lamp and watched the sea. "
             "Ships passed in the dark, and the light turned slowly over the water until the morning came. ") * 3

PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"
CONTINUATION = " told stories about the storms he had seen and the fish that got away"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("models")


_built: dict[tuple, pathlib.Path] = {}


def fast_first(values, keep: int = 1) -> list:
    """Parameters whose first `keep` run in the README's test command and the rest in the slow
    run (the same check on other architectures or shapes: CI runs them all)."""
    return [v if i < keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for i, v in enumerate(values)]


def tiny_model(model_dir: pathlib.Path, arch: str = "llama", **kw) -> pathlib.Path:
    """Build (once per session) a tiny MoE of this arch and shape."""
    key = (arch, tuple(sorted(kw.items())))
    if key not in _built:
        name = f"tiny-{arch}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())) + ".gguf"
        _built[key] = make_synthetic_moe(model_dir / name, arch, vocab_gguf=VOCAB, **kw)
    return _built[key]


@functools.cache
def expert_tensor_spans(path: pathlib.Path) -> tuple[tuple[int, int], ...]:
    """(offset, bytes) of each routed expert tensor of a model file, in file order; read once a
    session (gguf-py parses the test models' 32,000-token vocabulary in seconds). The
    generator writes them last, after every other tensor."""
    return tuple(sorted((int(t.data_offset), int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors
                        if "_exps." in t.name))


def session_copy(path: pathlib.Path, type_name: str) -> pathlib.Path:
    """A `prepare` companion of a session model in this type, made once beside it
    (`<stem>.<type>.gguf`)."""
    copy = path.with_name(f"{path.stem}.{type_name.lower()}.gguf")
    if not copy.exists():
        prepare_companion(path, type_name, out_path=copy, progress=False)
    return copy


def model_without_byte_tokens(tmp_path: pathlib.Path) -> pathlib.Path:
    """A MoE whose SPM vocabulary has letters but no <0xXX> byte tokens: llama.cpp's
    tokenizer throws on any other character (llama_vocab::byte_to_token)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>", "\u2581"] + letters + ["\u2581" + c for c in letters]
    vocab = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    vocab.add_tokenizer_model("llama")
    vocab.add_token_list(tokens)
    vocab.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(tokens) - 3)])
    vocab.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    vocab.add_bos_token_id(1)
    vocab.add_eos_token_id(2)
    vocab.add_unk_token_id(0)
    vocab.write_header_to_file()
    vocab.write_kv_data_to_file()
    vocab.write_tensors_to_file()
    vocab.close()
    return make_synthetic_moe(tmp_path / "no-bytes.gguf", "llama", vocab_gguf=tmp_path / "vocab.gguf")


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


def prompt_logits(path, offload: hobbitpy.OffloadConfig, *, n_decode: int = 6, repack: bool | None = None):
    """run_logits' first part alone, for the tests that sweep many models: the logits of the
    prompt as one batch and of n_decode single-token steps, and the cache statistics.
    repack: Llama's (None: as the memory allows, which a test model always fits)."""
    llm = hobbitpy.Llama(path, offload=offload, n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2,
                         n_threads_batch=2, repack=repack)
    try:
        llm.eval(llm.tokenize(PROMPT.encode()))
        for t in llm.tokenize(CONTINUATION.encode(), add_bos=False)[:n_decode]:
            llm.eval([t])
        return np.array(llm.scores[: llm.n_tokens], dtype=np.float32, copy=True), llm.offload_stats()
    finally:
        llm.close()


_reference: dict = {}


def reference(path):
    """Stock llama.cpp's run_logits on this model (offload off), once per session."""
    if path not in _reference:
        _reference[path] = run_logits(path, hobbitpy.OffloadConfig(enabled=False))
    return _reference[path]


def evaluate_text(path, config: hobbitpy.OffloadConfig, **kw):
    """`evaluate` of EVAL_TEXT in windows of 32 tokens."""
    from hobbitpy.measure.evaluate import evaluate

    return evaluate(path, EVAL_TEXT, config, n_ctx=32, n_threads=2, **kw)


def hand_trace(experts, *, n_expert: int = 8, predicted=None, seq_start=None, weight: float | None = None,
               expert_bytes: int = MB) -> Trace:
    """A routing trace written by hand, [tokens, layers, k] selections: gate weights `weight`
    (default 1/k), no router probabilities, the next layers' guesses `predicted` (default
    none), prompts starting where seq_start says (default one prompt)."""
    experts = np.asarray(experts, np.int32)
    n, n_layer, k = experts.shape
    lookahead = 0 if predicted is None else np.asarray(predicted).shape[2]
    return Trace(experts=experts, weights=np.full(experts.shape, 1.0 / k if weight is None else weight, np.float32),
                 probs=np.zeros((n, n_layer, n_expert), np.float16),
                 predicted=np.full((n, n_layer, 0, k), -1, np.int32) if predicted is None else predicted,
                 seq_start=np.zeros(n, np.uint8) if seq_start is None else np.asarray(seq_start, np.uint8),
                 tokens=np.zeros(n, np.int32),
                 meta={"trace_version": TRACE_VERSION, "model": "hand-made", "n_expert": n_expert, "n_moe_layer": n_layer,
                       "n_expert_used": k, "expert_bytes": expert_bytes, "expert_bytes_total": expert_bytes * n_expert * n_layer,
                       "lookahead": lookahead, "uniform": True})


def hobbitpy_cli(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """`python -m hobbitpy ARGS` in a child process, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "hobbitpy", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def default_signals() -> None:
    """preexec_fn of a child a test interrupts with a signal: SIGINT's and SIGHUP's default
    dispositions, as in a terminal. A suite started in the background of a non-interactive
    shell inherits SIGINT ignored (Python then installs no KeyboardInterrupt handler in its
    children), and one started with nohup SIGHUP ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


# budgets as a function of the model: the minimum (one token's top-k: prefill runs
# mostly in place), one slot more, half the experts, every expert
BUDGETS = {
    "min": lambda info: info.min_budget_bytes,
    "min+1": lambda info: info.min_budget_bytes + info.expert_bytes,
    "half": lambda info: info.expert_bytes_total // 2,
    "all": lambda info: info.expert_bytes_total,
}


EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_up_exps.weight")


def copy_gguf(src: pathlib.Path, dst: pathlib.Path, *, arch: str | None = None, keep=lambda name: True,
              **writer_kw) -> pathlib.Path:
    """src's metadata and the tensors `keep` accepts, written again by gguf-py (under another
    architecture's name, its keys renamed, when arch is given; writer_kw to GGUFWriter, e.g.
    split_max_tensors for llama.cpp's split format). The written path (a split's first part
    is named by the writer)."""
    reader = gguf.GGUFReader(src)
    old = field_value(reader.fields["general.architecture"])[0].decode()
    arch = arch or old
    writer = gguf.GGUFWriter(dst, arch, **writer_kw)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype, sub = field_value(field)
        if key == "general.alignment":
            writer.add_custom_alignment(int(value))
        else:
            writer.add_key_value(arch + key[len(old):] if key.startswith(old + ".") else key, value, vtype, sub)
    for t in reader.tensors:
        if keep(t.name):
            # t.data of a quantized tensor is its bytes, shaped [..., bytes per row]
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def identical_companion(model: pathlib.Path, out: pathlib.Path, *, drop: str | None = None) -> pathlib.Path:
    """An expert-only GGUF with the model's metadata and byte copies of its expert
    tensors (minus the tensor named drop, to make a broken one)."""
    if out.exists():
        return out
    return copy_gguf(model, out, keep=lambda name: name.endswith(EXPERT_SUFFIXES) and name != drop)


def assert_bit_equal(scores, ref_scores):
    assert scores.shape == ref_scores.shape
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
