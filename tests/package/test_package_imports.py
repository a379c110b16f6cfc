"""The package's modules import one another without a cycle: every import counts, those inside
functions and under TYPE_CHECKING too (an import moved into a function still ties the two
modules together; it only hides the knot from the interpreter)."""

from __future__ import annotations

import ast
import pathlib
import re

import hobbitpy

PACKAGE = pathlib.Path(hobbitpy.__file__).parent

# docs/ARCHITECTURE.md's picture of the package: its folders are its layers, the lowest first
# (errors.py, the exceptions users see, under them all; __main__ with cli/). A module imports
# from its own layer or below. Which modules a layer holds is read from its folder.
LAYER_ORDER = ["errors", "binding", "system", "files", "settings", "copies", "plan", "analysis", "runtime", "measure",
               "bench", "cli"]
MAX_TOP_LEVEL_MODULES = 8


def layers() -> dict[str, list[str]]:
    """Each layer's modules by their dotted names under the package, from the folders."""
    found = {name: [] for name in LAYER_ORDER}
    for module in _module_names(PACKAGE):
        head = module.split(".")[0]
        layer = "cli" if module == "__main__" else head
        assert layer in found, f"{module}: a folder (or top-level module) in no layer of LAYER_ORDER"
        found[layer].append(module)
    return found


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
    assert {"cli.run", "cli.common"} <= edges["cli"] and "bench.bench" in edges["cli.bench"] and edges["runtime.llama"], \
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
    layer_of = {module: rank for rank, modules in enumerate(layers().values()) for module in modules}
    assert set(layer_of) == set(files)
    upward = [f"{a} ({LAYER_ORDER[layer_of[a]]}) -> {b} ({LAYER_ORDER[layer_of[b]]})" for a, path in files.items()
              for b in sorted(_imports_of(a, path, set(files))) if layer_of[b] > layer_of[a]]
    assert not upward, "imports up the layers: " + "; ".join(upward)


def test_the_package_is_its_folders():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(LAYER_ORDER[1:]), folders  # every folder a layer, every layer but the base a folder


def test_the_architecture_picture_is_the_table():
    """docs/ARCHITECTURE.md draws the layers, the top one first: each layer's lines name its modules."""
    page = (PACKAGE.parents[1] / "docs" / "ARCHITECTURE.md").read_text()
    picture = page[page.index("## The Python package in layers"):page.index("## Where each paper's mechanism lives")]
    rows = {}
    layer = None
    for line in picture.splitlines():
        for name in LAYER_ORDER:
            if line.startswith(" " + name + " "):
                layer = name
        if layer is not None and not line.strip().startswith("│"):
            rows.setdefault(layer, "")
            rows[layer] += " " + line
    assert list(rows) == list(reversed(LAYER_ORDER))
    for name, modules in layers().items():
        for module in modules:
            if module == name and name != "errors":  # the folder's own __init__
                continue
            shown = "cli/" if module.startswith("cli.") else module.split(".")[-1]
            assert re.search(rf"(?<![\w.]){re.escape(shown)}(?![\w])", rows[name]), (name, module)


def test_only_the_binding_folder_calls_the_native_libraries():
    """libhobbit and ggml are called through binding/'s functions (hobbit.py, ggml.py), which
    own the error buffers and raise what a status means; no other module touches `lib`."""
    callers = []
    for name, path in _module_names(PACKAGE).items():
        if name.startswith("binding"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in ("native", "ggml"):
                callers += [f"{name} imports lib" for a in node.names if a.name == "lib"]
            if isinstance(node, ast.Attribute) and node.attr == "lib" and isinstance(node.value, ast.Name) \
                    and node.value.id in ("native", "ggml", "hobbit"):
                callers.append(f"{name} uses {node.value.id}.lib")
    assert not callers, callers
