"""One set of generation defaults (generation.py) on every surface: `run`, `hobbitpy.Llama`
and the server give the same text for the same request that leaves every setting out but the
seed. Before, a completion was 64 tokens from `run`, 16 from the API and the server; a chat ran
to the end of the context; a chat's temperature was 0.2 in the API, 0.8 elsewhere; the
server's repeat penalty 1.1."""

from __future__ import annotations

import json
import pathlib

import openai

import hobbitpy
from conftest import hobbitpy_cli
from hobbitpy.settings.generation import defaults_table
from serving import MODEL, PROMPT, http_post, start_server, stop_server

REPO = pathlib.Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def test_the_guides_table_is_the_one_place_the_defaults_are_written():
    assert defaults_table() in (REPO / "docs" / "GUIDE.md").read_text()


def test_a_request_leaving_every_setting_out_generates_the_same_text_everywhere():
    with hobbitpy.Llama(MODEL, n_ctx=256, n_threads=2, verbose=False) as llm:
        api = llm.create_completion(PROMPT, seed=7)
        api_chat = llm.create_chat_completion(MESSAGES, seed=7)
    run = hobbitpy_cli("run", MODEL, "-p", PROMPT, "--seed", "7", "-c", "256", "--no-echo", "--threads", "2")
    run_chat = hobbitpy_cli("run", MODEL, "-sys", MESSAGES[0]["content"], "-p", PROMPT, "--seed", "7", "-c", "256",
                            "--threads", "2")
    assert run.returncode == 0 and run_chat.returncode == 0, run.stderr + run_chat.stderr
    proc, base = start_server("--ctx", "256")
    try:
        status, served = http_post(base + "/v1/completions", json.dumps({"prompt": PROMPT, "seed": 7}).encode())
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        served_chat = client.chat.completions.create(model="any", messages=MESSAGES, seed=7)
    finally:
        stop_server(proc)
    text = api["choices"][0]["text"]
    # to the end of the context (or of the text), not 16 or 64 tokens
    assert api["usage"]["completion_tokens"] > 64 or api["choices"][0]["finish_reason"] == "stop", api["usage"]
    assert status == 200 and served["choices"][0]["text"] == text
    assert run.stdout.rstrip("\n") == text
    chat = api_chat["choices"][0]["message"]["content"]
    assert chat and served_chat.choices[0].message.content == chat
    assert run_chat.stdout.rstrip("\n").endswith(chat)


def test_the_same_values_are_refused_everywhere(tmp_path):
    cases = [({"max_tokens": 0}, ["-n", "0"], "at least 1, or -1"),
             ({"top_p": 2}, ["--top-p", "2"], "must be in [0, 1]"),
             ({"temperature": float("inf")}, ["--temp", "inf"], "finite"),
             ({"presence_penalty": 3}, ["--presence-penalty", "3"], "must be in [-2, 2], got 3"),
             ({"frequency_penalty": -3}, ["--frequency-penalty", "-3"], "must be in [-2, 2], got -3"),
             # an empty stop string ends the text before it starts: refused by run, taken by the others
             ({"stop": [""]}, ["--stop", ""], "needs some text")]
    proc, base = start_server()
    try:
        with hobbitpy.Llama(MODEL, n_ctx=256, n_threads=2, verbose=False) as llm:
            for settings, flags, said in cases:
                try:
                    llm.create_completion(PROMPT, **settings)
                    raise AssertionError(f"{settings} was taken")
                except hobbitpy.HobbitError as e:
                    assert said in str(e), e
                body = json.dumps({"prompt": PROMPT} | settings).replace("Infinity", "1e999")
                status, answer = http_post(base + "/v1/completions", body.encode())
                assert status == 400 and said in answer["error"]["message"], answer
                cli = hobbitpy_cli("run", MODEL, "-p", PROMPT, *flags)
                assert cli.returncode == 2 and said in cli.stderr, cli.stderr
        # a temperature at or below 0 is greedy on every surface, as in llama.cpp (llama-cpp-python
        # sampled without a temperature below 0), and max_completion_tokens is max_tokens
        greedy = hobbitpy_cli("run", MODEL, "-p", PROMPT, "--temp", "0", "-n", "8", "--no-echo").stdout.rstrip("\n")
        below = hobbitpy_cli("run", MODEL, "-p", PROMPT, "--temp", "-1", "-n", "8", "--no-echo").stdout.rstrip("\n")
        status, answer = http_post(base + "/v1/completions", json.dumps(
            {"prompt": PROMPT, "temperature": -1, "max_completion_tokens": 8}).encode())
        assert greedy == below == answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8
    finally:
        stop_server(proc)
