"""What a newcomer meets first, as a newcomer meets it (the CLI in a child process, the
server over loopback HTTP with the `openai` client): llama.cpp's spellings, a closest-flag
hint, constrained output, a summary of every run, no traceback in ordinary use, and the
server sampling as `run` does."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import openai
import pytest

import hobbitpy
from conftest import MB, hand_trace, hobbitpy_cli, tiny_model
from serving import MODEL, http_post, start_server, stop_server

PROMPT = "And God said"
README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_llama_cpp_spellings_give_the_same_run(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    ours = hobbitpy_cli("run", MODEL, "--prompt", PROMPT, "--ctx", "128", "-n", "6", "--temp", "0", "--no-echo")
    theirs = hobbitpy_cli("run", "-m", MODEL, "-f", prompt, "--ctx-size", "128", "-n", "6", "--temp", "0", "--no-echo",
                          "--presence-penalty", "0", "--frequency-penalty", "0", "-r", "never appears")
    assert ours.returncode == 0 and theirs.returncode == 0, theirs.stderr
    assert ours.stdout == theirs.stdout and ours.stdout.strip()
    # -n -1: until the end of the text or of the context, which it says
    to_end = hobbitpy_cli("run", MODEL, "-p", PROMPT, "-c", "32", "-n", "-1", "--temp", "0")
    assert to_end.returncode == 0, to_end.stderr
    assert "stopped at the end of the context (" in to_end.stderr  # (llama.cpp pads a context to 256)
    # a system prompt: the prompt goes as a conversation through the model's template
    chat = hobbitpy_cli("run", MODEL, "-sys", "You answer briefly.", "-p", "Who made the light?", "-n", "4", "--temp", "0")
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr


def test_an_unknown_flag_gets_the_commands_usage_and_the_closest_flag():
    proc = hobbitpy_cli("run", MODEL, "-p", "x", "--ctx-sise", "64")
    assert proc.returncode == 2
    assert "usage: hobbitpy run" in proc.stderr and "did you mean --ctx-size?" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_grammar_and_json_schema_constrain_the_output_and_a_bad_one_is_one_line(tmp_path):
    yes_no = hobbitpy_cli("run", MODEL, "-p", "Is the light good?", "-n", "4", "--temp", "0", "--no-echo",
                          "--grammar", 'root ::= "yes" | "no"')
    assert yes_no.returncode == 0 and yes_no.stdout.strip() in ("yes", "no"), yes_no.stdout + yes_no.stderr
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    as_json = hobbitpy_cli("run", MODEL, "-p", "A number:", "-n", "24", "--temp", "0", "--no-echo", "-j", schema)
    assert as_json.returncode == 0, as_json.stderr
    assert isinstance(json.loads(as_json.stdout)["n"], int)
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text("root ::= (")
    bad = hobbitpy_cli("run", MODEL, "-p", "x", "-n", "2", "--grammar-file", grammar)
    assert bad.returncode == 2 and "the grammar does not parse" in bad.stderr and "Traceback" not in bad.stderr
    # 20,000 nested groups overflowed llama.cpp's parser's stack (exit 139)
    grammar.write_text("root ::= " + "(" * 20000 + '"a"' + ")" * 20000)
    deep = hobbitpy_cli("run", MODEL, "-p", "x", "-n", "2", "--grammar-file", grammar)
    assert deep.returncode == 2 and "nests groups 20000 deep" in deep.stderr and "Traceback" not in deep.stderr
    # a schema llama-cpp-python's converter refuses by an assert: was a traceback, exit 1
    odd = hobbitpy_cli("run", MODEL, "-p", "x", "-n", "2", "-j", '{"type": "foo"}')
    assert odd.returncode == 2 and "Traceback" not in odd.stderr, odd.stderr
    assert "the JSON schema cannot be turned into a grammar" in odd.stderr.strip().splitlines()[-1], odd.stderr
    # the server refuses it in a chat's response_format in the same words (it answered 200, any JSON)
    proc, base = start_server()
    try:
        status, answer = http_post(base + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
             "response_format": {"type": "json_object", "schema": {"type": "foo"}}}).encode())
    finally:
        stop_server(proc)
    said = answer["error"]["message"]
    assert status == 400 and "response_format.schema: the JSON schema cannot be turned into a grammar" in said, answer


def test_every_run_ends_with_a_summary_and_the_first_says_how_to_see_offloading(model_dir):
    whole = hobbitpy_cli("run", MODEL, "-p", PROMPT, "-n", "4", "--temp", "0")
    assert whole.returncode == 0, whole.stderr
    assert "--cache-mb N runs the experts through a cache of N MB instead" in whole.stderr
    assert "decode" in whole.stderr.splitlines()[-1] and "tok/s, prompt" in whole.stderr.splitlines()[-1]
    cached = hobbitpy_cli("run", MODEL, "-p", PROMPT, "-n", "4", "--temp", "0", "--cache-mb", "8")
    last = cached.stderr.splitlines()[-1]
    assert cached.returncode == 0 and "experts:" in last and "hits" in last and "MB read, cache 8.0 MB" in last, last
    # a cache smaller than one token's experts: said, with the size that holds them (0 % hits and
    # nothing said, before)
    tiny = hobbitpy_cli("run", MODEL, "-p", PROMPT, "-n", "4", "--temp", "0", "--cache-mb", "4")
    assert "the cache holds 10 experts and one token selects 12 (2 in each of 6 layers)" in tiny.stderr, tiny.stderr
    assert "--cache-mb 5 or more holds one token's" in tiny.stderr
    assert "one token selects" not in cached.stderr
    quiet = hobbitpy_cli("run", MODEL, "-p", PROMPT, "-n", "4", "--temp", "0", "--cache-mb", "8", "-q")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_no_traceback_in_ordinary_use(tmp_path):
    # the reader of the output goes away
    reader = subprocess.Popen(f"{sys.executable} -m hobbitpy run {MODEL} -p '{PROMPT}' -n 200 | head -c 5",
                              shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = reader.communicate(timeout=300)
    assert len(out) == 5 and "Traceback" not in err and "BrokenPipe" not in err, err
    # a missing file: one line, no seed line before it
    missing = hobbitpy_cli("run", tmp_path / "nothing.gguf", "-p", "x")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    # a prompt longer than the context: said without printing it first
    long = hobbitpy_cli("run", MODEL, "-p", "light " * 400, "-c", "32")
    assert long.returncode == 2 and "--ctx-size" in long.stderr and long.stdout == "", long.stdout[:80]
    # a chat longer than its context loses its oldest turns, and says so
    lines = "\n".join(f"Tell me about the {w} of the earth and the waters under it, and what was made on that day."
                      for w in ("light", "darkness", "firmament", "seas", "grass", "stars", "whales", "cattle",
                                "fowl", "trees", "rivers", "garden")) + "\n"
    chat = hobbitpy_cli("run", MODEL, "--chat", "-c", "256", "-n", "8", "--temp", "0", input=lines)
    assert chat.returncode == 0, chat.stderr
    assert "its oldest turn is dropped" in chat.stderr and "Traceback" not in chat.stderr
    # plot without the [bench] extra
    trace = hand_trace([[[0, 1]], [[1, 2]]], n_expert=4).save(tmp_path / "t.npz")
    script = ("import sys; sys.modules['matplotlib'] = None; from hobbitpy.cli import main; "
              f"sys.exit(main(['plot', {str(trace)!r}]))")
    plot = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert plot.returncode == 2 and "pip install 'hobbitpy[bench]'" in plot.stderr and "Traceback" not in plot.stderr


def test_a_closed_llama_says_it_is_closed(model_dir):
    llm = hobbitpy.Llama(tiny_model(model_dir, "llama"), n_ctx=64, verbose=False)
    llm.close()
    for call in (lambda: llm.tokenize(b"hi"), lambda: llm.create_completion("hi", max_tokens=1),
                 lambda: llm.eval([1]), lambda: llm.detokenize([1])):
        with pytest.raises(hobbitpy.HobbitError, match="this Llama is closed"):
            call()


def test_serve_on_a_busy_port_says_so_before_loading():
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        proc = hobbitpy_cli("serve", MODEL, "--port", port)
        assert proc.returncode == 2 and f"127.0.0.1:{port}: cannot listen there" in proc.stderr, proc.stderr
        # one line, before the model loads: nothing said it was serving (it did, before listening)
        assert proc.stderr.count("\n") == 1 and "serving" not in proc.stderr, proc.stderr
    finally:
        busy.close()


def test_serve_refuses_a_chat_format_at_its_start_not_at_each_conversation():
    # before: it served, and every chat answered 500 with a traceback in the log
    proc = hobbitpy_cli("serve", MODEL, "--port", "8", "--chat-format", "bogus")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--chat-format: Invalid chat handler: bogus (valid formats: [" in proc.stderr, proc.stderr


def test_the_server_samples_as_run_does_and_names_its_model_by_its_file():
    proc, base = start_server(alias=None)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [MODEL.stem]
        # no extra field: llama.cpp's repeat_penalty (1.0), as `run`
        r = client.completions.create(model=MODEL.stem, prompt=PROMPT, max_tokens=12, temperature=0)
        run = hobbitpy_cli("run", MODEL, "-p", PROMPT, "-n", "12", "--temp", "0", "--no-echo", "--cache-mb", "8",
                           "--threads", "2")
        assert run.returncode == 0 and r.choices[0].text == run.stdout.rstrip("\n")
        # one model is served: whatever name a client was configured with is it (a 404 before),
        # and every response names it by its id, not by its file (the path before)
        other = client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=12, temperature=0)
        chat = client.chat.completions.create(model="model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert other.choices[0].text == r.choices[0].text
        assert r.model == other.model == chat.model == MODEL.stem
    finally:
        stop_server(proc)


def test_the_readmes_client_example_runs_as_written():
    # it names its model "model": a 404 before
    example = README.split("```python\nfrom openai import OpenAI\n")[1].split("```")[0]
    proc, base = start_server(alias=None)
    try:
        code = "from openai import OpenAI\n" + example.replace("http://127.0.0.1:8080", base)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    finally:
        stop_server(proc)


def test_simulate_says_why_a_policy_hit_nothing(tmp_path, capsys):
    from hobbitpy.cli import main

    # 4 layers x top-2 = 8 selections a token, the same each token; 3 slots: LRU cycles through them
    experts = [[[0, 1], [2, 3], [0, 1], [2, 3]]] * 3
    trace = hand_trace(experts, n_expert=4, expert_bytes=MB).save(tmp_path / "t.npz")
    assert main(["simulate", str(trace), "--budget-mb", "3", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "lru hit nothing: the cache's 3 slots are fewer than the 8 experts one token selects" in out, out


def test_tune_says_nothing_fits_before_it_makes_a_file(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(MODEL.read_bytes())
    text = tmp_path / "t.txt"
    text.write_text((PROMPT + " let there be light.\n") * 40)
    proc = hobbitpy_cli("tune", model, "--text", text, "--memory", "20", "--threads", "2")
    assert proc.returncode == 2 and "nothing can fit" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "t.txt"]


def test_run_help_shows_what_a_person_needs_first():
    """Model, prompt, generation, sampling, memory and output flags in the first 60 lines of
    `run --help`; the papers' techniques after them."""
    proc = hobbitpy_cli("run", "--help")
    assert proc.returncode == 0
    first = "\n".join(proc.stdout.splitlines()[:60])
    for flag in ("--model", "--prompt", "--file", "--chat", "--system-prompt", "--n-predict", "--ctx-size", "--threads",
                 "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--reverse-prompt", "--seed",
                 "--grammar", "--cache-mb", "--no-offload", "--exact", "--preset", "--no-echo", "--stats-json", "--quiet"):
        assert flag in first, flag
    assert "--prefetch-layers" not in first and "--prefetch-layers" in proc.stdout



def test_force_replaces_an_output_whole_and_never_through_a_symlink(tmp_path):
    """Without --force an output that exists is refused; with it the file is replaced by a
    rename (a reader holding the old file still reads the old one, whole); a symlink is
    refused either way and its target kept."""
    stats = tmp_path / "stats.json"
    stats.write_text("old\n")
    run = ("run", MODEL, "-p", PROMPT, "-n", "2", "--temp", "0", "--stats-json", stats)
    refused = hobbitpy_cli(*run)
    assert refused.returncode == 2 and "--force" in refused.stderr and stats.read_text() == "old\n"
    with open(stats) as reader:
        replaced = hobbitpy_cli(*run, "--force")
        assert replaced.returncode == 0, replaced.stderr
        assert reader.read() == "old\n"  # the old file, untouched: the new one was renamed over its name
    assert json.loads(stats.read_text())["n_tokens"] == 2
    target = tmp_path / "mine.png"
    target.write_bytes(b"mine")
    link = tmp_path / "t.png"
    link.symlink_to(target)
    trace = hand_trace([[[0, 1], [2, 3]]] * 4, n_expert=4).save(tmp_path / "t.npz")
    through = hobbitpy_cli("plot", trace, "--out", link, "--force")
    assert through.returncode == 2 and "symlink" in through.stderr and target.read_bytes() == b"mine"
    link.unlink()
    link.write_bytes(b"an older picture")
    again = hobbitpy_cli("plot", trace, "--out", link, "--force")
    assert again.returncode == 0 and link.read_bytes().startswith(b"\x89PNG"), again.stderr
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []  # no temporary left behind


def test_one_context_default_for_run_and_the_api(model_dir, tmp_path):
    """The model's training context, as far as an eighth of the memory holds it, and not below
    4096 tokens (memory.default_context, which serve and trace ask too): the same for run and
    the Python API."""
    from hobbitpy.plan.memory import CONTEXT_SHARE, MIN_DEFAULT_CTX, ContextShape, context_sizes, default_context

    model = tiny_model(model_dir, "llama", n_ctx_train=8192)
    info = hobbitpy.inspect_model(model)
    assert default_context(info, 1 << 40) == 8192  # memory enough: the training context
    # little memory: the largest multiple of 256 whose buffers take at most the share, and the floor below that
    small = int(context_sizes(info, ContextShape(n_ctx=6144)).total / CONTEXT_SHARE)
    assert default_context(info, small) == 6144
    assert default_context(info, small // 100) == MIN_DEFAULT_CTX
    api = hobbitpy.Llama(model, verbose=False)
    try:
        assert api.n_ctx() == 8192
    finally:
        api.close()
    stats = tmp_path / "stats.json"
    run = hobbitpy_cli("run", model, "-p", PROMPT, "-n", "2", "--stats-json", stats)
    assert run.returncode == 0 and json.loads(stats.read_text())["n_ctx"] == 8192, run.stderr[-2000:]
