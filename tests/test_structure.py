"""The package's shape: no import cycles, and no module reaching into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "trainaccel"


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (each holds at least one cycle), by Tarjan's method."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]  # iterative: no recursion limit on a deep graph
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(edges[child])))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return groups


def test_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert import_cycles(graph) == [["p.a", "p.b"]]


def test_no_import_cycles() -> None:
    # Imports inside functions count too: a deferred import still ties the two modules together.
    # Imports only for type checking do not run, so they tie nothing together.
    graph = grimp.build_graph("trainaccel", cache_dir=None, exclude_type_checking_imports=True)
    assert import_cycles(graph) == []


def test_comm_imports_no_feature_above_it() -> None:
    # comm/ communicates; zero_code.py composes it with AMP, metrics and compile. From monitor/ it takes the
    # timeline (the hook's spans) and the step watcher that register()'s straggler_every and timeline options need.
    graph = grimp.build_graph("trainaccel", cache_dir=None, exclude_type_checking_imports=True)
    above = ("trainaccel.zero_code", "trainaccel.runtime", "trainaccel.compiler", "trainaccel.amp")
    monitors = {"trainaccel.monitor.timeline", "trainaccel.monitor.ddp"}
    found = []
    for module in sorted(m for m in graph.modules if m.split(".")[:2] == ["trainaccel", "comm"]):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported.startswith(tuple(f"{name}." for name in above)) or imported in above:
                found.append(f"{module} -> {imported}")
            elif imported.startswith("trainaccel.monitor") and imported not in monitors:
                found.append(f"{module} -> {imported}")
    assert found == []


def private_imports(path: Path) -> list[str]:
    """`from trainaccel.x import _name` in `path`: a private name of another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainaccel"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_no_private_imports_across_modules() -> None:
    files = (
        sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    )
    assert [hit for path in files for hit in private_imports(path)] == []
