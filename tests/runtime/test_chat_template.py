"""A model's chat template that loops without end, grows a value without bound, raises or does
not parse: a ChatTemplateError within seconds (one line from `run --chat`, a 400 from the server,
which goes on serving), never a core pinned for good or a traceback.

Each bound is tested with a template that can reach only that bound, so that which bound a
machine reaches first never decides a test: "loops" loops without making anything (the time
bound; a loop that also grew its output reached the memory bound first on a faster machine),
"grows" asks for gigabytes in one step (the memory bound, long before any deadline)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

import hobbitpy
from hobbitpy.runtime import chat_template
from hobbitpy.runtime.chat_template import RENDER_SECONDS

from serving import MODEL, http_get, http_post, start_server, still_answers, stop_server

TEMPLATES = {
    "loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "grows": "{% for m in messages %}{{ m['content'] * 10**10 }}{% endfor %}",
    "raises": "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
    "does not parse": "{% for %}",
}
SAYS = {"loops": "rendering did not finish within", "grows": "rendering asked for more than", "raises": "roles must alternate", "does not parse": "does not parse"}
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


@pytest.mark.parametrize("name", ["loops", "grows"])
def test_the_server_answers_a_400_and_goes_on_serving(folder, name):
    proc, base = start_server(model=with_template(folder, name))
    try:
        start = time.monotonic()
        status, answer = http_post(base + "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode())
        assert status == 400 and SAYS[name] in answer["error"]["message"], answer
        assert time.monotonic() - start < RENDER_SECONDS + 10
        assert json.loads(http_get(base + "/health")[1])["status"] == "ok"
        still_answers(base)
    finally:
        stop_server(proc)



@pytest.mark.parametrize("name, tightened", [("loops", {"HEAP_BYTES": 4 << 20}), ("grows", {"RENDER_SECONDS": 0.5})])
def test_each_template_reaches_its_own_bound_whichever_is_tighter(monkeypatch, name, tightened):
    """The other bound made far tighter (a machine that would reach it first): the template still
    reaches its own, so the tests above hold on machines faster and slower than this one."""
    for bound, value in tightened.items():
        monkeypatch.setattr(chat_template, bound, value)
    formatter = chat_template.BoundedChatFormatter(template=TEMPLATES[name], eos_token="</s>", bos_token="<s>")
    with pytest.raises(hobbitpy.ChatTemplateError, match=SAYS[name]):
        formatter(messages=MESSAGES)

# (Jinja's ** groups from the left, hence the parentheses)
MEMORY_BOMBS = [
    "{{ 'x' * 10**11 }}",  # 100 GB at once
    "{{ (['x'] * 1000) * 10**9 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x'|center(10**10) }}",
    "{{ '%010000000000d'|format(1) }}",
    "{{ '%010000000000d' % 1 }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ '{:>10000000000}'.format(1) }}",
    "{{ ('x\\n' * 1000000)|indent(100000) }}",  # (blank lines stay unindented)
    "{{ (['x' * 1000000] * 100000)|join }}",
    "{{ ([[1] * 1000] * 100000)|sum(start=[]) }}",
]
INTEGER_BOMBS = [
    "{{ 7 ** (10**12) }}",  # a power no deadline interrupts: one C call
    "{% set ns = namespace(n=7) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}",
]
# each bomb compiled and rendered in a child process whose address space is capped, so that a
# bound that does not hold fails the test instead of taking the machine's memory
RENDER_BOMBS = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import hobbitpy
from hobbitpy.runtime.chat_template import BoundedChatFormatter
out = []
for template in json.loads(sys.argv[1]):
    started = time.monotonic()
    try:
        BoundedChatFormatter(template=template, eos_token="</s>", bos_token="<s>")(messages=[{"role": "user", "content": "hi"}])
        said = None
    except hobbitpy.ChatTemplateError as e:
        said = str(e)
    out.append([template, said, time.monotonic() - started])
plain = BoundedChatFormatter(template="{% for m in messages %}{{ m['role'] + ': ' + m['content'] * 2 }}{% endfor %}",
                             eos_token="</s>", bos_token="<s>")
out.append(["plain", plain(messages=[{"role": "user", "content": "hi"}]).prompt, 0])
# VmHWM: this process's own peak (getrusage's ru_maxrss keeps the peak of the process it was
# forked from across exec: a large pytest parent would be counted)
peak_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"renders": out, "max_rss_kb": peak_kb}))
"""


def test_a_template_that_would_take_memory_or_time_without_end_is_stopped_within_its_bounds():
    from hobbitpy.runtime.chat_template import HEAP_BYTES

    proc = subprocess.run([sys.executable, "-c", RENDER_BOMBS, json.dumps(MEMORY_BOMBS + INTEGER_BOMBS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    *renders, (_, plain, _) = result["renders"]
    for template, said, seconds in renders:
        expected = "made an integer of more than" if template in INTEGER_BOMBS else "asked for more than 256 MB"
        assert said is not None and expected in said, (template, said)
        assert seconds < 2.0, (template, seconds)
    # an ordinary template through the same bounds renders as before
    assert plain == "user: hihi"
    # no bomb got far: the child's peak is an interpreter with llama_cpp, plus at most the budget
    assert result["max_rss_kb"] * 1024 < 200e6 + HEAP_BYTES, result["max_rss_kb"]
