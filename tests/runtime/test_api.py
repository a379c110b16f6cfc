"""hobbitpy.Llama is a drop-in for llama_cpp.Llama: chat completion and streaming
work through the offloaded model and give the stock results."""

from __future__ import annotations

import llama_cpp

import hobbitpy
from conftest import MB, tiny_model

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


def _chat_and_stream(path, offload):
    with hobbitpy.Llama(path, offload=offload, n_ctx=256, verbose=False, n_threads=2,
                        chat_format="llama-2") as llm:
        chat = llm.create_chat_completion(messages=MESSAGES, max_tokens=12, temperature=0.0)
        pieces = [c["choices"][0]["text"] for c in
                  llm.create_completion("In the beginning", max_tokens=12, temperature=0.0, stream=True)]
        return chat["choices"][0]["message"]["content"], "".join(pieces), llm.offloaded


def test_chat_and_streaming_match_stock(model_dir):
    path = tiny_model(model_dir, "gpt-oss")
    info = hobbitpy.inspect_model(path)
    stock = _chat_and_stream(path, hobbitpy.OffloadConfig(enabled=False))
    offl = _chat_and_stream(path, hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes * 2 / MB))
    assert stock[2] is False and offl[2] is True
    assert offl[:2] == stock[:2]
    assert len(stock[1]) > 0


def test_is_a_llama_cpp_llama(model_dir):
    assert issubclass(hobbitpy.Llama, llama_cpp.Llama)


def test_native_defaults_are_offload_configs():
    # a C caller of hobbit_default_params() and a Python one of OffloadConfig() get the same runtime
    from hobbitpy.binding.native import lib
    from hobbitpy.settings.config import HIT_POLICIES, MODES, OffloadConfig

    c, py = lib.hobbit_default_params(), OffloadConfig()
    assert (c.policy_weights.lru, c.policy_weights.lfu, c.policy_weights.lhu, c.policy_weights.fld) == py.policy_weights
    assert c.policy == 0 and py.policy is None and py.cache_policy == "lru"  # (None: chosen by the run, else lru)
    assert (c.prefetch_layers, c.prefetch_width, c.direct_io, c.n_io_threads, c.seed) == (
        py.prefetch_layers, py.prefetch_width, py.direct_io, py.io_threads, py.seed)
    assert abs(c.t1 - py.t1) < 1e-6 and abs(c.t2 - py.t2) < 1e-6 and abs(c.t_mid - (py.t1 + py.t2) / 2) < 1e-6
    assert HIT_POLICIES[c.hit_policy] == py.hits and MODES[c.mode] == py.mode and c.warm_low == py.warm


def test_a_grammar_handed_to_the_api_is_checked_before_llama_cpp_parses_it(model_dir):
    # llama-cpp-python chained the null sampler llama.cpp returns for a bad grammar: the
    # interpreter died (SIGSEGV), as it did on one nested 20,000 deep. A child process, so a
    # crash fails this test instead of ending the suite
    import subprocess
    import sys

    script = f"""
import hobbitpy
from llama_cpp import LlamaGrammar
llm = hobbitpy.Llama({str(tiny_model(model_dir, "llama"))!r}, n_ctx=64, verbose=False)
for text in ("root ::= (", "root ::= " + "(" * 20000 + '"a"' + ")" * 20000):
    try:
        llm("x", max_tokens=2, grammar=LlamaGrammar.from_string(text, verbose=False))
    except hobbitpy.HobbitError as e:
        print("refused:", e)
print(repr(llm("x", max_tokens=2, temperature=0, grammar=LlamaGrammar.from_string('root ::= "yes"', verbose=False))
           ["choices"][0]["text"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "refused: the grammar does not parse (GBNF, with a root rule; llama.cpp's log says where)"
    assert lines[1] == "refused: the grammar nests groups 20000 deep; at most 1000 are parsed"
    assert lines[2] in ("'yes'", "'y'", "'ye'"), lines


def test_a_token_id_out_of_range_is_refused_not_an_abort(model_dir):
    # llama.cpp's vector::at threw through the C API: the interpreter aborted (the server too)
    import subprocess
    import sys

    script = f"""
import hobbitpy
llm = hobbitpy.Llama({str(tiny_model(model_dir, "llama"))!r}, n_ctx=64, verbose=False)
for ids in ([-266], [5, llm.n_vocab()]):
    try:
        llm.detokenize(ids)
    except hobbitpy.HobbitError as e:
        print("refused:", e)
try:  # llama_cpp's decode would fail with "llama_decode returned -1"
    llm.create_completion([5, 99999], max_tokens=2)
except hobbitpy.HobbitError as e:
    print("refused:", e)
print(len(llm.detokenize([5, 6])) > 0)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused: -266 is not a token id of this model")
    assert lines[1].startswith("refused: ") and "is not a token id" in lines[1], lines
    assert lines[2] == "refused: prompt: 99999 is not a token id of this model (an integer from 0 to 31999)", lines
    assert lines[3] == "True", lines
