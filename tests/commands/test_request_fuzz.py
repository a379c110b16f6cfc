"""A request fuzzer against the real server over loopback HTTP: bodies generated from the
server's own OpenAPI schema by schemathesis (valid by it, and invalid by it), valid ones with
a field replaced by any JSON value, and every recursive field nested deep. Never a 5xx, never
a dead server, memory bounded. A bounded number of examples in the fast run, more in the slow
one."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from serving import http_get, start_server, still_answers, stop_server

ROUTES = ("/v1/completions", "/v1/chat/completions", "/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize")
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "stop", "logit_bias", "grammar", "tools", "response_format",
          "seed", "n", "input", "tokens", "top_k", "max_completion_tokens", "functions", "tool_choice"]
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    proc, base = start_server("--ctx", "256", log=log)
    schema = schemathesis.openapi.from_dict(json.loads(http_get(base + "/openapi.json")[1]))
    yield proc, base, schema, log
    stop_server(proc)


def post(base: str, path: str, body: bytes) -> int:
    request = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def as_bytes(body) -> bytes:
    """A generated body as sent: JSON, or as it is (schemathesis' invalid bodies include bytes
    that are no JSON, and an absent body)."""
    if isinstance(body, bytes):
        return body
    try:
        return json.dumps(body).encode()
    except TypeError:
        return b""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def bodies(schema):
    """(route, body) of every route: valid by the server's schema, invalid by it, or valid with
    one field replaced by any JSON value."""
    def of(path: str):
        operation = schema[path]["POST"]
        valid = operation.as_strategy(generation_mode=GenerationMode.POSITIVE).map(lambda case: case.body)
        invalid = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE).map(lambda case: case.body)
        mutated = st.tuples(valid, st.sampled_from(FIELDS) | st.text(max_size=12), JSON).map(
            lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0])
        return st.tuples(st.just(path), valid | invalid | mutated)
    return st.one_of(*[of(path) for path in ROUTES])


def fuzz(served, n_examples: int) -> None:
    proc, base, schema, log = served
    before = rss_mb(proc.pid)
    failures = []

    @settings(max_examples=n_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies(schema))
    def one(case):
        path, body = case
        status = post(base, path, as_bytes(body))
        if status >= 500:
            failures.append((status, path, json.dumps(body)[:300]))
        assert proc.poll() is None, f"the server died on {path} {json.dumps(body)[:300]}"

    one()
    assert not failures, (failures[:5], log.read_text()[-3000:])
    still_answers(base)
    assert rss_mb(proc.pid) - before < 256, (before, rss_mb(proc.pid))


def test_generated_and_mutated_requests_never_get_a_5xx(served):
    fuzz(served, 100)


@pytest.mark.slow
def test_many_generated_and_mutated_requests_never_get_a_5xx(served):
    fuzz(served, 2000)


NESTED = [  # every field that holds JSON of any depth, nested past what any parser should follow
    ("/v1/completions", lambda deep: {"prompt": "x", "max_tokens": 2, "stop": deep}),
    ("/v1/completions", lambda deep: {"prompt": "x", "max_tokens": 2, "logit_bias": {"1": deep}}),
    ("/v1/chat/completions", lambda deep: {"messages": [{"role": "user", "content": deep}], "max_tokens": 2}),
    ("/v1/chat/completions", lambda deep: {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                           "response_format": {"type": "json_object", "schema": deep}}),
    ("/v1/chat/completions", lambda deep: {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                           "tools": [{"type": "function", "function": {"name": "f",
                                                                                      "parameters": deep}}]}),
    ("/extras/detokenize", lambda deep: {"tokens": deep}),
]


@pytest.mark.parametrize("depth", [900, 100_000])
@pytest.mark.parametrize("path, body", NESTED)
def test_deep_nesting_in_every_recursive_field_is_refused(served, path, body, depth):
    proc, base, _, log = served
    deep_list = "[" * depth + "]" * depth
    deep_schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    for deep in (deep_list, deep_schema):
        text = json.dumps(body("@@DEEP@@")).replace('"@@DEEP@@"', deep)
        status = post(base, path, text.encode())
        assert status < 500 and proc.poll() is None, (path, depth, status, log.read_text()[-3000:])
    still_answers(base)
