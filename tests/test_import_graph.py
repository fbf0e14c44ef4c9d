"""The package's import graph (docs/architecture.md): the layers, bottom to top, and the
two rules that keep them: no import cycle among modules, and no arrow from a package to
one in its own or a higher layer.

Every `import` of a `pp_runtime` module counts: at module level, inside a function (a
deferred import is still a dependency) and under `if TYPE_CHECKING:` (a type-only import
still says the lower module knows the upper one). Importing `a.b.c` also imports the
packages `a` and `a.b`, so those count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pp_runtime"

# Bottom to top; a package imports only packages of lower layers (and itself). Packages of
# one layer do not import each other.
LAYERS = (
    ("core",),  # requests, micro-batches, the driver loop, errors: plain data, no torch
    ("config",),  # the Config dataclasses, their checks and loading
    ("costmodel",),  # prices (no torch): stage times, memory, the balanced layer split
    ("planner", "telemetry"),  # what each micro-batch holds; the bubble rule, the timer
    ("parallel",),  # process groups, TP layers, stage-to-stage sends
    ("model",),  # the transformer, attention, KV cache, checkpoint loading
    ("worker",),  # one stage shard
    ("executors",),  # local, Ray, torchrun, sim
    ("engine",),  # the Engine, LLM, simulate: where the planner meets an executor
    ("profile", "serve", "bench"),  # the profiler and calibrator; the server; its load
    ("plan",),  # the deployment search
    ("cli",),  # one module per command
)
LAYER = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    paths = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        # a module's own packages are imported before it: not an edge of its own
        graph[name] = {m for m in imports(path, set(paths))
                       if m != name and not name.startswith(m + ".")}
    return graph


def package(module: str) -> str | None:
    """`pp_runtime.a.b` -> "a"; None for the top-level facade `pp_runtime`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_arrows(graph: dict[str, set[str]], layer: dict[str, int] = LAYER) -> list[str]:
    """Every import of a package in the importer's own layer or above, as "a.m -> b.n"."""
    bad = []
    for m, deps in sorted(graph.items()):
        src = package(m)
        for d in sorted(deps):
            dst = package(d)
            if src is None or dst is None or src == dst:
                continue  # the facade sits above everything; a package may import itself
            if layer[dst] >= layer[src]:
                bad.append(f"{m} -> {d}")
    return bad


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


def test_the_layer_check_finds_an_upward_and_a_sideways_arrow():
    graph = {"pp_runtime.core.batch": {"pp_runtime.config.sections"},  # up
             "pp_runtime.planner.base": {"pp_runtime.telemetry.bubbles"},  # same layer
             "pp_runtime.planner.uniform": {"pp_runtime.costmodel", "pp_runtime.planner.base"}}
    assert upward_arrows(graph) == ["pp_runtime.core.batch -> pp_runtime.config.sections",
                                    "pp_runtime.planner.base -> pp_runtime.telemetry.bubbles"]


def test_type_only_imports_count(tmp_path):
    (tmp_path / "pp_runtime" / "low").mkdir(parents=True)
    (tmp_path / "pp_runtime" / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pp_runtime.high import b\n")
    (tmp_path / "pp_runtime" / "high.py").write_text("")
    assert import_graph(tmp_path / "pp_runtime")["pp_runtime.low.a"] == {"pp_runtime.high"}


def test_every_package_has_a_layer():
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYER), f"place these in LAYERS: {sorted(packages - set(LAYER))}; " \
        f"gone: {sorted(set(LAYER) - packages)}"


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (break them: a layer may only import the ones below it):\n" \
        + "\n".join(" <-> ".join(c) for c in found)


def test_no_package_imports_its_own_layer_or_above():
    bad = upward_arrows(import_graph())
    assert not bad, "imports that point up or sideways (LAYERS):\n" + "\n".join(bad)
