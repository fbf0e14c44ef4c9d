"""The package's import graph (docs/architecture.md): no cycle, and the layers point one way.

Every `import` of a `pp_runtime` module counts, at module level or inside a function (a
deferred import is still a dependency), except those under `if TYPE_CHECKING:`. Importing
`a.b.c` also imports the packages `a` and `a.b`, so those count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pp_runtime"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "pp_runtime":
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pp_runtime"}
    with_parents = set()
    for name in found:
        parts = name.split(".")
        with_parents |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in with_parents if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        # a module's own packages are imported before it: not an edge of its own
        graph[name] = {m for m in imports(path, set(paths))
                       if m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (break them: a layer may only import the ones below it):\n" \
        + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("layer, may_import", [
    ("pp_runtime.core", ("pp_runtime.core",)),  # the data path: imports nothing above it
    ("pp_runtime.config", ("pp_runtime.core", "pp_runtime.config", "pp_runtime.costmodel")),
    ("pp_runtime.planner", ("pp_runtime.core", "pp_runtime.config", "pp_runtime.costmodel",
                            "pp_runtime.planner")),  # prices micro-batches with the cost model
])
def test_lower_layers_do_not_import_upper_ones(layer, may_import):
    graph = import_graph()
    bad = {(m, d) for m, deps in graph.items() if m == layer or m.startswith(layer + ".")
           for d in deps if d != "pp_runtime" and not d.startswith(may_import)}
    assert not bad, f"{layer} imports above its layer: {sorted(bad)}"


def test_only_the_command_line_imports_it():
    graph = import_graph()
    bad = {(m, d) for m, deps in graph.items() if not m.startswith("pp_runtime.cli")
           for d in deps if d.startswith("pp_runtime.cli")}
    assert not bad, f"the command line is the top layer; imported by {sorted(bad)}"
