"""`hobbitpy run`: generate from a prompt, or chat; the run's statistics."""

from __future__ import annotations

import argparse
import os
import sys

from .common import (CTX_HELP, add_force_arg, add_gpu_layers_arg, add_memory_args, add_n_predict_arg,
                     add_sampling_args, add_technique_args, add_verbosity_args, default_model, fail, gpu_layers,
                     json_target_error, log, offload_config_from_args, process_escapes, sampling_error,
                     sampling_keywords, threads_arg, write_json)
from .ctrl_c import CtrlC


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt, or chat", add_help=False,
                       usage="hobbitpy run [-m] MODEL (-p PROMPT | -f FILE | --chat) [options]",
                       description="Generate text from a prompt, or chat, with llama.cpp's flags.")
    model = p.add_argument_group("model and prompt")
    model.add_argument("model", nargs="?", help="GGUF model file (default: the small one shipped here)")
    model.add_argument("-m", "--model", dest="model_flag", metavar="FILE", help="the model, as llama.cpp takes it")
    what = model.add_mutually_exclusive_group(required=True)
    what.add_argument("-p", "--prompt", metavar="TEXT", help="prompt text")
    what.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE")
    what.add_argument("--chat", action="store_true", help="a chat with history (Ctrl-D ends it)")
    what.add_argument("-cnv", "--conversation", dest="chat", action="store_true", help=argparse.SUPPRESS)
    model.add_argument("-sys", "--system-prompt", metavar="TEXT", help="a system message: the prompt goes as a chat")
    generation = p.add_argument_group("generation")
    add_n_predict_arg(generation)
    generation.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=None, metavar="N",
                            help=CTX_HELP)
    generation.add_argument("-t", "--threads", type=threads_arg, default=os.cpu_count() or 1, metavar="N",
                            help="CPU threads (default: all cores)")
    add_gpu_layers_arg(generation)
    add_sampling_args(p)
    g = p.add_argument_group("constrained output")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--grammar", metavar="GBNF", help="sample only text this GBNF grammar allows")
    shape.add_argument("--grammar-file", metavar="FILE", help="the GBNF grammar from FILE")
    shape.add_argument("-j", "--json-schema", metavar="SCHEMA", help="sample only JSON of this JSON schema")
    add_memory_args(p)
    output = p.add_argument_group("output")
    output.add_argument("-h", "--help", action="help", help="show this help")
    output.add_argument("--no-echo", action="store_true", help="print the generated text only, not the prompt")
    output.add_argument("--no-display-prompt", dest="no_echo", action="store_true", help=argparse.SUPPRESS)
    output.add_argument("--stats-json", metavar="FILE", help="the run's statistics as JSON to FILE")
    add_force_arg(output)
    add_verbosity_args(output)
    add_technique_args(p)
    # llama.cpp's flags a person types out of habit, after what this command is about
    more = p.add_argument_group("more of llama.cpp's flags",
                                "-cnv and --conversation are --chat; --no-display-prompt is --no-echo")
    more.add_argument("-no-cnv", "--no-conversation", action="store_true",
                      help="complete the prompt, no chat (what -p does here)")
    escape = more.add_mutually_exclusive_group()
    escape.add_argument("-e", "--escape", action="store_true", default=True,
                        help="read \\n, \\t, \\\\, \\\", \\' and \\xNN in -p's text (default: on, as llama.cpp)")
    escape.add_argument("--no-escape", dest="escape", action="store_false", help="take -p's text as written")
    more.add_argument("-b", "--batch-size", type=int, default=None, metavar="N",
                      help="logical batch of a prompt's tokens (default: as memory allows)")
    more.add_argument("-ub", "--ubatch-size", type=int, default=None, metavar="N",
                      help="physical batch (default: as memory allows)")
    more.add_argument("-fa", "--flash-attn", nargs="?", const="on", choices=("on", "off", "auto"), default="auto",
                      metavar="on|off|auto", help="flash attention (auto: off)")
    more.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-text tokens")
    more.add_argument("--mlock", action="store_true",
                      help="lock the model's mapped pages in memory (with --no-offload; the expert cache reads "
                           "experts as they are needed)")
    more.add_argument("--jinja", action="store_true", help="chat with the model's own Jinja template (always so here)")
    more.add_argument("--color", nargs="?", const="on", choices=("on", "off", "auto"), default="auto",
                      metavar="on|off|auto", help="color the output (accepted; plain text here)")
    p.set_defaults(func=_run)


def _read_text(path: str, what: str) -> tuple[str | None, str | None]:
    """(the file's text, None) or (None, why not)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path}: cannot read the {what}: {e.strerror if isinstance(e, OSError) else 'not UTF-8 text'}"


def _run(args) -> int:
    import hobbitpy
    from hobbitpy import HobbitError
    from hobbitpy.runtime.grammars import checked_grammar
    from hobbitpy.plan.memory import padded_context

    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            return fail(f"two models given ({args.model} and -m {args.model_flag}): give one")
        args.model = args.model_flag
    if args.model is None:
        args.model = default_model()
        if args.model is None:
            return fail("no model given and no default model installed")
    if args.file is not None:
        args.prompt, why = _read_text(args.file, "prompt")
        if why:
            return fail(why)
    if args.prompt == "":
        return fail("--prompt is empty: give the text to continue (or --chat)")
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as surrogates
            return fail(f"--prompt is not valid UTF-8 (at character {e.start}); give it as UTF-8 text")
        if args.escape and args.file is None:  # llama.cpp escapes -p's text, not a file's
            args.prompt = process_escapes(args.prompt)
    for flag, value in (("--batch-size", args.batch_size), ("--ubatch-size", args.ubatch_size)):
        if value is not None and value < 1:
            return fail(f"{flag} must be at least 1, got {value}")
    if why := sampling_error(args):
        return fail(why)
    if args.ctx is not None and args.ctx < 16:
        return fail(f"--ctx-size must be at least 16, got {args.ctx}")
    if args.stats_json and (why := json_target_error(args.stats_json, args.force)):
        return fail(why)
    grammar_text = args.grammar
    if args.grammar_file is not None:
        grammar_text, why = _read_text(args.grammar_file, "grammar")
        if why:
            return fail(why)

    drawn = args.seed is None
    if drawn:  # llama-cpp-python would sample with the same seed every run
        import secrets

        args.seed = secrets.randbits(31)
    try:
        n_ctx = {} if args.ctx is None else {"n_ctx": padded_context(args.ctx)}  # none: the shared default
        if args.ctx is not None and n_ctx["n_ctx"] != args.ctx:
            log.info(f"--ctx-size {args.ctx} rounded up to {n_ctx['n_ctx']}, as llama.cpp pads a context")
        batches = {k: v for k, v in (("n_batch", args.batch_size), ("n_ubatch", args.ubatch_size)) if v is not None}
        offload = offload_config_from_args(args, args.model, auto_profile=True)
        if args.mlock and offload.enabled:
            log.info("--mlock locks the pages of --no-offload's mapped model; the expert cache reads experts as "
                     "they are needed, so nothing is locked")
        llm = hobbitpy.Llama(args.model, offload=offload, **n_ctx, **batches, n_threads=args.threads,
                             verbose=args.verbose, seed=args.seed, n_gpu_layers=gpu_layers(args),
                             flash_attn=args.flash_attn == "on", use_mlock=args.mlock and not offload.enabled)
    except (ValueError, HobbitError) as e:
        return fail(str(e))
    # the hint only where it applies: a MoE whose experts are resident, with no --cache-mb given
    hint = not llm.offloaded and llm.model_info.is_moe and offload.cache_mb is None and offload.enabled
    log.info(llm.offload_plan.reason + ("; --cache-mb N runs the experts through a cache of N MB instead" if hint else ""))

    with llm:
        try:
            grammar = checked_grammar(llm, gbnf=grammar_text, json_schema=args.json_schema)
        except HobbitError as e:
            return fail(f"--grammar{'-file' if args.grammar_file else ''}{' / --json-schema' if args.json_schema else ''}"
                        f": {e}")
        if drawn and args.temperature > 0:  # said once generation is about to start
            log.info(f"sampling seed {args.seed} (--seed {args.seed} repeats this run)")
        if args.chat:
            return _chat(llm, args, grammar)
        return _generate(llm, args, grammar)


def _generate(llm, args, grammar) -> int:
    """--prompt: the completion streamed to stdout (after the prompt, unless --no-echo)."""
    import llama_cpp
    from hobbitpy import HobbitError

    messages = None
    if args.system_prompt is not None:
        messages = [{"role": "system", "content": args.system_prompt}, {"role": "user", "content": args.prompt}]
    try:
        n_prompt = len(llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=True))
    except HobbitError as e:  # a character the vocabulary cannot encode
        return fail(str(e))
    if messages is None and n_prompt >= llm.n_ctx():
        return fail(f"{args.model}: the prompt is {n_prompt} tokens, as long as the context of {llm.n_ctx()} or longer; "
                    "use a larger --ctx-size or a shorter prompt")
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    if not args.no_echo and messages is None:
        sys.stdout.write(args.prompt)
    finish, n_generated = None, 0
    try:
        with CtrlC() as ctrl_c:
            if messages is None:
                chunks = llm.create_completion(args.prompt, stream=True, grammar=grammar,
                                               **_generation_keywords(llm, args))
            else:
                chunks = llm.create_chat_completion(messages, stream=True, grammar=grammar,
                                                    **_generation_keywords(llm, args))
            for chunk in chunks:
                choice = chunk["choices"][0]
                piece = choice["text"] if messages is None else choice["delta"].get("content") or ""
                sys.stdout.write(piece)
                sys.stdout.flush()
                finish = choice.get("finish_reason") or finish
                n_generated += 1
                ctrl_c.check()
            ctrl_c.check()
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
    if finish == "length" and (args.n_predict == -1 or stats["n_prompt_tokens"] + stats["n_tokens"] >= llm.n_ctx()):
        log.info(f"stopped at the end of the context ({llm.n_ctx()} tokens); --ctx-size allows more")
    log.info(_summary(stats))
    if args.stats_json and (why := write_json(args.stats_json, stats, args.force)):
        return fail(why)
    return 0


def _generation_keywords(llm, args) -> dict:
    """create_completion's keywords from the flags: sampling, and --ignore-eos as llama.cpp
    does it (every end-of-generation token biased to -inf)."""
    import llama_cpp

    keywords = sampling_keywords(args)
    if args.ignore_eos:
        vocab = llm._model.vocab
        keywords["logit_bias"] = {t: float("-inf") for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    return keywords


def _summary(stats: dict) -> str:
    """The run in one line: speeds, and what the expert cache did."""
    prompt_s = stats["prefill_ms"] / 1000.0
    line = (f"decode {stats['decode_tok_s'] or 0:.1f} tok/s, prompt "
            f"{stats['n_prompt_tokens'] / prompt_s if prompt_s > 0 else 0:.1f} tok/s")
    if stats["offload"]:
        selections = stats["expert_hits"] + stats["expert_misses"] + stats["expert_inplace"]
        line += (f"; experts: {stats['expert_hits'] / selections if selections else 0:.0%} hits, "
                 f"{stats['bytes_read'] / 2**20:.1f} MB read, cache {stats['budget_bytes'] / 2**20:.1f} MB")
    return line


def _chat(llm, args, grammar) -> int:
    """An interactive chat with history: a line from the user, the reply streamed. Ctrl-C
    stops a reply (what came stays in the history) and returns to the prompt; at the prompt,
    Ctrl-C or Ctrl-D ends the chat, with the run's line (and --stats-json). A message the model
    cannot take (longer than the context, or a character its vocabulary cannot encode) is said
    and left out; a conversation grown longer than the context loses its oldest turns (the
    system message stays), and says so."""
    import llama_cpp
    from hobbitpy import HobbitError
    from hobbitpy.errors import TokenizeError
    from hobbitpy.files.tokens import UNENCODABLE

    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    if args.system_prompt is not None and (said := llm.unencodable(args.system_prompt)):
        return fail(f"{args.model}: --system-prompt: {said}")
    turns = []
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    ended = replies = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt) as e:
            sys.stdout.write("\n")
            ended = 130 if isinstance(e, KeyboardInterrupt) else 0
            break
        if not line.strip():
            continue
        turns.append({"role": "user", "content": line})
        try:
            chunks, first = _reply_within_context(llm, args, grammar, system, turns)
        except KeyboardInterrupt:  # while the conversation was being read: no reply, the message left out
            turns.pop()
            sys.stdout.write("\n")
            log.info("stopped (Ctrl-C at the prompt, or Ctrl-D, ends the chat)")
            continue
        except TokenizeError as e:
            turns.pop()
            if (said := llm.unencodable(line)) is None:  # the template's own text: no message can go
                return fail(f"{args.model}: the chat template's text: {str(e)[str(e).index(UNENCODABLE):]}")
            log.error(f"your message: {said}; it is left out")
            continue
        except HobbitError as e:  # the model's chat template failed, an expert could not be read
            return fail(f"{args.model}: {e}")
        if chunks is None:
            turns.pop()
            log.error(f"this message alone is longer than the context of {llm.n_ctx()} tokens; it is left out (a "
                      "larger --ctx-size takes it)")
            continue
        reply = []
        try:
            with CtrlC() as ctrl_c:
                for chunk in _chain(first, chunks):
                    piece = chunk["choices"][0]["delta"].get("content") or ""
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                    ctrl_c.check()
                ctrl_c.check()
        except KeyboardInterrupt:
            chunks.close()
            log.info("stopped (Ctrl-C at the prompt, or Ctrl-D, ends the chat)")
        except HobbitError as e:
            return fail(f"{args.model}: {e}")
        sys.stdout.write("\n")
        turns.append({"role": "assistant", "content": "".join(reply)})
        replies += 1
    stats = _run_stats(llm, args.model, n_replies=replies) | {"seed": args.seed}
    log.info(_summary(stats))
    if args.stats_json and (why := write_json(args.stats_json, stats, args.force)):
        return fail(why)
    return ended


def _reply_within_context(llm, args, grammar, system, turns):
    """(the reply's chunks, its first chunk), the oldest exchanges dropped until the
    conversation fits the context; (None, None) when the last message alone does not."""
    from hobbitpy.errors import TokenizeError

    while True:
        try:
            chunks = llm.create_chat_completion(system + turns, stream=True, grammar=grammar,
                                                **_generation_keywords(llm, args))
            return chunks, next(chunks, None)  # the prompt is checked against the context here
        except TokenizeError:
            raise
        except ValueError:  # llama_cpp: "Requested tokens (...) exceed context window of ..."
            if len(turns) <= 1:
                return None, None
            del turns[:2]  # the oldest exchange
            log.info(f"the conversation is longer than the context ({llm.n_ctx()} tokens): its oldest turn is dropped")


def _chain(first, rest):
    if first is not None:
        yield first
    yield from rest


def _run_stats(llm, model: str, n_replies: int = 1) -> dict:
    """--stats-json: tokens, times and the expert cache's counters of the run."""
    import llama_cpp

    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    stats = {
        "model": model,
        "offload": llm.offloaded,
        "n_ctx": llm.n_ctx(),
        "n_prompt_tokens": int(perf.n_p_eval),
        # every sampled token but a reply's last is evaluated, one per decode step
        "n_tokens": int(perf.n_eval) + n_replies,
        "prefill_ms": float(perf.t_p_eval_ms),
        "decode_tok_s": (perf.n_eval / perf.t_eval_ms * 1000.0) if perf.t_eval_ms > 0 else None,
        "n_decode_evals": int(perf.n_eval),
    }
    s = llm.offload_stats() if llm.offloaded else None
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
