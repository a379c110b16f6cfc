"""Grammars that constrain sampling (GBNF, or a JSON schema turned into one by
llama-cpp-python), checked by llama.cpp's own parser before any sampler uses them."""

from __future__ import annotations

from .errors import HobbitError
from .llama import Llama


def grammar_error(llm: Llama, grammar: str) -> str | None:
    """Why llama.cpp cannot parse a GBNF grammar (None: it can). Its sampler is made and freed
    here, before the request's own: llama-cpp-python uses the sampler llama.cpp returns for a
    bad grammar (none) and the process dies (SIGSEGV)."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8", "replace"), b"root")
    if not sampler:
        return "the grammar does not parse (GBNF, with a root rule; llama.cpp's log says where)"
    llama_cpp.llama_sampler_free(sampler)
    return None


def checked_grammar(llm: Llama, *, gbnf: str | None = None, json_schema: str | None = None):
    """A LlamaGrammar of GBNF text or of a JSON schema (text), or None when neither is given;
    HobbitError saying what is wrong when llama.cpp would not parse it."""
    from llama_cpp import LlamaGrammar
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if json_schema is not None:
        try:
            gbnf = json_schema_to_gbnf(json_schema)
        except (ValueError, TypeError, KeyError, RecursionError) as e:  # not JSON, or a schema it cannot turn
            raise HobbitError(f"the JSON schema cannot be turned into a grammar: {e}") from None
    if gbnf is None:
        return None
    if why := grammar_error(llm, gbnf):
        raise HobbitError(why)
    return LlamaGrammar.from_string(gbnf, verbose=False)
