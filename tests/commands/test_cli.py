"""hobbitpy run: the same greedy text offloaded and stock, statistics as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hobbitpy
from conftest import MB, default_signals, hobbitpy_cli, tiny_model

REQUIRED_STATS = ["n_prompt_tokens", "n_tokens", "prefill_ms", "decode_tok_s", "expert_hits",
                  "expert_misses", "bytes_read", "peak_pool_bytes", "budget_bytes"]


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "hobbitpy", "run", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_half_budget_prints_the_stock_greedy_text(model_dir, tmp_path):
    path = tiny_model(model_dir, "qwen2moe")
    info = hobbitpy.inspect_model(path)
    half_mb = f"{info.expert_bytes_total / 2 / MB:.4f}"
    common = [path, "--prompt", "The harbour at dawn", "-n", "24", "--temp", "0", "--threads", "2"]

    stock = run(*common, "--no-offload", "--stats-json", tmp_path / "stock.json")
    offl = run(*common, "--cache-mb", half_mb, "--mode", "gpu-centric", "--stats-json", tmp_path / "offload.json")
    assert len(stock.stdout.strip()) > 0
    assert offl.stdout == stock.stdout

    s = json.loads((tmp_path / "offload.json").read_text())
    for key in REQUIRED_STATS:
        assert key in s, key
    assert s["n_tokens"] == 24 and s["n_prompt_tokens"] > 0
    assert s["decode_tok_s"] > 0 and s["prefill_ms"] > 0
    assert s["expert_misses"] > 0 and s["bytes_read"] == s["expert_misses"] * info.expert_bytes
    assert 0 < s["peak_pool_bytes"] <= s["budget_bytes"] == int(float(half_mb) * MB)

    ref = json.loads((tmp_path / "stock.json").read_text())
    assert ref["offload"] is False and ref["bytes_read"] == 0


def test_budget_from_available_memory_keeps_a_small_model_resident(model_dir):
    # no --cache-mb: the budget comes from the memory available; a tiny model fits
    proc = run(tiny_model(model_dir, "llama"), "--prompt", "Hi", "-n", "2", "--temp", "0")
    assert "fit in the" in proc.stderr and "no offload" in proc.stderr


def test_available_memory_is_plausible():
    avail = hobbitpy.available_memory_bytes()
    total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < avail <= total


def test_plan_for_a_model_larger_than_memory():
    avail = hobbitpy.available_memory_bytes()
    expert = 64 * MB
    info = hobbitpy.ModelInfo(path="big.gguf", arch="llama", n_layer=32, n_layer_moe=32, n_expert=64,
                              n_expert_used=2, n_embd=4096, expert_bytes=expert,
                              expert_bytes_total=32 * 64 * expert, min_budget_bytes=2 * expert,
                              file_bytes=32 * 64 * expert + 512 * MB, uniform=True)
    plan = hobbitpy.plan_offload(info, hobbitpy.OffloadConfig(), context_bytes=64 * MB)
    assert plan.budget_bytes is not None
    assert info.min_budget_bytes <= plan.budget_bytes < avail - info.resident_bytes


def test_a_split_model_is_planned_as_one():
    # its parts' experts together (tests/runtime/test_split.py runs one): offloaded as any model
    info = hobbitpy.ModelInfo(path="big-00001-of-00003.gguf", arch="llama", n_layer=2, n_layer_moe=2, n_expert=8,
                              n_expert_used=2, n_embd=64, expert_bytes=MB, expert_bytes_total=16 * MB,
                              min_budget_bytes=2 * MB, file_bytes=20 * MB, uniform=True, n_split=3)
    plan = hobbitpy.plan_offload(info, hobbitpy.OffloadConfig(cache_mb=8), context_bytes=64 * MB)
    assert plan.budget_bytes == 8 * MB


def test_default_model_runs_without_a_model_argument():
    # the shipped mixtral-style reference model (models/README.md) is the default
    proc = run("--prompt", "And God said", "-n", "24", "--temp", "0", "--cache-mb", "8")
    words = proc.stdout.split()
    assert len(words) >= 8, proc.stdout
    assert sum(w.strip(",.;:").isalpha() for w in words) >= len(words) // 2, proc.stdout


def test_version_and_one_line_errors(model_dir):
    p = hobbitpy_cli("--version")
    assert p.returncode == 0 and p.stdout.startswith("hobbitpy ")
    path = tiny_model(model_dir, "llama")
    p = hobbitpy_cli("run", path, "--prompt", "")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--prompt is empty" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "--top-p", "1.5")
    assert p.returncode == 2 and "--top-p must be in [0, 1], got 1.5" in p.stderr
    # more threads than ggml has room for (SIGSEGV in libgomp at 100000), NaN sampling parameters
    for flags, why in ((["--threads", "100000"], "--threads: must be 1..512"), (["--threads", "0"], "must be 1..512"),
                       (["--temp", "nan"], "--temp: must be a finite number"),
                       (["--repeat-penalty", "nan"], "--repeat-penalty: must be a finite number")):
        p = hobbitpy_cli("run", path, "--prompt", "Hi", *flags)
        assert p.returncode == 2 and why in p.stderr and "Traceback" not in p.stderr, (flags, p.stderr)


def test_echo_sampling_flags_and_seeds(model_dir):
    path = tiny_model(model_dir, "llama")
    common = ["run", path, "--prompt", "The harbour at dawn", "-n", "32", "--threads", "2", "-q"]
    greedy = hobbitpy_cli(*common, "--temp", "0")
    assert greedy.returncode == 0 and greedy.stdout.startswith("The harbour at dawn") and greedy.stderr == ""
    quiet = hobbitpy_cli(*common, "--temp", "0", "--no-echo")
    assert greedy.stdout == "The harbour at dawn" + quiet.stdout
    # a seed makes sampling repeatable; without one every run draws its own
    wide = ["--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--no-echo"]
    a, b = hobbitpy_cli(*common, *wide, "--seed", "7"), hobbitpy_cli(*common, *wide, "--seed", "7")
    assert a.returncode == 0 and a.stdout == b.stdout
    draws = {hobbitpy_cli(*common, *wide).stdout for _ in range(3)}
    assert len(draws) > 1
    # --stop ends the text at the stop string (greedy text cut before its second word)
    second_word = quiet.stdout.split()[1]
    stopped = hobbitpy_cli(*common, "--temp", "0", "--no-echo", "--stop", second_word)
    assert stopped.returncode == 0 and second_word not in stopped.stdout


def test_stats_json_is_never_overwritten_nor_followed(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama")
    existing = tmp_path / "stats.json"
    existing.write_text("keep me\n")
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "2", "--stats-json", existing)
    assert p.returncode == 2 and "already exists" in p.stderr and existing.read_text() == "keep me\n"
    target = tmp_path / "elsewhere.txt"
    target.write_text("mine\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "2", "--stats-json", link)
    assert p.returncode == 2 and target.read_text() == "mine\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere" / "x.json")
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "2", "--stats-json", dangling)
    assert p.returncode == 2 and not (tmp_path / "nowhere").exists()
    fresh = tmp_path / "fresh.json"
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "2", "--temp", "0", "--stats-json", fresh)
    assert p.returncode == 0 and json.loads(fresh.read_text())["n_tokens"] == 2
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temporary left behind


def test_ctrl_c_keeps_the_text_and_exits_130(model_dir):
    import signal

    path = tiny_model(model_dir, "llama")
    proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "run", str(path), "--prompt", "Once", "-n", "100000",
                             "--ctx", "8192", "--temp", "0", "--threads", "2", "--no-echo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    first = proc.stdout.read(1)  # generation has started
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert first and proc.returncode == 130, err
    assert "Traceback" not in err


def test_chat_keeps_history_and_ends_on_eof(model_dir):
    path = tiny_model(model_dir, "llama")
    p = hobbitpy_cli("run", path, "--chat", "-n", "8", "--temp", "0", "--threads", "2", "-q", input="Hello there\nAnd again\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("> ") == 3  # two turns, then the prompt that met the end of input


def test_ctrl_c_inside_a_sampler_callback_stops_the_reply(model_dir):
    # a logits processor (llama-cpp-python's logit_bias, hence --ignore-eos, is one) runs in a
    # ctypes callback of llama.cpp's sampler: KeyboardInterrupt raised there is printed and dropped
    # by ctypes, and the reply went on. run's CtrlC keeps it and raises it after the token.
    import os
    import signal

    import llama_cpp

    from hobbitpy.cli.ctrl_c import CtrlC

    path = tiny_model(model_dir, "llama")
    calls = []

    def interrupted_on_the_third(input_ids, logits):
        calls.append(len(input_ids))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # delivered while the callback runs
        return logits

    processors = llama_cpp.LogitsProcessorList([interrupted_on_the_third])
    with hobbitpy.Llama(path, n_ctx=256, n_threads=2, verbose=False) as llm:
        chunks = llm.create_completion("Once upon a time", max_tokens=40, temperature=0.0, stream=True,
                                       logits_processor=processors)
        with pytest.raises(KeyboardInterrupt):
            with CtrlC() as ctrl_c:
                for _ in chunks:
                    ctrl_c.check()
        chunks.close()
    assert len(calls) == 3


def _read_as_it_comes(stream, into: list[str]) -> None:
    for piece in iter(lambda: stream.read(1), ""):
        into.append(piece)


def _within_two_minutes(condition) -> None:
    """Wait for what the process shows, not for a time: a guard against a hang only."""
    import time

    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, "the chat did not get there in two minutes"
        time.sleep(0.05)


def test_chat_survives_a_person(model_dir, tmp_path):
    # Ctrl-C during an answer ended the whole chat; it stops the answer and the chat goes on. Each
    # Ctrl-C is sent once the chat shows where it is (the answer begun, then the prompt again): a
    # second one sent after a fixed time could land before the first had stopped the answer
    import signal
    import threading

    path = tiny_model(model_dir, "llama")
    stats = tmp_path / "chat.json"
    # an answer of 32,768 tokens: seconds even on a machine many times faster than this one
    proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "run", str(path), "--chat", "-n", "100000", "--ctx",
                             "32768", "--temp", "0", "--threads", "2", "--ignore-eos", "--stats-json", str(stats)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    shown, said = [], []
    readers = [threading.Thread(target=_read_as_it_comes, args=pipe, daemon=True)
               for pipe in ((proc.stdout, shown), (proc.stderr, said))]
    for reader in readers:
        reader.start()
    proc.stdin.write("Hello there\n")
    proc.stdin.flush()
    _within_two_minutes(lambda: len(shown) > len("> "))  # the prompt, and the answer has begun
    proc.send_signal(signal.SIGINT)
    _within_two_minutes(lambda: "stopped" in "".join(said) and "".join(shown).endswith("\n> "))
    proc.send_signal(signal.SIGINT)  # at the prompt: the chat ends, with its line and statistics
    proc.wait(timeout=120)
    for reader in readers:
        reader.join(timeout=120)
    proc.stdin.close()
    out, err = "".join(shown), "".join(said)
    assert proc.returncode == 130 and "Traceback" not in err, err
    # the answer stopped, the prompt again, then the chat's end
    assert "stopped (Ctrl-C at the prompt, or Ctrl-D, ends the chat)" in err and out.endswith("\n> \n"), (out[-200:], err)
    assert "decode" in err.strip().splitlines()[-1] and json.loads(stats.read_text())["n_tokens"] > 1


def test_a_message_the_model_cannot_take_is_said_and_the_chat_goes_on(model_dir, tmp_path):
    from conftest import model_without_byte_tokens

    path = tiny_model(model_dir, "llama")
    # one over-long message (the chat ended, before), then a short one
    p = hobbitpy_cli("run", path, "--chat", "-c", "64", "-n", "4", "--temp", "0", "--threads", "2",
                     input="light " * 600 + "\nHello\n")
    assert p.returncode == 0 and "this message alone is longer than the context of 256 tokens" in p.stderr, p.stderr
    assert p.stdout.count("> ") == 3
    # a vocabulary without "\n" or "!": said as a character it cannot encode (as "longer than the
    # context", before), naming the template when the template's own text holds it
    letters = model_without_byte_tokens(tmp_path)
    p = hobbitpy_cli("run", letters, "--chat", "-n", "4", "--temp", "0", "--threads", "2", input="hi!\nhi\n")
    assert "your message: the model's vocabulary cannot encode '!' (U+0021, character 3); it is left out" in p.stderr
    assert p.returncode == 2 and "the chat template's text: the model's vocabulary cannot encode" in p.stderr, p.stderr
    assert "longer than the context" not in p.stderr and "gguf: the model's" not in p.stderr
    p = hobbitpy_cli("run", letters, "--chat", "-sys", "Be brief.", input="hi\n")
    assert p.returncode == 2 and "--system-prompt: the model's vocabulary cannot encode 'B'" in p.stderr, p.stderr


@pytest.mark.slow
def test_low_precision_applies_when_every_expert_fits(model_dir, tmp_path):
    # asked for, the low copies are there even when memory holds every expert at both
    # precisions, and the stats say how the selections were served
    from hobbitpy.copies.prepare import prepare_companion

    path = tiny_model(model_dir, "llama", n_embd=256)
    low = prepare_companion(path, "Q2_K", tmp_path / "low.gguf", progress=False)
    stats = tmp_path / "s.json"
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "8", "--temp", "0", "--low", low, "--stats-json", stats)
    assert p.returncode == 0, p.stderr
    s = json.loads(stats.read_text())
    assert s["offload"] and len(s["served_share"]) == 2 and abs(sum(s["served_share"]) - 1) < 1e-9
    low_pool = next(pool for pool in s["pools"] if pool["level"] == 1)
    assert low_pool["n_slot"] > 0 and s["runtime"]["warm_loads"] > 0  # filled in the background at start
    # with the default hits a selection the rule scores low is served by whichever copy is
    # there first (the high one, if a token wanted it before); served exactly, it is the low one
    exact = tmp_path / "exact.json"
    p = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "8", "--temp", "0", "--low", low, "--hits", "exact",
             "--stats-json", exact)
    assert p.returncode == 0, p.stderr
    assert json.loads(exact.read_text())["served_share"][1] > 0


def test_llama_cpps_spellings_mean_what_they_mean_there(tmp_path):
    # each misfired before: -cnv read as "-c nv", -no-cnv as "-n o-cnv", -fa as "-f a" (with -p:
    # "not allowed"), -e, -b, -ub, --ignore-eos, --jinja missing; --color and --mlock got another
    # flag suggested; a context rounded up was not said
    from serving import MODEL

    chat = subprocess.run([sys.executable, "-m", "hobbitpy", "run", MODEL, "-cnv", "-n", "4", "--temp", "0"],
                          input="Who was Noah?\n", capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and chat.stdout.startswith("> ") and chat.stdout.count("> ") == 2, chat.stdout
    flags = ["-no-cnv", "-fa", "-b", "64", "-ub", "32", "--ignore-eos", "--jinja", "--color", "--mlock"]
    escaped = run(MODEL, "-p", "In\\tthe beginning", "-n", "4", "--temp", "0", "-c", "64", *flags)
    assert escaped.stdout.startswith("In\tthe beginning"), escaped.stdout
    # \xNN is a byte, as llama.cpp reads it: two of them make one "é" (before: "Ã©")
    accented = run(MODEL, "-p", "caf\\xc3\\xa9", "-n", "2", "--temp", "0")
    assert accented.returncode == 0 and accented.stdout.startswith("café"), accented.stdout
    assert "--ctx-size 64 rounded up to 256" in escaped.stderr
    from hobbitpy.system.devices import gpu_usable

    gpu = run(MODEL, "-p", "In", "-n", "2", "-ngl", "99")
    said = "-ngl 99: no usable GPU here, every layer runs on the CPU" in gpu.stderr
    assert said != gpu_usable(), gpu.stderr  # said where there is no GPU, and only there
    written = run(MODEL, "-p", "In\\tthe beginning", "-n", "4", "--temp", "0", "--no-escape", "--no-display-prompt")
    assert not written.stdout.startswith("In")
    # --ignore-eos: 40 tokens, whatever the model would end with
    stats = tmp_path / "s.json"
    run(MODEL, "-p", "Amen.", "-n", "40", "--temp", "0", "--ignore-eos", "--stats-json", stats)
    assert json.loads(stats.read_text())["n_tokens"] == 40
    typo = subprocess.run([sys.executable, "-m", "hobbitpy", "run", MODEL, "-p", "x", "--colr"],
                          capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "did you mean --color?" in typo.stderr, typo.stderr


def test_serve_takes_llama_servers_model_and_context_flags():
    from serving import MODEL, free_port, http_get

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "serve", "-m", str(MODEL), "-c", "300", "--port",
                             str(port), "--threads", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import time

        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                status, body = http_get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert time.time() < deadline
                time.sleep(0.5)
        assert status == 200 and json.loads(body)["model"] == MODEL.stem
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "--ctx-size 300 rounded up to 512" in err, err
