"""The package's modules import one another without a cycle: every import counts, those inside
functions and under TYPE_CHECKING too (an import moved into a function still ties the two
modules together; it only hides the knot from the interpreter)."""

from __future__ import annotations

import ast
import pathlib

import hobbitpy

PACKAGE = pathlib.Path(hobbitpy.__file__).parent


def _imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules this file imports, wherever in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("hobbitpy"):
                continue
            module = (node.module or "").removeprefix("hobbitpy").lstrip(".")
            names = [module.split(".")[0]] if module else [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".")[1] for alias in node.names if alias.name.startswith("hobbitpy.")]
        else:
            continue
        found.update(n for n in names if n in modules and n != path.stem)
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    files = {p.stem: p for p in PACKAGE.glob("*.py")}
    edges = {name: _imports_of(path, set(files)) for name, path in files.items()}
    assert edges["cli"] and edges["llama"], "the walk found no imports: it would pass on anything"
    cycles = _cycles(edges)
    detail = [", ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a] & set(c))) for c in cycles]
    assert not cycles, "import cycles: " + "; ".join(detail)


def test_the_walk_finds_a_cycle_hidden_in_a_function(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from hobbitpy.a import y\n")
    edges = {p.stem: _imports_of(p, {"a", "b"}) for p in tmp_path.glob("*.py")}
    assert _cycles(edges) == [["a", "b"]]
