"""The package's modules import one another without a cycle: every import counts, those inside
functions and under TYPE_CHECKING too (an import moved into a function still ties the two
modules together; it only hides the knot from the interpreter)."""

from __future__ import annotations

import ast
import pathlib
import re

import hobbitpy

PACKAGE = pathlib.Path(hobbitpy.__file__).parent

# docs/ARCHITECTURE.md's picture of the package: a module imports from its own layer or below
LAYERS = {
    "binding": ["_native", "_ggml", "errors"],
    "foundations": ["config", "model_file", "gguf_fields", "outputs", "disk", "memory_cgroup", "heap_budget", "devices",
                    "synthetic_moe", "gbnf", "progress", "generation"],
    "files, plans and analysis": ["tokens", "memory", "companions", "prepare", "imatrix", "quants", "inflate",
                                  "profile", "presets", "trace_file", "placement", "shallow_layers", "scores", "likelihood",
                                  "neurons", "simulate", "neuron_sim", "candidate_cost", "trace_plot", "neuron_plot",
                                  "frontier", "bench_report", "supported_models"],
    "runtime": ["llama", "default_ladder", "beam_search", "chat_template", "grammars"],
    "tools that run the model": ["evaluate", "trace", "tune", "calibrate", "bench", "bench_worker", "serve"],
    "commands": ["cli", "cli.*", "__main__"],
}


def _module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package by its dotted name under it ("llama", "cli.run"; a
    package by its own name: "cli")."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names[".".join(parts)] = path
    return names


def _imports_of(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules this one imports, wherever in the file."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "hobbitpy" or (node.module or "").startswith("hobbitpy."):
                target = node.module.removeprefix("hobbitpy").lstrip(".")
            else:
                continue
            candidates = [target] + [f"{target}.{a.name}" if target else a.name for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name.removeprefix("hobbitpy.") for a in node.names if a.name.startswith("hobbitpy.")]
        else:
            continue
        found.update(c for c in candidates if c in modules and c != name)
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
    files = _module_names(PACKAGE)
    edges = {name: _imports_of(name, path, set(files)) for name, path in files.items()}
    assert {"cli.run", "cli.common"} <= edges["cli"] and "bench" in edges["cli.bench"] and edges["llama"], \
        "the walk misses imports: it would pass on anything"
    cycles = _cycles(edges)
    detail = [", ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a] & set(c))) for c in cycles]
    assert not cycles, "import cycles: " + "; ".join(detail)


def test_the_walk_finds_a_cycle_hidden_in_a_function(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from hobbitpy.c import y\n")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "__init__.py").write_text("from . import d\n")
    (tmp_path / "c" / "d.py").write_text("from .. import a\n")
    files = _module_names(tmp_path)
    edges = {name: _imports_of(name, path, set(files)) for name, path in files.items()}
    assert edges == {"a": {"b"}, "b": {"c"}, "c": {"c.d"}, "c.d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c", "c.d"]]


def test_every_module_imports_from_its_own_layer_or_below():
    files = _module_names(PACKAGE)
    layer_of = {}
    for rank, modules in enumerate(LAYERS.values()):
        for name in files:
            if name in modules or any(m.endswith(".*") and name.startswith(m[:-1]) for m in modules):
                layer_of[name] = rank
    assert set(layer_of) == set(files), f"modules in no layer of LAYERS: {sorted(set(files) - set(layer_of))}"
    names = list(LAYERS)
    upward = [f"{a} ({names[layer_of[a]]}) -> {b} ({names[layer_of[b]]})" for a, path in files.items()
              for b in sorted(_imports_of(a, path, set(files))) if layer_of[b] > layer_of[a]]
    assert not upward, "imports up the layers: " + "; ".join(upward)


def test_the_architecture_picture_is_the_table():
    """docs/ARCHITECTURE.md draws LAYERS, the top layer first: each layer's lines name its modules."""
    page = (PACKAGE.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    picture = page[page.index("## The Python package in layers"):page.index("## Where each paper's mechanism lives")]
    rows = {}
    layer = None
    for line in picture.splitlines():
        for name in LAYERS:
            if line.startswith(" " + name):
                layer = name
        if layer is not None and not line.strip().startswith("│"):
            rows.setdefault(layer, "")
            rows[layer] += " " + line
    assert list(rows) == list(reversed(LAYERS))
    for name, modules in LAYERS.items():
        for module in modules:
            shown = module.replace(".*", "/")
            assert re.search(rf"(?<![\w.]){re.escape(shown)}", rows[name]), (name, module)
