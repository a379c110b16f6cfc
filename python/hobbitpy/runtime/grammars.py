"""Grammars that constrain sampling (GBNF, or a JSON schema turned into one by
llama-cpp-python), checked (Llama.grammar_error) before any sampler uses them."""

from __future__ import annotations

from ..errors import HobbitError
from .llama import Llama


def json_schema_grammar(json_schema: str) -> str:
    """The GBNF of a JSON schema (text), as llama-cpp-python turns it; HobbitError saying why
    where it cannot (where a chat's response_format has such a schema, llama-cpp-python would
    constrain to any JSON instead, saying nothing)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return json_schema_to_gbnf(json_schema)
    # not JSON, or a schema the converter cannot turn: it says so by ValueError, or by an
    # assert ("Unrecognized schema", "Rule ... not known")
    except (ValueError, TypeError, KeyError, RecursionError, AssertionError) as e:
        raise HobbitError(f"the JSON schema cannot be turned into a grammar: {e}") from None


def checked_grammar(llm: Llama, *, gbnf: str | None = None, json_schema: str | None = None):
    """A LlamaGrammar of GBNF text or of a JSON schema (text), or None when neither is given;
    HobbitError saying what is wrong when llama.cpp would not parse it."""
    from llama_cpp import LlamaGrammar

    if json_schema is not None:
        gbnf = json_schema_grammar(json_schema)
    if gbnf is None:
        return None
    if why := llm.grammar_error(gbnf):
        raise HobbitError(why)
    return LlamaGrammar.from_string(gbnf, verbose=False)
