"""Bounds on GBNF text that keep llama.cpp's grammar code on its stack.

llama.cpp parses a grammar by recursive descent (one pair of frames per nested group) and, when
it checks for left recursion and when the sampler advances, follows rule references recursively
(one frame per rule in a chain). Neither recursion has a limit: 20,000 nested groups (a 40 KB
request) or a chain of 100,000 rules overflow the stack and kill the process without a line.
The text is measured here, before llama.cpp sees it. The limits are far above any grammar a
person or llama-cpp-python's JSON-schema converter writes (tens of levels, hundreds of rules)
and far below what overflows a thread's stack (10,000 levels and 50,000 chained rules pass)."""

from __future__ import annotations

MAX_GRAMMAR_BYTES = 1 << 20
MAX_NESTING = 1000  # groups in groups: ( ( ( ... ) ) )
MAX_RULES = 5000    # rule definitions (name ::= ...): bounds the longest chain of references


def gbnf_bound_error(text: str) -> str | None:
    """What makes GBNF text too big or too deep for llama.cpp to parse safely (None: nothing).
    Counts groups and rule definitions outside string literals, character classes and
    comments, as llama.cpp's parser reads them."""
    if len(text.encode("utf-8", "replace")) > MAX_GRAMMAR_BYTES:
        return f"the grammar is larger than {MAX_GRAMMAR_BYTES >> 20} MB"
    depth = deepest = rules = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":  # a comment, to the end of the line
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c in "\"[":  # a literal or a character class: brackets inside are text, \ escapes one
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth = max(0, depth - 1)
        elif text.startswith("::=", i):
            rules += 1
            i += 2
        i += 1
    if deepest > MAX_NESTING:
        return f"the grammar nests groups {deepest} deep; at most {MAX_NESTING} are parsed"
    if rules > MAX_RULES:
        return f"the grammar defines {rules} rules; at most {MAX_RULES} are parsed"
    return None
