"""``hobbitpy serve``: an OpenAI-compatible HTTP server whose model serves its experts from
the expert cache.

It is llama-cpp-python's own server (its ``[server]`` extra: FastAPI, uvicorn, the same
routes, streaming and chat formats as ``python -m llama_cpp.server``), with the model
loaded as a ``hobbitpy.Llama``, and two more routes: ``/health`` and Prometheus
``/metrics`` (the expert cache's counters and llama.cpp's token counts). What it changes
so that no client can hurt another or the server: requests take turns on the model (a
stream is never cut by the next request), a body is at most a few MB, a body is checked
before it reaches llama-cpp-python (a bad one, or a grammar llama.cpp cannot parse, is a 400
that says what is wrong, not a 500 or a crash), no browser origin may call it unless named,
no answer names a file, and /health says 503 while the model cannot read its experts.
"""

from __future__ import annotations

import contextvars
import gc
import hmac
import json
import logging
import pathlib
import socket

from .. import __version__
from ..settings.config import MAX_BODY_MB, OffloadConfig
from ..errors import ChatTemplateError, HobbitError, RequestError
from ..settings.generation import DEFAULTS, for_llama_cpp_python, generation_error
from .grammars import json_schema_grammar
from .llama import Llama
from ..files.tokens import UNENCODABLE, out_of_vocabulary

log = logging.getLogger("hobbitpy")

# A completion's prompts when the route cannot carry them, on their way from the guard to the
# served model: llama-cpp-python's request model takes one prompt of text, OpenAI's takes token
# ids and several prompts too. The route is given prompt "" and ServedLlama reads the prompts
# from here. A context variable of the request's task: the thread the route calls the model in
# inherits it, and no other request sees it.
_PROMPTS: contextvars.ContextVar[list[str | list[int]] | None] = contextvars.ContextVar("prompts", default=None)


class ServedLlama(Llama):
    """The served model, which takes a completion's prompts from the request's guard
    (_PROMPTS: several are answered one after the other, one choice each, as OpenAI numbers
    them); what a request's content makes llama-cpp-python (or hobbitpy) refuse by a
    ValueError, a TypeError, a KeyError, an IndexError or an assert becomes a RequestError,
    which the guard answers as a 400 (the route would answer 500)."""

    CLIENT_ERRORS = (ValueError, TypeError, KeyError, IndexError, AssertionError)

    def create_completion(self, *args, **kwargs):
        prompts = _PROMPTS.get()
        if prompts is None:
            return self._one_completion(*args, **kwargs)
        if len(prompts) == 1:
            return self._one_completion(**kwargs | {"prompt": prompts[0]})
        if kwargs.get("stream"):
            return self._streams_one_after_another(prompts, kwargs)
        answers = [self._one_completion(**kwargs | {"prompt": p}) for p in prompts]
        usage = {k: sum(a["usage"][k] for a in answers) for k in answers[0]["usage"]}
        return answers[0] | {"choices": [a["choices"][0] | {"index": i} for i, a in enumerate(answers)],
                             "usage": usage}

    def _streams_one_after_another(self, prompts: list, kwargs: dict):
        first_id = None
        for i, prompt in enumerate(prompts):
            for chunk in self._one_completion(**kwargs | {"prompt": prompt}):
                first_id = first_id or chunk["id"]  # one response: one id, as OpenAI's
                yield chunk | {"id": first_id, "choices": [c | {"index": i} for c in chunk["choices"]]}

    def _one_completion(self, *args, **kwargs):
        try:
            return super().create_completion(*args, **kwargs)
        except self.CLIENT_ERRORS as e:
            raise self._refused(e) from e

    def create_chat_completion(self, *args, **kwargs):
        try:
            return super().create_chat_completion(*args, **kwargs)
        except self.CLIENT_ERRORS as e:
            raise self._refused(e) from e

    def _refused(self, e: Exception) -> RequestError:
        said = (str(e) or type(e).__name__).replace(self.model_path, "the model")  # no answer names a file
        return RequestError(RequestError.PREFIX + said)


def _proxy_class():
    from llama_cpp.server.model import LlamaProxy

    class OffloadLlamaProxy(LlamaProxy):
        """llama-cpp-python's holder of the served model, loading a hobbitpy.Llama."""

        def __init__(self, models, offload: OffloadConfig):
            self.offload = offload  # read by the load in LlamaProxy.__init__
            self.load_error: str | None = None  # why the model could not be loaded again, until it can
            super().__init__(models)

        def __call__(self, model=None):
            # (called by the routes under the server's lock: no request is decoding)
            if self._current_model is not None and self._current_model.read_error is not None:
                # an expert could not be read: the file it mapped was cut, written to or unreadable,
                # and the runtime serves only the model it loaded. It is let go first (its memory
                # is the budget the new one takes; freed as soon as no scrape of /metrics still
                # reads it, never under one), then the file is loaded again as it is now
                self._current_model = None
                gc.collect()
            if self._current_model is None:
                try:
                    self._current_model = self.load_llama_from_model_settings(self._default_model_settings)
                except Exception as e:  # still cut or unreadable: 503 until a load succeeds
                    self.load_error = str(e)
                    raise
                self._current_model_alias = self._default_model_alias
                self.load_error = None
            return super().__call__(model)

        def load_llama_from_model_settings(self, settings):
            # the ubatch only when asked for: left open, the planner narrows it when memory is short
            asked = {"n_ubatch": settings.n_ubatch} if "n_ubatch" in settings.model_fields_set else {}
            return ServedLlama(settings.model, offload=self.offload, n_ctx=settings.n_ctx, n_batch=settings.n_batch,
                         n_threads=settings.n_threads, n_gpu_layers=settings.n_gpu_layers,
                         n_threads_batch=settings.n_threads_batch, seed=settings.seed,
                         chat_format=settings.chat_format, flash_attn=settings.flash_attn,
                         last_n_tokens_size=settings.last_n_tokens_size, verbose=settings.verbose, **asked)

        @property
        def current(self) -> Llama | None:
            return self._current_model

    return OffloadLlamaProxy


class ExpertCacheCollector:
    """Prometheus metrics of the served model, read when scraped: the expert cache's
    counters (cumulative since load) and llama.cpp's evaluated tokens."""

    def __init__(self, proxy):
        self.proxy = proxy

    def collect(self):
        import llama_cpp
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        llm = self.proxy.current
        if llm is None:
            return
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        yield CounterMetricFamily("hobbitpy_prompt_tokens", "Prompt tokens evaluated (a reused prefix is not)",
                                  value=perf.n_p_eval)
        # decode steps, what the decode speed is of: a reply's last sampled token is never evaluated
        # (run's --stats-json: n_decode_evals; its n_tokens counts every token sampled)
        yield CounterMetricFamily("hobbitpy_generated_tokens", "Tokens decoded: generated tokens evaluated one "
                                  "decode step each (a reply's last one is sampled, never evaluated)", value=perf.n_eval)
        yield GaugeMetricFamily("hobbitpy_decode_tokens_per_second", "Decoded tokens per second of decoding, since load",
                                value=perf.n_eval / (perf.t_eval_ms / 1000.0) if perf.t_eval_ms > 0 else 0.0)
        yield GaugeMetricFamily("hobbitpy_offloaded", "1 when the experts run through the expert cache",
                                value=1.0 if llm.offloaded else 0.0)
        stats = llm.offload_stats()
        if not stats["offloaded"]:
            return
        counters = {
            "expert_hits": ("expert_hits", "Selections of an expert found in the cache"),
            "expert_misses": ("expert_misses", "Selections of an expert that had to be loaded"),
            "expert_inplace": ("expert_inplace", "Missed experts computed in place on the mapped model"),
            "expert_skipped": ("n_skipped", "Selections skipped (missed, and scored below every precision)"),
            "read_bytes": ("bytes_read", "Bytes of experts read from disk"),
            "demand_read_bytes": ("demand_bytes_read", "Bytes read while a decode waited for them"),
            "background_read_bytes": ("background_bytes_read", "Bytes read in the background (prefetch, upgrades, warm-up)"),
            "prefetch_issued": ("prefetch_issued", "Experts prefetched"),
            "prefetch_used": ("prefetch_used", "Prefetched experts then selected"),
            "upgrades": ("upgrades", "Higher-precision copies loaded after a lower-precision hit"),
            "neuron_predicted_selections": ("neuron_selections", "Selections whose neurons CORM's mask predicted "
                                                                 "(--neurons; MoE layers after the first), or whose "
                                                                 "gate chose them (--neuron-layout; every MoE layer)"),
            "neuron_kept_selections": ("neuron_kept", "Those selections' kept shares of their neurons, summed "
                                                      "(divided by the above: the mean share kept)"),
            "neuron_read_requests": ("neuron_reads", "Reads of runs of neurons' rows (--neuron-layout)"),
        }
        for name, (key, doc) in counters.items():
            yield CounterMetricFamily(f"hobbitpy_{name}", doc, value=stats[key])
        yield CounterMetricFamily("hobbitpy_stall_seconds", "Time decoding waited for expert loads",
                                  value=stats["stall_us"] / 1e6)
        served = CounterMetricFamily("hobbitpy_served_selections", "Expert selections served, by precision level "
                                     "(0 = high)", labels=["level"])
        for level, n in enumerate(stats["served"]):
            served.add_metric([str(level)], n)
        yield served
        yield GaugeMetricFamily("hobbitpy_expert_cache_budget_bytes", "Bytes of the expert cache",
                                value=stats["budget_bytes"])


# the routes whose bodies are checked here, by the request model of llama-cpp-python's server
# that the route itself parses them with
_REQUEST_MODELS = {"/v1/completions": "CreateCompletionRequest", "/v1/chat/completions": "CreateChatCompletionRequest",
                   "/extras/tokenize": "TokenizeInputRequest", "/extras/tokenize/count": "TokenizeInputRequest",
                   "/extras/detokenize": "DetokenizeInputRequest"}
_NOT_SERVED = {"/v1/embeddings": "embeddings are not served: the model is loaded to generate text"}


class _NotANumber(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NotANumber(f"{name} is not a number JSON allows")


# deeper than any request needs (a JSON schema of a tool or a response format: tens of levels),
# far below what the recursive checks and converters after this one would overflow on
MAX_JSON_DEPTH = 100
# prompts in one completion request: they are answered one after another (each to the end of
# the text by default), and every other client waits meanwhile
MAX_PROMPTS = 64


def _depth(value) -> int:
    """How deep lists and objects nest in a parsed JSON value (counted without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def request_error(path: str, body: bytes, llm: Llama | None) -> str | None:
    """Why a request to `path` with this body cannot be served (a 400's message), or None.
    Checked here, before the route: llama-cpp-python answers a body it cannot parse, a value
    out of range, text that is no text or a parameter it ignores with a 500 carrying the server's
    file paths, or silently (n > 1 returns one choice), or not at all (a grammar llama.cpp
    cannot parse crashed the process)."""
    if path in _NOT_SERVED:
        return _NOT_SERVED[path]
    if path not in _REQUEST_MODELS:
        return None
    from llama_cpp.server import types
    from pydantic import ValidationError

    try:
        request = json.loads(body, parse_constant=_refuse_constant)
    except _NotANumber as e:
        return str(e)
    except UnicodeDecodeError:
        return "the body is not UTF-8 text"
    except json.JSONDecodeError as e:
        return f"the body is not JSON ({e.msg} at character {e.pos})"
    except RecursionError:
        return "the body nests too deep"
    if not isinstance(request, dict):
        return "the body is not a JSON object"
    if _depth(request) > MAX_JSON_DEPTH:
        return f"the body nests more than {MAX_JSON_DEPTH} levels deep"
    if _has_lone_surrogate(request):
        return "a string holds a lone surrogate (\\ud800-\\udfff), which is no text"
    if why := _prompt_shape_error(path, request):
        return why
    if path in _GENERATING:
        filled = _with_defaults(request)
        if why := generation_error(filled):
            return why
        request = for_llama_cpp_python(filled)
    beside = path == "/v1/completions" and carried(request)  # (prompts the route is not given: see as_served)
    try:
        getattr(types, _REQUEST_MODELS[path]).model_validate(request | ({"prompt": ""} if beside else {}))
    except ValidationError as e:
        problems = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()]
        return "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")
    if request.get("n") not in (None, 1) or request.get("best_of") not in (None, 1):
        return "one choice per request: n and best_of must be 1 (send several requests)"
    if request.get("logprobs") not in (None, False) or request.get("top_logprobs") is not None:
        return "logprobs are not served: the model keeps the last token's logits only"
    if llm is None:
        return None
    if why := _logit_bias_error(request.get("logit_bias"), llm.n_vocab()):
        return why
    if path == "/extras/detokenize" and (why := _detokenize_error(request.get("tokens"), llm)):
        return why
    for field, prompt in (_prompts_of(request) if path == "/v1/completions" else []):
        if isinstance(prompt, list) and (why := out_of_vocabulary(prompt, llm.n_vocab())):
            return f"{field}: {why}"
        if len(prompt) == 0 and not llm.can_start_empty():
            return f"{field}: it is empty, and this model adds no beginning-of-text token to continue from"
    for field, text in _texts_of(request):
        if why := llm.unencodable(text):
            return f"{field}: {why}"
    grammar = request.get("grammar")
    if isinstance(grammar, str):
        return llm.grammar_error(grammar)
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_object" and "schema" in response_format:
        try:  # as run -j refuses it (llama-cpp-python would constrain to any JSON instead)
            return llm.grammar_error(json_schema_grammar(json.dumps(response_format["schema"])))
        except HobbitError as e:
            return f"response_format.schema: {e}"
    return None


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts_of(request: dict) -> list[tuple[str, str | list[int]]]:
    """A completion's prompts as OpenAI takes them, each with its field's name: text, token ids
    (a list of integers), or a list of several of either ("" when it gives none)."""
    prompt = request.get("prompt", "")
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        return [("prompt", prompt)]
    if isinstance(prompt, list) and prompt:
        return [(f"prompt.{i}", p) for i, p in enumerate(prompt)]
    return [("prompt", "")]


def carried(request: dict) -> list[str | list[int]] | None:
    """A completion's prompts when the route cannot take them as they are (token ids, or
    several), to be carried beside it (_PROMPTS); None when the route can (one text)."""
    prompts = [p for _, p in _prompts_of(request)]
    return None if len(prompts) == 1 and isinstance(prompts[0], str) else prompts


def _prompt_shape_error(path: str, request: dict) -> str | None:
    """What is wrong with a completion's prompt or a chat's messages that the request models
    let through to a failure inside the route (a 500), or say as a dump of every alternative."""
    if path == "/v1/completions":
        prompts = _prompts_of(request)
        for field, prompt in prompts:
            if not (isinstance(prompt, str) or _is_ids(prompt)):
                return f"{field}: a prompt is text or a list of token ids (integers)"
        if len(prompts) > MAX_PROMPTS:
            return f"prompt: at most {MAX_PROMPTS} prompts in one request ({len(prompts)} were sent)"
        if request.get("echo") and any(isinstance(p, list) for _, p in prompts):
            return "echo: a prompt of token ids is not echoed (send the prompt as text to have it echoed)"
    if path == "/v1/chat/completions" and not request.get("messages"):
        return "messages: at least one message is needed"
    return None


def _logit_bias_error(bias, n_vocab: int) -> str | None:
    if not isinstance(bias, dict):
        return None
    for key in bias:
        if not (key.lstrip("-").isdigit() and 0 <= int(key) < n_vocab):
            return f"logit_bias: {key!r} is not a token id (an integer from 0 to {n_vocab - 1})"
    return None


def _detokenize_error(tokens, llm: Llama) -> str | None:
    if not _is_ids(tokens):
        return None
    if why := out_of_vocabulary(tokens, llm.n_vocab()):
        return f"tokens: {why}"
    try:  # the route decodes the bytes strictly (a 500 on a byte token that starts a character)
        llm.detokenize(tokens).decode("utf-8")
    except UnicodeDecodeError as e:
        return f"tokens: their bytes are not UTF-8 text (byte {e.start}: a character cut between tokens)"
    return None


def _texts_of(request: dict):
    """(field, text) of every text the model will tokenize: the prompt, the messages' contents."""
    prompt = request.get("prompt")
    for i, text in enumerate([prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []):
        if isinstance(text, str):
            yield ("prompt" if isinstance(prompt, str) else f"prompt.{i}"), text
    messages = request.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        for part in parts:
            text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str):
                yield f"messages.{i}.content", text


_GENERATING = ("/v1/completions", "/v1/chat/completions")


def _with_defaults(request: dict) -> dict:
    """A completion's or chat's fields, the shared defaults (generation.py) for those it leaves
    out, where llama-cpp-python's request models have their own (16 tokens for a completion,
    repeat_penalty 1.1); `max_completion_tokens`, current OpenAI clients' name, read as
    max_tokens."""
    request = dict(request)
    if request.get("max_tokens") is None and "max_completion_tokens" in request:
        request["max_tokens"] = request["max_completion_tokens"]
    request.pop("max_completion_tokens", None)
    for name, value in DEFAULTS.items():
        if request.get(name) is None:  # left out, or null: OpenAI's "the default"
            request[name] = value
    return request


def as_served(path: str, body: bytes, model_id: str) -> tuple[bytes, list[str | list[int]] | None]:
    """A completion's or chat's body (request_error found it sound) as the route is to serve
    it, and the prompts carried beside it (carried()): the shared defaults for the
    generation fields it leaves out, as llama-cpp-python reads them, and the served model's id
    whatever model it names (one model is served: as llama-server and llama-cpp-python's
    server do, any name is this one, and every response says its id, not its file)."""
    if path not in _GENERATING:
        return body, None
    request = json.loads(body)
    prompts = carried(request) if path == "/v1/completions" else None
    served = for_llama_cpp_python(_with_defaults(request)) | {"model": model_id}
    return json.dumps(served | ({"prompt": ""} if prompts is not None else {})).encode(), prompts


class RequestGuard:
    """ASGI middleware before every route: with an API key, refuses a request without it (401;
    /health alone is open, and says nothing but whether the model is up); refuses a body over
    max_body_bytes (413) and one request_error finds wrong (400); then passes the request on as
    it came. A route's failure (5xx) is told without the server's internals: 503 while the
    model cannot read its experts (/health says the same), else 500; the log has the details."""

    def __init__(self, app, proxy, max_body_bytes: int, api_key: str | None, model_id: str):
        self.app, self.proxy, self.max_body_bytes = app, proxy, max_body_bytes
        self.api_key = api_key.encode() if api_key else None
        self.model_id = model_id  # the served model's id (/v1/models), in every response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if (self.api_key is not None and scope["path"] != "/health" and scope["method"] != "OPTIONS"
                and not self._has_key(headers.get(b"authorization", b""))):
            return await _refuse(send, 401, "this server needs its API key (Authorization: Bearer KEY)")
        if scope["path"] != "/health":  # its 503 is its own answer
            send = self._failures_told_plainly(send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _refuse(send, 413, f"the request body is {int(length)} bytes; at most {self.max_body_bytes}")
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _refuse(send, 413, f"the request body is over {self.max_body_bytes} bytes")
        why = request_error(scope["path"], bytes(body), self.proxy.current)
        if why is not None:
            return await _refuse(send, 400, why)
        body, prompts = as_served(scope["path"], bytes(body), self.model_id)
        # the body is JSON whatever its Content-Type said (plain `curl -d` sends a form's), as
        # llama-server reads it
        json_route = scope["path"] in _REQUEST_MODELS
        scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                     if k != b"content-length" and not (json_route and k == b"content-type")] +
                     [(b"content-length", str(len(body)).encode())] +
                     ([(b"content-type", b"application/json")] if json_route else []))
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # the body was read: what comes next is the disconnect
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        held = _PROMPTS.set(prompts)
        try:
            return await self.app(scope, replay, send)
        finally:
            _PROMPTS.reset(held)

    def _has_key(self, authorization: bytes) -> bool:
        # "Bearer KEY"; the scheme's case is free (RFC 7235: "bearer KEY" is the same)
        scheme, _, key = authorization.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key)

    def _failures_told_plainly(self, send):
        """send, with a 5xx response's body replaced: llama-cpp-python's carries the exception's
        text (the model's path among it). A chat template that failed on the request's
        conversation is the request's: a 400 with the template's error."""
        failed = False
        body = bytearray()

        async def told_plainly(message):
            nonlocal failed
            if message["type"] == "http.response.start" and message["status"] >= 500:
                failed = True
                return
            if not failed:
                return await send(message)
            if message["type"] != "http.response.body":
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            llm = self.proxy.current
            said = _error_message(bytes(body))
            if said.startswith(ChatTemplateError.PREFIX):
                await _refuse(send, 400, said)
            elif UNENCODABLE in said:
                # the request's text passed request_error, so the text the chat template wrapped it
                # in holds the character (said without the file's path)
                await _refuse(send, 400, "the chat template's text: " + said[said.index(UNENCODABLE):])
            elif said.startswith(RequestError.PREFIX):
                await _refuse(send, 400, said.removeprefix(RequestError.PREFIX))
            elif (llm is not None and llm.read_error is not None) or self.proxy.load_error is not None:
                await _refuse(send, 503, "an expert could not be read (the model file changed, or the disk failed); "
                                         "GET /health says when the model serves again", "server_error")
            else:
                await _refuse(send, 500, "the server could not complete this request (its log says why)", "server_error")

        return told_plainly


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, or ""."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return message if isinstance(message, str) else ""


async def _refuse(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": kind}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(model_path: str, offload: OffloadConfig, *, n_ctx: int, n_threads: int, n_gpu_layers: int = 0,
               alias: str | None = None, chat_format: str | None = None, api_key: str | None = None,
               verbose: bool = False, cors_origins: tuple[str, ...] = (), max_body_mb: float = MAX_BODY_MB):
    """The ASGI app: llama-cpp-python's routes (/v1/completions, /v1/chat/completions,
    /v1/models, ...) on a hobbitpy.Llama, plus /health and /metrics. Loads the model.
    cors_origins: the browser origins allowed to call it (none by default)."""
    try:
        from fastapi import FastAPI
        from fastapi.middleware.cors import CORSMiddleware
        from fastapi.responses import JSONResponse, Response
        from llama_cpp.server import app as server_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from starlette.middleware import Middleware
        from starlette_context.middleware import RawContextMiddleware
        from starlette_context.plugins import RequestIdPlugin
    except ImportError as e:
        raise HobbitError(f"serving needs llama-cpp-python's server extra and prometheus_client ({e}); "
                          "pip install 'hobbitpy[server]'") from None

    # the model's id in the API: the alias, or the file's name without .gguf (not where it lives)
    alias = alias or pathlib.Path(model_path).name.removesuffix(".gguf")
    model_settings = ModelSettings(model=model_path, model_alias=alias, n_ctx=n_ctx, n_threads=n_threads,
                                   n_threads_batch=n_threads, n_gpu_layers=n_gpu_layers, chat_format=chat_format,
                                   verbose=verbose)
    # interrupt_requests off: a request waits for the one decoding instead of cutting its stream
    # (llama-cpp-python's default ends the running stream, without a finish_reason, for any other)
    server_settings = ServerSettings(api_key=api_key, interrupt_requests=False)
    proxy = _proxy_class()([model_settings], offload)

    # as llama_cpp.server.app.create_app builds it, with this proxy in place of one that
    # would load a stock llama_cpp.Llama first
    server_app.set_server_settings(server_settings)
    app = FastAPI(middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
                  title="hobbitpy", version=__version__)
    if cors_origins:  # else none: any web page open in a local browser could drive the server
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestGuard, proxy=proxy, max_body_bytes=int(max_body_mb * 1024 * 1024), api_key=api_key,
                       model_id=alias)
    app.include_router(server_app.router)
    server_app._llama_proxy = proxy  # the model every route of the router uses (set_llama_proxy takes settings)

    registry = CollectorRegistry()
    registry.register(ExpertCacheCollector(proxy))

    @app.get("/metrics")  # a route, not a mount: a mount answers /metrics with a 307 to /metrics/
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    def health():
        llm = proxy.current
        # a failed expert read: unhealthy until the model is loaded again from its file (whole
        # again, the disk well) and a decode succeeds
        failing = (llm is not None and llm.read_error is not None) or proxy.load_error is not None
        status = {"status": "loading" if llm is None else "error" if failing else "ok"}
        if api_key is None:  # with a key, open to anyone: whether it is up, nothing more
            status |= {"model": alias,
                       "offloaded": bool(llm is not None and llm.offloaded)}
        return JSONResponse(status, status_code=503 if failing else 200)

    return app


GRACEFUL_SHUTDOWN_S = 30  # what a stream open at SIGTERM has to finish (orchestrators SIGKILL after ~30 s)


def serve(model_path: str, offload: OffloadConfig, *, host: str, port: int, n_ctx: int, n_threads: int,
          n_gpu_layers: int = 0, alias: str | None = None, chat_format: str | None = None, api_key: str | None = None,
          verbose: bool = False, cors_origins: tuple[str, ...] = (), max_body_mb: float = MAX_BODY_MB) -> None:
    """Load the model and serve it until interrupted. The port is taken first: a busy one is
    said before minutes of loading."""
    import uvicorn

    try:
        listening = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                         reuse_port=False)
    except OSError as e:
        raise HobbitError(f"{host}:{port}: cannot listen there ({e.strerror}); choose another --port or --host") from None
    with listening:
        log.info(f"serving {model_path} on http://{host}:{port} (OpenAI API under /v1, /health, /metrics)")
        app = create_app(model_path, offload, n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers, alias=alias,
                         chat_format=chat_format, api_key=api_key, verbose=verbose, cors_origins=cors_origins,
                         max_body_mb=max_body_mb)
        # SIGTERM: no new request is taken, and the open ones finish (a stream with its
        # finish_reason) for up to GRACEFUL_SHUTDOWN_S; sse-starlette would cut every open
        # stream at once, with no finish_reason
        from sse_starlette.sse import AppStatus

        AppStatus.disable_automatic_graceful_drain()
        config = uvicorn.Config(app, log_level="info" if verbose else "warning",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        uvicorn.Server(config).run(sockets=[listening])
