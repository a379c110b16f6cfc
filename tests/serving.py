"""A `hobbitpy serve` of the shipped model for the tests that talk to it over loopback HTTP:
start and stop one, and the requests they make."""

from __future__ import annotations

import http.client
import json
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "ref-mixtral-Q8_0.gguf"
PROMPT = "In the beginning God created"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def metrics_of(base: str) -> dict[str, float]:
    _, text = http_get(base + "/metrics")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            out[key] = sample.value
    return out


def start_server(*flags: str, model: pathlib.Path = MODEL, alias: str | None = "ref-mixtral",
                 log: pathlib.Path | None = None):
    """A server of the shipped model (or `model`) on a free port, named `alias` in the API
    (None: its default name): its process and base URL, once /health answers. Its output goes
    to pipes, or to the file `log` (a server logging much, as under a fuzzer, would fill a
    pipe nobody reads and block on its next line)."""
    port = free_port()
    named = ["--alias", alias] if alias is not None else []
    out = subprocess.PIPE if log is None else open(log, "w")
    # -t: llama-server's spelling of --threads, as run's
    proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "serve", str(model), "--cache-mb", "8", "--port", str(port),
                             "-t", "2", *named, *flags], stdout=out, stderr=subprocess.STDOUT if log else out,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            said = proc.stderr.read() if log is None else log.read_text()
            pytest.fail(f"the server exited ({proc.returncode}): {said[-2000:]}")
        try:
            if http_get(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not answer /health within 120 s")
        time.sleep(0.3)
    return proc, base


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def http_post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def still_answers(server: str) -> str:
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    r = client.completions.create(model="ref-mixtral", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text
    return r.choices[0].text


def announce_an_oversized_body(base: str) -> tuple[int, str]:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(5 * 1024 * 1024))
    connection.endheaders()
    response = connection.getresponse()
    try:
        return response.status, json.loads(response.read())["error"]["message"]
    finally:
        connection.close()
