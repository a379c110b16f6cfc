"""`hobbitpy serve` over real loopback HTTP, talked to with the `openai` client: completions
and streamed chat from the offloaded model, the same text as `hobbitpy run` at temperature 0,
/health, and Prometheus /metrics that move with the requests."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "ref-mixtral-Q8_0.gguf"
PROMPT = "In the beginning God created"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def _metrics(base: str) -> dict[str, float]:
    _, text = _get(base + "/metrics")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            out[key] = sample.value
    return out


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "serve", str(MODEL), "--cache-mb", "8", "--port", str(port),
                             "--threads", "2", "--alias", "ref-mixtral"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if _get(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not answer /health within 120 s")
        time.sleep(0.3)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_completion_matches_run_and_is_offloaded(server):
    status, body = _get(server + "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["offloaded"] is True
    before = _metrics(server)
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

    after = _metrics(server)
    assert after["hobbitpy_expert_misses_total"] > 0 and after["hobbitpy_read_bytes_total"] > 0
    assert after["hobbitpy_generated_tokens_total"] > before.get("hobbitpy_generated_tokens_total", 0)
    assert after["hobbitpy_prompt_tokens_total"] > before.get("hobbitpy_prompt_tokens_total", 0)
    assert after["hobbitpy_served_selections_total{level=0}"] > 0
    assert after["hobbitpy_neuron_predicted_selections_total"] == 0  # no --neurons: no neuron left out


def test_streamed_chat(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    before = _metrics(server)
    stream = client.chat.completions.create(model="ref-mixtral", messages=[{"role": "user", "content": "Who was Noah?"}],
                                            max_tokens=12, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces).strip()
    after = _metrics(server)
    assert after["hobbitpy_generated_tokens_total"] > before["hobbitpy_generated_tokens_total"]
    assert after["hobbitpy_expert_hits_total"] + after["hobbitpy_expert_misses_total"] > \
        before["hobbitpy_expert_hits_total"] + before["hobbitpy_expert_misses_total"]
