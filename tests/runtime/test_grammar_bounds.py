"""GBNF's bounds (gbnf.py): what llama.cpp's recursive parser and sampler are given is never
deep enough to overflow their stack, and every grammar up to the bounds still parses and samples."""

from __future__ import annotations

import hobbitpy
from conftest import tiny_model
from hobbitpy.runtime.gbnf import MAX_GRAMMAR_BYTES, MAX_NESTING, MAX_RULES, gbnf_bound_error


def nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def chain(n_rules: int) -> str:
    return "".join(f"r{i} ::= r{i + 1}\n" for i in range(n_rules - 1)).replace("r0 ::=", "root ::=", 1) + \
        f'r{n_rules - 1} ::= "a"\n'


# groups in literals, classes and comments are text; an escaped quote or backslash does not end a literal
TEXT_WITH_PARENTHESES = ' "(((((" [(] "\\"(" "\\\\" '


def test_only_groups_the_parser_reads_count():
    text = "root ::= " + "(" * MAX_NESTING + TEXT_WITH_PARENTHESES + ")" * MAX_NESTING + "\n# ((((((\n"
    assert gbnf_bound_error(text) is None
    assert gbnf_bound_error(text.replace("::=", "::= (", 1).replace("\n#", ")\n#", 1)) == \
        f"the grammar nests groups {MAX_NESTING + 1} deep; at most {MAX_NESTING} are parsed"


def test_the_bounds_refuse_one_past_them():
    assert gbnf_bound_error(nested(MAX_NESTING)) is None
    assert gbnf_bound_error(nested(MAX_NESTING + 1)) == \
        f"the grammar nests groups {MAX_NESTING + 1} deep; at most {MAX_NESTING} are parsed"
    assert gbnf_bound_error(chain(MAX_RULES)) is None
    assert gbnf_bound_error(chain(MAX_RULES + 1)) == \
        f"the grammar defines {MAX_RULES + 1} rules; at most {MAX_RULES} are parsed"
    big = 'root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"'
    assert gbnf_bound_error(big) == f"the grammar is larger than {MAX_GRAMMAR_BYTES >> 20} MB"


def test_grammars_at_the_bounds_parse_and_sample(model_dir):
    # the bounds are below what llama.cpp survives: a grammar right at them is parsed by it and
    # constrains a completion (the text is "a")
    with hobbitpy.Llama(tiny_model(model_dir, "llama"), n_ctx=64, verbose=False) as llm:
        from llama_cpp import LlamaGrammar
        for text in (nested(MAX_NESTING), chain(MAX_RULES)):
            assert llm.grammar_error(text) is None
            out = llm("x", max_tokens=2, temperature=0, grammar=LlamaGrammar.from_string(text, verbose=False))
            assert out["choices"][0]["text"] == "a"
        # llama.cpp reads the text as gbnf_bound_error does: a literal "(((((" and the rest
        assert llm.grammar_error("root ::= " + "(" * MAX_NESTING + TEXT_WITH_PARENTHESES + ")" * MAX_NESTING +
                                 "\n# ((((((\n") is None
