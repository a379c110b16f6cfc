"""`hobbitpy serve` over real loopback HTTP, talked to with the `openai` client: completions
and streamed chat from the offloaded model, the same text as `hobbitpy run` at temperature 0,
/health, and Prometheus /metrics that move with the requests."""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import gguf
import openai
import pytest

from serving import (MODEL, PROMPT, REPO, announce_an_oversized_body, http_get, http_post, metrics_of, start_server,
                    still_answers, stop_server)


@pytest.fixture(scope="module")
def server():
    proc, base = start_server()
    yield base
    stop_server(proc)


def test_completion_matches_run_and_is_offloaded(server):
    status, body = http_get(server + "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["offloaded"] is True
    before = metrics_of(server)
    assert before["hobbitpy_expert_cache_budget_bytes"] == 8 * 1024 * 1024

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["ref-mixtral"]
    # llama-cpp-python's server defaults to repeat_penalty 1.1, llama.cpp's (and run's) is 1.0
    r = client.completions.create(model="ref-mixtral", prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"repeat_penalty": 1.0})
    text = r.choices[0].text
    assert r.usage.completion_tokens > 0 and text

    # the same words from the command line, same budget, greedy
    run = subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(MODEL), "--prompt", PROMPT, "-n", "16", "--no-echo",
                          "--temp", "0", "--cache-mb", "8", "--threads", "2", "--ctx", "256"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n") == text

    after = metrics_of(server)
    assert after["hobbitpy_expert_misses_total"] > 0 and after["hobbitpy_read_bytes_total"] > 0
    assert after["hobbitpy_generated_tokens_total"] > before.get("hobbitpy_generated_tokens_total", 0)
    assert after["hobbitpy_prompt_tokens_total"] > before.get("hobbitpy_prompt_tokens_total", 0)
    assert after["hobbitpy_served_selections_total{level=0}"] > 0
    assert after["hobbitpy_neuron_predicted_selections_total"] == 0  # no --neurons: no neuron left out


def test_prompts_of_token_ids_and_several_prompts_are_served_as_openai_serves_them(server):
    # OpenAI takes a completion's prompt as token ids (tools that tokenize themselves send them)
    # and several prompts in one request: the same continuation as the text those ids are, one
    # choice a prompt, whole or streamed
    ids = http_post(server + "/extras/tokenize", json.dumps({"input": PROMPT}).encode())[1]["tokens"]
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    greedy = {"max_tokens": 8, "temperature": 0}
    as_text = client.completions.create(model="m", prompt=PROMPT, **greedy).choices[0].text
    other = client.completions.create(model="m", prompt="In the beginning", **greedy)
    assert as_text and other.choices[0].text
    assert client.completions.create(model="m", prompt=ids, **greedy).choices[0].text == as_text
    assert client.completions.create(model="m", prompt=[ids], **greedy).choices[0].text == as_text
    streamed = client.completions.create(model="m", prompt=ids, stream=True, **greedy)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == as_text

    both = client.completions.create(model="m", prompt=[ids, "In the beginning"], **greedy)
    assert [(c.index, c.text) for c in both.choices] == [(0, as_text), (1, other.choices[0].text)]
    assert both.usage.completion_tokens == 8 + other.usage.completion_tokens
    chunks = list(client.completions.create(model="m", prompt=[PROMPT, "In the beginning"], stream=True, **greedy))
    by_index = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert by_index == {0: as_text, 1: other.choices[0].text} and len({c.id for c in chunks}) == 1
    # the next request of one text is not given the last one's prompts (they are its own)
    assert client.completions.create(model="m", prompt=PROMPT, **greedy).choices[0].text == as_text


def test_streamed_chat(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    before = metrics_of(server)
    stream = client.chat.completions.create(model="ref-mixtral", messages=[{"role": "user", "content": "Who was Noah?"}],
                                            max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces).strip()
    after = metrics_of(server)
    assert after["hobbitpy_generated_tokens_total"] > before["hobbitpy_generated_tokens_total"]
    assert after["hobbitpy_expert_hits_total"] + after["hobbitpy_expert_misses_total"] > \
        before["hobbitpy_expert_hits_total"] + before["hobbitpy_expert_misses_total"]


def test_a_bad_grammar_or_an_oversized_body_is_refused_and_the_server_stays_up(server):
    # a grammar llama.cpp cannot parse: llama-cpp-python used the sampler it did not get (SIGSEGV)
    status, body = http_post(server + "/v1/completions",
                         json.dumps({"prompt": "x", "max_tokens": 2, "grammar": "root ::= ("}).encode())
    assert status == 400 and "grammar" in body["error"]["message"], body
    # a good one still works
    status, body = http_post(server + "/v1/completions",
                         json.dumps({"prompt": "x", "max_tokens": 2, "grammar": 'root ::= "yes" | "no"'}).encode())
    assert status == 200 and body["choices"][0]["text"] in ("yes", "no", "y", "n", "ye"), body
    # 20,000 nested groups (a 40 KB body) overflowed llama.cpp's recursive parser inside the
    # check itself: the process died without a line. Chains of rules (100,000 overflowed) and
    # size are bounded too
    for grammar, said in (("root ::= " + "(" * 20000 + '"a"' + ")" * 20000, "nests groups 20000 deep"),
                          ("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(20000)) + 'r20000 ::= "a"',
                           "defines 20002 rules"),
                          ('root ::= "' + "a" * (2 << 20) + '"', "larger than 1 MB")):
        status, body = http_post(server + "/v1/completions",
                                 json.dumps({"prompt": "x", "max_tokens": 2, "grammar": grammar}).encode())
        assert status == 400 and said in body["error"]["message"], body
        still_answers(server)
    # a body over the limit (a 50 MB prompt held 3 GB): refused on its announced length, before
    # a byte of it is read (the client never sends it here)
    status, message = announce_an_oversized_body(server)
    assert status == 413 and "bytes" in message
    still_answers(server)


def test_a_client_mistake_is_a_400_naming_the_field_and_json_is_read_whatever_its_type(server):
    # each of these was a 500 ("its log says why") with a traceback in the log, or a dump of
    # pydantic's alternatives
    mistakes = [
        ("/v1/completions", {"prompt": [1, "said"]}, "prompt.0: a prompt is text or a list of token ids"),
        ("/v1/completions", {"prompt": ["x"] * 65}, "prompt: at most 64 prompts in one request (65 were sent)"),
        ("/v1/completions", {"prompt": [1, 2, 99999999]}, "prompt: 99999999 is not a token id of this model"),
        ("/v1/completions", {"prompt": [[1, -2, 3]]}, "prompt.0: -2 is not a token id of this model"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 99999999]]}, "prompt.1: 99999999 is not a token id"),
        ("/v1/completions", {"prompt": [1, 2], "echo": True}, "echo: a prompt of token ids is not echoed"),
        ("/v1/chat/completions", {"messages": []}, "messages: at least one message is needed"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias: 'abc' is not a token id"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias: '99999999' is not a token id"),
    ]
    for path, request, said in mistakes:
        status, body = http_post(server + path, json.dumps(request | {"max_tokens": 2}).encode())
        assert status == 400 and body["error"]["message"].startswith(said), (request, body)
    # a byte token that starts a character (0xc3 on this vocabulary; the fuzzer's find): the
    # route decodes strictly, a 500
    status, body = http_post(server + "/extras/detokenize", json.dumps({"tokens": [128]}).encode())
    assert status == 400 and body["error"]["message"].startswith("tokens: their bytes are not UTF-8 text"), body
    # plain `curl -d '{...}'` says application/x-www-form-urlencoded: read as JSON, as llama-server does
    status, body = http_post(server + "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode(),
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and body["choices"][0]["text"], body
    status, body = http_post(server + "/v1/completions", json.dumps({"prompt": [PROMPT], "max_tokens": 2}).encode())
    assert status == 200 and body["choices"][0]["text"], body
    still_answers(server)


def test_text_the_vocabulary_cannot_encode_is_a_400_naming_the_character(tmp_path):
    from conftest import model_without_byte_tokens

    proc, base = start_server(model=model_without_byte_tokens(tmp_path), alias="letters")
    try:
        status, body = http_post(base + "/v1/completions", json.dumps({"prompt": "ab\ncd", "max_tokens": 2}).encode())
        assert status == 400 and body["error"]["message"] == \
            "prompt: the model's vocabulary cannot encode '\\n' (U+000A, character 3)", body
        status, body = http_post(base + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}],
             "max_tokens": 2}).encode())
        assert status == 400 and body["error"]["message"] == \
            "messages.1.content: the model's vocabulary cannot encode '!' (U+0021, character 3)", body
        # the request's text is sound, the chat template's is not: said as such, without the file
        status, body = http_post(base + "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode())
        assert status == 400 and body["error"]["message"].startswith(
            "the chat template's text: the model's vocabulary cannot encode '<'"), body
        assert "gguf" not in body["error"]["message"]
        status, body = http_post(base + "/v1/completions", json.dumps({"prompt": "ab cd", "max_tokens": 2}).encode())
        assert status == 200, body
    finally:
        stop_server(proc)


def test_concurrent_streams_take_turns_and_every_one_ends_with_a_reason(server):
    # llama-cpp-python's default ends a running stream, without a finish_reason, when another
    # request comes: each of four streams got one token
    import concurrent.futures

    def stream(i: int):
        client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
        chunks = list(client.completions.create(model="ref-mixtral", prompt=PROMPT, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"repeat_penalty": 1.0}))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(stream, range(4)))
    texts = {text for text, _ in results}
    assert all(reason in ("length", "stop") for _, reason in results), results
    assert len(texts) == 1 and len(next(iter(texts))) > 0, results  # temperature 0: the same text, whole


def test_closed_to_web_pages_and_health_names_no_file(server):
    request = urllib.request.Request(server + "/v1/models", headers={"Origin": "http://evil.example"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert "access-control-allow-origin" not in {k.lower() for k in r.headers.keys()}
    preflight = urllib.request.Request(server + "/v1/completions", method="OPTIONS",
                                       headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    try:
        with urllib.request.urlopen(preflight, timeout=10) as r:
            headers = {k.lower() for k in r.headers.keys()}
    except urllib.error.HTTPError as e:
        headers = {k.lower() for k in e.headers.keys()}
    assert "access-control-allow-origin" not in headers
    _, body = http_get(server + "/health")
    assert str(MODEL.parent) not in body and json.loads(body)["model"] == "ref-mixtral"


def test_with_a_key_every_route_but_a_bare_health_needs_it(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    proc, base = start_server("--api-key-file", str(key))
    try:
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                http_get(base + path)
            assert refused.value.code == 401, path
        assert json.loads(http_get(base + "/health")[1]) == {"status": "ok"}  # up or not, nothing more
        # the scheme's case is free (RFC 7235; a 401 for "bearer" before), and /metrics answers
        # itself (a 307 to /metrics/ before, which scrapers configured without redirects miss)
        host, port = base.removeprefix("http://").split(":")
        for scheme in ("Bearer", "bearer", "BEARER"):
            connection = http.client.HTTPConnection(host, int(port), timeout=10)
            connection.request("GET", "/metrics", headers={"Authorization": f"{scheme} s3cret-key"})
            response = connection.getresponse()
            assert response.status == 200 and b"hobbitpy_expert_cache_budget_bytes" in response.read(), scheme
            connection.close()
        client = openai.OpenAI(base_url=base + "/v1", api_key="s3cret-key")
        assert [m.id for m in client.models.list().data] == ["ref-mixtral"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
    finally:
        stop_server(proc)


BAD_REQUESTS = [  # path, body, what the 400's message says (llama-cpp-python: a 500 with the server's paths, or silence)
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2', "not JSON"),
    ("/v1/completions", b'[1, 2]', "not a JSON object"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -2}', "max_tokens must be at least 1, or -1"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens must be at least 1, or -1"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', "temperature must be a finite number"),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    ("/v1/completions", b'{"prompt": 7}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "NaN is not a number"),
    ("/v1/completions", b'{"prompt": "\\ud800 x", "max_tokens": 2}', "lone surrogate"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "n": 3}', "one choice per request"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "logprobs": 2}', "logprobs are not served"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}', "logprobs"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/embeddings", b'{"input": "hi"}', "embeddings are not served"),
    ("/extras/tokenize", b'{"input": 5}', "input"),
    ("/v1/completions", b'{"prompt": ' + b'[' * 100000 + b']' * 100000 + b'}', "nests too deep"),
]


@pytest.mark.parametrize("path, body, why", BAD_REQUESTS)
def test_a_bad_request_is_a_400_that_says_what_is_wrong_and_names_no_file(server, path, body, why):
    status, answer = http_post(server + path, body)
    assert status == 400, answer
    message = answer["error"]["message"]
    assert why in message, message
    assert str(REPO) not in json.dumps(answer) and "site-packages" not in json.dumps(answer)


def test_bad_requests_leave_the_server_answering(server):
    for path, body, _ in BAD_REQUESTS:
        http_post(server + path, body)
    still_answers(server)


def test_a_failed_expert_read_is_a_503_and_the_server_recovers_with_its_file(tmp_path):
    """The model's experts cut off under a running server: the request that needs them is a 503
    naming no file, /health says 503 too; each next request loads the file again (the runtime
    serves only the model it loaded): still cut, a 503; whole again, it is served (the same text
    as before) and /health is 200."""
    model = tmp_path / "model.gguf"
    model.write_bytes(MODEL.read_bytes())
    reader = gguf.GGUFReader(model)
    expert_start = min(int(t.data_offset) for t in reader.tensors if "_exps." in t.name)
    del reader
    proc, base = start_server(model=model)
    try:
        before = still_answers(base)
        whole = model.read_bytes()
        os.truncate(model, expert_start)  # the same file, cut: what a running process reads from
        status, answer = http_post(base + "/v1/completions", json.dumps(
            {"prompt": "And the earth was without form", "max_tokens": 24, "temperature": 0}).encode())
        assert status == 503, answer
        assert "could not be read" in answer["error"]["message"] and str(tmp_path) not in json.dumps(answer)
        with pytest.raises(urllib.error.HTTPError) as unhealthy:
            http_get(base + "/health")
        assert unhealthy.value.code == 503 and json.loads(unhealthy.value.read())["status"] == "error"
        # the next request loads the file again, still cut: a 503 too, and /health still says so
        status, answer = http_post(base + "/v1/completions", json.dumps({"prompt": "And", "max_tokens": 2}).encode())
        assert status == 503 and str(tmp_path) not in json.dumps(answer), answer
        with pytest.raises(urllib.error.HTTPError) as unhealthy:
            http_get(base + "/health")
        assert unhealthy.value.code == 503
        with open(model, "r+b") as f:  # whole again, in place
            f.write(whole)
        assert still_answers(base) == before
        assert json.loads(http_get(base + "/health")[1])["status"] == "ok"
    finally:
        stop_server(proc)


def _rss_and_fds(pid: int) -> tuple[int, int]:
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    return rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _abandon_a_stream(base: str) -> None:
    """A streamed completion whose client goes away after its first chunk."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    response.fp.readline()
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


def test_rounds_of_abuse_leave_the_server_answering_alike_in_bounded_memory_and_fds():
    """Three rounds of every hostile request above (bad bodies and fields, a bad grammar, a body
    over the limit, a client gone mid-stream, four concurrent streams): the server answers a
    temperature-0 request as it did first, and after the first round (allocators and caches warm)
    neither its memory nor its open files grow."""
    import concurrent.futures

    proc, base = start_server()
    try:
        first = still_answers(base)

        def one_round():
            for path, body, _ in BAD_REQUESTS:
                status, _ = http_post(base + path, body)
                assert status == 400
            status, _ = http_post(base + "/v1/completions",
                              json.dumps({"prompt": "x", "max_tokens": 2, "grammar": "root ::= ("}).encode())
            assert status == 400
            assert announce_an_oversized_body(base)[0] == 413
            _abandon_a_stream(base)
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                reasons = list(pool.map(lambda _: list(client.completions.create(
                    model="ref-mixtral", prompt=PROMPT, max_tokens=6, temperature=0, stream=True))[-1].choices[0].finish_reason,
                    range(4)))
            assert all(reason in ("length", "stop") for reason in reasons), reasons
            assert still_answers(base) == first

        one_round()
        rss, fds = _rss_and_fds(proc.pid)
        for _ in range(2):
            one_round()
        rss_after, fds_after = _rss_and_fds(proc.pid)
        assert rss_after - rss < 48 * 2**20, (rss, rss_after)
        assert fds_after <= fds + 1, (fds, fds_after)  # (a keep-alive connection may still be open)
        assert proc.poll() is None
    finally:
        stop_server(proc)


def test_sigterm_lets_an_open_stream_finish_with_its_reason(tmp_path):
    # sse-starlette cut every open stream at SIGTERM: the client got no finish_reason
    import signal
    import time

    proc, base = start_server("--ctx", "2048", log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        stream = client.completions.create(model="any", prompt=PROMPT, max_tokens=300, temperature=0, stream=True,
                                           extra_body={"logit_bias": {str(t): -100 for t in range(3)}})
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop"), chunks[-1]
        assert len(chunks) > 2
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn ends by the signal it was sent
    finally:
        if proc.poll() is None:
            proc.kill()
