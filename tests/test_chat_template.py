"""A model's chat template that loops without end, raises or does not parse: a ChatTemplateError
within seconds (one line from `run --chat`, a 400 from the server, which goes on serving), never
a core pinned for good or a traceback."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

import hobbitpy
from hobbitpy.chat_template import RENDER_SECONDS

from test_serve import MODEL, _get, _post, _start, _still_answers, _stop

TEMPLATES = {
    "loops": "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "raises": "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
    "does not parse": "{% for %}",
}
SAYS = {"loops": "did not render within", "raises": "roles must alternate", "does not parse": "does not parse"}
MESSAGES = [{"role": "user", "content": "hi"}]


def with_template(folder: pathlib.Path, name: str) -> pathlib.Path:
    out = folder / f"{name.replace(' ', '-')}.gguf"
    if not out.exists():
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--chat-template",
                        TEMPLATES[name], str(MODEL), str(out)], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("templates")


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_bad_template_is_a_chat_template_error_in_seconds(folder, name):
    llm = hobbitpy.Llama(str(with_template(folder, name)), n_ctx=256, verbose=False)  # loads: only chats need it
    try:
        start = time.monotonic()
        with pytest.raises(hobbitpy.ChatTemplateError, match=SAYS[name]):
            llm.create_chat_completion(MESSAGES, max_tokens=2)
        assert time.monotonic() - start < RENDER_SECONDS + 3
        # the model still completes plain text
        assert llm.create_completion("In the beginning", max_tokens=2, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_run_chat_says_it_in_one_line(folder, name):
    proc = subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(with_template(folder, name)), "--chat",
                           "-n", "4", "--seed", "1"], input="hi\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and SAYS[name] in proc.stderr.splitlines()[-1], proc.stderr


def test_the_server_answers_a_400_and_goes_on_serving(folder):
    proc, base = _start(model=with_template(folder, "loops"))
    try:
        start = time.monotonic()
        status, answer = _post(base + "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode())
        assert status == 400 and SAYS["loops"] in answer["error"]["message"], answer
        assert time.monotonic() - start < RENDER_SECONDS + 10
        assert json.loads(_get(base + "/health")[1])["status"] == "ok"
        _still_answers(base)
    finally:
        _stop(proc)


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**11 }}",  # 100 GB at once
    "{{ (['x'] * 1000) * 10**9 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 7 ** (10**12) }}",  # (Jinja's ** groups from the left)
])
def test_a_template_that_would_take_memory_without_end_is_refused_before_it_does(template):
    from hobbitpy.chat_template import BoundedChatFormatter

    formatter = BoundedChatFormatter(template=template, eos_token="</s>", bos_token="<s>")
    started = time.monotonic()
    with pytest.raises(hobbitpy.ChatTemplateError, match="made a value larger than"):
        formatter(messages=MESSAGES)
    assert time.monotonic() - started < 1.0
    # an ordinary template through the same sandbox renders as before
    plain = BoundedChatFormatter(template="{% for m in messages %}{{ m['role'] + ': ' + m['content'] * 2 }}{% endfor %}",
                                 eos_token="</s>", bos_token="<s>")
    assert plain(messages=MESSAGES).prompt == "user: hihi"
