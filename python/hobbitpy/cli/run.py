"""`hobbitpy run`: generate from a prompt, or chat; the run's statistics."""

from __future__ import annotations

import os
import sys

from .common import (add_gpu_layers_arg, add_offload_args, add_sampling_args, add_verbosity_args, default_model, fail,
                    gpu_layers, json_target_error, log, offload_config_from_args, sampling_error, sampling_keywords,
                    threads_arg, write_json)


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt, or chat",
                       description="Generate text from a prompt (or chat with --chat); routed experts run through a "
                                   "budgeted expert cache. Flags as llama.cpp names them.")
    p.add_argument("model", nargs="?", help="GGUF model file (default: the small mixtral-style model shipped with hobbitpy)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("-p", "--prompt", help="prompt text")
    what.add_argument("--chat", action="store_true", help="an interactive chat with history (Ctrl-D or Ctrl-C ends it)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (per reply with --chat; default 64)")
    add_sampling_args(p)
    p.add_argument("-t", "--threads", type=threads_arg, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context length in tokens (default: the model's training context)")
    add_gpu_layers_arg(p)
    p.add_argument("--no-echo", action="store_true", help="print only the generated text, not the prompt before it")
    add_offload_args(p)
    p.add_argument("--stats-json", metavar="FILE", help="write run statistics as JSON to FILE (a new file)")
    add_verbosity_args(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import hobbitpy
    from hobbitpy import HobbitError

    if args.model is None:
        args.model = default_model()
        if args.model is None:
            return fail("no model given and no default model installed")
    if args.prompt == "":
        return fail("--prompt is empty: give the text to continue (or --chat)")
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as surrogates
            return fail(f"--prompt is not valid UTF-8 (at character {e.start}); give it as UTF-8 text")
    if why := sampling_error(args):
        return fail(why)
    if args.ctx is not None and args.ctx < 16:
        return fail(f"--ctx must be at least 16, got {args.ctx}")
    if args.stats_json and (why := json_target_error(args.stats_json)):
        return fail(why)

    if args.seed is None:
        # llama-cpp-python would sample with the same seed every run
        import secrets

        args.seed = secrets.randbits(31)
        if args.temp > 0:
            log.info(f"sampling seed {args.seed} (--seed {args.seed} repeats this run)")
    try:
        n_ctx = args.ctx or hobbitpy.inspect_model(args.model).n_ctx_train or 512
        offload = offload_config_from_args(args, args.model, auto_profile=True)
        llm = hobbitpy.Llama(args.model, offload=offload, n_ctx=n_ctx, n_threads=args.threads, verbose=args.verbose,
                             seed=args.seed, n_gpu_layers=gpu_layers(args))
    except (ValueError, HobbitError) as e:
        return fail(str(e))
    log.info(llm.offload_plan.reason)

    with llm:
        if args.chat:
            return _chat(llm, args)
        import llama_cpp

        ctx = llm._ctx.ctx
        llama_cpp.llama_perf_context_reset(ctx)
        if not args.no_echo:
            sys.stdout.write(args.prompt)
        try:
            for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict, stream=True, **sampling_keywords(args)):
                sys.stdout.write(chunk["choices"][0]["text"])
                sys.stdout.flush()
        except (HobbitError, ValueError) as e:  # ValueError: llama_cpp's "exceed context window"
            sys.stdout.write("\n")
            return fail(str(e) if isinstance(e, HobbitError) else f"{args.model}: {e}")
        except KeyboardInterrupt:
            # what was generated stays on screen; no traceback
            sys.stdout.write("\n")
            log.info("interrupted")
            return 130
        sys.stdout.write("\n")
        stats = _run_stats(llm, args.model) | {"seed": args.seed}
    if args.stats_json and (why := write_json(args.stats_json, stats)):
        return fail(why)
    return 0


def _chat(llm, args) -> int:
    """An interactive chat with history: a line from the user, the reply streamed."""
    from hobbitpy import HobbitError

    messages = []
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                sys.stdout.write("\n")
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = []
            for chunk in llm.create_chat_completion(messages, max_tokens=args.n_predict, stream=True, **sampling_keywords(args)):
                piece = chunk["choices"][0]["delta"].get("content") or ""
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    except HobbitError as e:  # the model's chat template failed, an expert could not be read
        return fail(f"{args.model}: {e}")


def _run_stats(llm, model: str) -> dict:
    """--stats-json: tokens, times and the expert cache's counters of the run."""
    import llama_cpp

    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    stats = {
        "model": model,
        "offload": llm.offloaded,
        "n_prompt_tokens": int(perf.n_p_eval),
        # every sampled token but the last is evaluated, one per decode step
        "n_tokens": int(perf.n_eval) + 1,
        "prefill_ms": float(perf.t_p_eval_ms),
        "decode_tok_s": (perf.n_eval / perf.t_eval_ms * 1000.0) if perf.t_eval_ms > 0 else None,
        "n_decode_evals": int(perf.n_eval),
    }
    s = llm.offload_stats()
    stats.update({
        "expert_hits": s["expert_hits"] if s else 0,
        "expert_misses": s["expert_misses"] if s else 0,
        "expert_inplace": s["expert_inplace"] if s else 0,
        "bytes_read": s["bytes_read"] if s else 0,
        "peak_pool_bytes": s["peak_pool_bytes"] if s else 0,
        "budget_bytes": s["budget_bytes"] if s else 0,
        "runtime": s,
        # per pool (precision level and expert signature): hits, misses, bytes read
        "pools": llm.pool_stats(),
    })
    if s:
        selections = sum(s["served"]) + s["n_skipped"]
        stats.update({
            "n_skipped": s["n_skipped"],
            "prefetch_issued": s["prefetch_issued"],
            "prefetch_used": s["prefetch_used"],
            "prefetch_wasted": s["prefetch_wasted"],
            # share of the selections served at each precision level (0 = the model's own)
            "served_share": [n / selections if selections else 0.0 for n in s["served"]],
            "skipped_share": s["n_skipped"] / selections if selections else 0.0,
        })
    return stats
