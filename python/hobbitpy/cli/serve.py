"""`hobbitpy serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import os

from .common import (CTX_HELP, add_gpu_layers_arg, add_offload_args, add_verbosity_args, default_model, fail,
                     gpu_layers, log, offload_config_from_args, threads_arg)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
                       description="Serve the model over HTTP with llama-cpp-python's server (the OpenAI API: "
                                   "/v1/completions, /v1/chat/completions with streaming, /v1/models), its experts "
                                   "through the expert cache; /health, and Prometheus /metrics of the cache.")
    p.add_argument("model", nargs="?", help="GGUF model file (default: the small mixtral-style model shipped with hobbitpy)")
    p.add_argument("-m", "--model", dest="model_flag", metavar="FILE", help="the model, as llama-server takes it")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None, metavar="N", help=CTX_HELP)
    p.add_argument("-t", "--threads", type=threads_arg, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    add_gpu_layers_arg(p)
    p.add_argument("-a", "--alias", help="the model's id in the API (default: the file's name without .gguf); a "
                                         "request may name the model as its client likes: one model is served")
    p.add_argument("--chat-format", help="llama-cpp-python chat format (default: the model's template)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require this bearer token on every route but /health (visible to `ps`: "
                                       "prefer --api-key-file or HOBBITPY_API_KEY)")
    key.add_argument("--api-key-file", metavar="PATH", help="require the bearer token this file holds (its first line)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed to call the server, e.g. http://localhost:3000 (repeatable; "
                        "default none: no web page can)")
    from hobbitpy.settings.config import MAX_BODY_MB

    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_MB,
                   help=f"refuse a request body larger than this many MB (413; default {MAX_BODY_MB:g})")
    add_offload_args(p)
    add_verbosity_args(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from hobbitpy import HobbitError, inspect_model
    from hobbitpy.plan.memory import available_memory_bytes, default_context, padded_context
    from hobbitpy.runtime.chat_template import chat_format_error
    from hobbitpy.runtime.serve import serve

    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            return fail(f"two models given ({args.model} and -m {args.model_flag}): give one")
        args.model = args.model_flag
    if args.model is None:
        args.model = default_model()
        if args.model is None:
            return fail("no model given and no default model installed")
    if not 0 < args.port < 65536:
        return fail(f"--port must be 1..65535, got {args.port}")
    if args.chat_format is not None and (why := chat_format_error(args.chat_format)):
        return fail(f"--chat-format: {why}")
    api_key = args.api_key or os.environ.get("HOBBITPY_API_KEY") or None
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                api_key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            return fail(f"{args.api_key_file}: cannot read the API key ({e})")
        if not api_key:
            return fail(f"{args.api_key_file}: its first line is empty, not an API key")
    max_body_mb = args.max_body_mb
    if not 0 < max_body_mb < float("inf"):
        return fail(f"--max-body-mb must be a positive number, got {args.max_body_mb}")
    try:
        if args.ctx is not None and args.ctx < 16:
            return fail(f"--ctx-size must be at least 16, got {args.ctx}")
        if args.ctx is not None and padded_context(args.ctx) != args.ctx:
            log.info(f"--ctx-size {args.ctx} rounded up to {padded_context(args.ctx)}, as llama.cpp pads a context")
        # the app loads the model with the context it is given: the shared default, where none is asked
        n_ctx = (padded_context(args.ctx) if args.ctx is not None else
                 default_context(inspect_model(args.model), available_memory_bytes()))
        offload = offload_config_from_args(args, args.model, auto_profile=True)
        serve(args.model, offload, host=args.host, port=args.port, n_ctx=n_ctx, n_threads=args.threads,
              n_gpu_layers=gpu_layers(args), alias=args.alias, chat_format=args.chat_format, api_key=api_key,
              verbose=args.verbose, cors_origins=tuple(args.cors_origin), max_body_mb=max_body_mb)
    except (ValueError, HobbitError, OSError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130
    return 0
