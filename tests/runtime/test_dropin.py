"""hobbitpy.Llama as a drop-in, from any angle a user comes at it: `import llama_cpp` works
on its own and in either order with hobbitpy (one libllama, hobbitpy's); offload settings
are keywords like llama_cpp's own, and a misspelt one is an error, not silently ignored."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hobbitpy
from hobbitpy.binding.native import LIB_DIR
from conftest import MB, tiny_model

# the libllama files this interpreter has mapped
MAPPED = "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libllama' in l}))"


def _python(code: str, **env_extra) -> subprocess.CompletedProcess:
    # a fresh interpreter, as a user's: nothing of this test process's environment about llama
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_llama_cpp_imports_on_its_own():
    p = _python("import llama_cpp; print(llama_cpp.llama_supports_mmap()); " + MAPPED)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == "True"
    assert p.stdout.splitlines()[1] == repr([str((LIB_DIR / "libllama.so").resolve())])


def test_llama_cpp_alone_finds_a_cpu_backend(model_dir):
    # a portable build's CPU backends are modules beside libggml: llama_cpp's own Llama, with
    # nothing of hobbitpy imported, must find one there (not in the interpreter's directory
    # or the working directory, where ggml alone would look)
    path = tiny_model(model_dir, "llama")
    p = _python(f"import llama_cpp; llm = llama_cpp.Llama({str(path)!r}, n_ctx=64, verbose=False); "
                "print(len(llm.create_completion('a', max_tokens=2)['choices'][0]['text']) >= 0); " + MAPPED)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines()[0] == "True"
    assert p.stdout.splitlines()[1] == repr([str((LIB_DIR / "libllama.so").resolve())])


def test_a_backend_planted_in_the_working_directory_is_never_loaded(model_dir, tmp_path):
    # stock ggml loads every libggml-<backend>-*.so it finds in the working directory to score
    # it, which runs its code; hobbitpy's loads its backends from beside libggml only
    marker = tmp_path / "planted-code-ran"
    src = tmp_path / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE * f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    cc = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libggml-cpu-planted.so"), str(src)],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    path = tiny_model(model_dir, "llama")
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    p = subprocess.run([sys.executable, "-c", f"import llama_cpp; llama_cpp.Llama({str(path)!r}, n_ctx=64, verbose=False)"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not marker.exists(), "a library in the working directory was loaded"


@pytest.mark.parametrize("order", ["import llama_cpp, hobbitpy", "import hobbitpy, llama_cpp"])
def test_either_import_order_loads_hobbitpys_library(order):
    p = _python(order + "; assert hobbitpy.Llama.__mro__[1] is llama_cpp.Llama; " + MAPPED)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == repr([str((LIB_DIR / "libllama.so").resolve())])


def test_another_libllama_loaded_first_is_refused_with_both_paths(tmp_path):
    # llama_cpp pointed elsewhere by the user and imported first: hobbitpy cannot share that
    # library, and says so instead of failing later in a confusing way
    # (with what an installed wheel keeps beside the package: auditwheel's copy of libgomp)
    for lib in [*LIB_DIR.glob("lib*.so"), *LIB_DIR.parent.parent.glob("hobbitpy.libs/*.so*")]:
        shutil.copy(lib, tmp_path / lib.name)
    p = _python("import llama_cpp, hobbitpy", LLAMA_CPP_LIB_PATH=str(tmp_path))
    assert p.returncode != 0
    assert "ImportError" in p.stderr and str(tmp_path) in p.stderr and "import hobbitpy first" in p.stderr


def test_offload_settings_are_keywords(model_dir):
    path = tiny_model(model_dir, "llama")
    budget_mb = hobbitpy.inspect_model(path).min_budget_bytes * 2 / MB
    with hobbitpy.Llama(path, cache_mb=budget_mb, prefetch_layers=1, policy="lfu", n_ctx=64, verbose=False) as llm:
        assert llm.offloaded
        assert llm.offload_stats()["budget_bytes"] == int(budget_mb * MB)
        assert llm.offload_stats()["pool_device"] == "CPU"  # no GPU here
    # a dict of OffloadConfig fields, keywords on top of it
    with hobbitpy.Llama(path, offload={"cache_mb": budget_mb * 2}, cache_mb=budget_mb, n_ctx=64, verbose=False) as llm:
        assert llm.offload_stats()["budget_bytes"] == int(budget_mb * MB)
        offloaded = llm.offload_stats()
        assert offloaded["offloaded"] and offloaded["reason"]
    with hobbitpy.Llama(path, offload=False, n_ctx=64, verbose=False) as llm:
        assert not llm.offloaded
    # the experts resident (every one fits: the default keeps them): the same counters, each 0,
    # and why (the README's `print(llm.offload_stats())` on a model that fits printed None)
    with hobbitpy.Llama(path, n_ctx=64, verbose=False) as llm:
        llm("And God said", max_tokens=2)
        resident = llm.offload_stats()
        assert not llm.offloaded and resident["offloaded"] is False and "fit" in resident["reason"], resident
        assert resident.keys() == offloaded.keys()
        assert resident["expert_hits"] == resident["expert_misses"] == resident["bytes_read"] == 0
        assert resident["pool_device"] is None


def test_profile_keyword_and_keywords_on_top(model_dir, tmp_path):
    from hobbitpy.plan.profile import Profile

    path = tiny_model(model_dir, "llama")
    budget_mb = hobbitpy.inspect_model(path).min_budget_bytes * 2 / MB
    saved = Profile(model=os.path.basename(path), model_bytes=os.path.getsize(path),
                    settings={"t1": 0.5, "policy": "lhu"}, calibration={}).save(tmp_path / "p.json")
    with hobbitpy.Llama(path, profile=saved, policy="lfu", cache_mb=budget_mb, n_ctx=64, verbose=False) as llm:
        assert llm.offloaded
        assert llm.offload_config.t1 == 0.5 and llm.offload_config.policy == "lfu"


def test_misspelt_keywords_are_type_errors_naming_them(model_dir):
    path = tiny_model(model_dir, "llama")
    with pytest.raises(TypeError, match=r"'cach_mb'.*did you mean 'cache_mb'"):
        hobbitpy.Llama(path, cach_mb=8)
    with pytest.raises(TypeError, match="cach_mb"):
        hobbitpy.Llama(path, offload={"cach_mb": 8})
    with pytest.raises(TypeError, match="n_ctxx"):
        hobbitpy.Llama(path, n_ctxx=64)
    with pytest.raises(ValueError, match="cache policy"):
        hobbitpy.Llama(path, policy="fifo")
    with pytest.raises(TypeError, match="not both"):
        hobbitpy.Llama(path, offload={"cache_mb": 8}, profile="x.json")


def test_a_setting_of_the_wrong_type_is_a_type_error_naming_it(model_dir):
    """A number given as text is said so by the setting's name, not by a comparison deep
    in the checks ("'<' not supported between instances of 'int' and 'str'")."""
    path = tiny_model(model_dir, "llama")
    with pytest.raises(TypeError, match=r"^cache_mb must be a number or None, got '4'$"):
        hobbitpy.Llama(path, cache_mb="4")
    with pytest.raises(TypeError, match=r"^io_threads must be an integer, got 2.5$"):
        hobbitpy.Llama(path, offload={"io_threads": 2.5})
    with pytest.raises(TypeError, match=r"^warm must be True or False, got 1$"):
        hobbitpy.OffloadConfig(warm=1)
    config = hobbitpy.OffloadConfig(cache_mb=np.float32(8), io_threads=np.int64(2))  # numpy's numbers are numbers,
    assert type(config.cache_mb) is float and type(config.io_threads) is int  # kept as Python's (JSON writes them)


def test_shipped_models_chat_in_the_format_they_were_trained_on():
    """Their chat template puts each message on its own line (they saw one verse per line):
    create_chat_completion uses it instead of falling back to llama-2's with a warning."""
    import pathlib

    models = pathlib.Path(__file__).resolve().parents[2] / "models"
    for name in ("ref-mixtral-Q8_0.gguf", "ref-deepseek-Q8_0.gguf", "ref-deepseek-F16.gguf"):
        llm = hobbitpy.Llama(models / name, cache_mb=8, n_ctx=256, verbose=False, n_threads=2)
        try:
            assert llm.chat_format == "chat_template.default", name
            assert "tokenizer.chat_template" in llm.metadata
            messages = [{"role": "user", "content": "In the beginning God created the heaven and the earth."},
                        {"role": "assistant", "content": "And the earth was without form, and void."},
                        {"role": "user", "content": "And God said, Let there be light: and there was light."}]
            reply = llm.create_chat_completion(messages, max_tokens=8, temperature=0.0)
            text = reply["choices"][0]["message"]["content"]
            # the same as completing the lines themselves
            lines = "".join(m["content"] + "\n" for m in messages)
            plain = llm.create_completion(lines, max_tokens=8, temperature=0.0)["choices"][0]["text"]
            assert text == plain and text.strip(), name
        finally:
            llm.close()


def test_one_llama_from_two_threads_is_a_clear_error_not_a_crash(model_dir):
    script = textwrap.dedent(f"""
        import threading, hobbitpy
        llm = hobbitpy.Llama({str(tiny_model(model_dir, "llama"))!r}, cache_mb=8, n_ctx=512, n_batch=8,
                             verbose=False, n_threads=1)
        errors, barrier = [], threading.Barrier(2)
        def decode():
            barrier.wait()
            try:
                for _ in range(5):
                    llm.reset()
                    llm.eval(list(range(100, 400)))  # many small batches: long enough to overlap
            except hobbitpy.HobbitError as e:
                errors.append(str(e))
        threads = [threading.Thread(target=decode) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("errors:", errors[:1])
        llm.close()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-800:]
    assert "is decoding in another thread" in p.stdout
