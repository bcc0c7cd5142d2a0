"""No import cycle between peagle's packages, counting the imports inside functions.

A function-local import is still a dependency: it only moves the failure from import time to call time,
so a cycle hidden that way is a cycle. Every `import` / `from ... import` node of every module under
peagle/ (anywhere in the tree: module level, functions, `TYPE_CHECKING` blocks) is an edge between the
package-level nodes: `peagle.data`, `peagle.target`, `peagle.train`, ... for subpackages, `peagle.pipeline`,
`peagle.builtin`, ... for the top-level modules, and `peagle` for the lazy public facade (`peagle/__init__.py`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "peagle"


def _node_of(module: str) -> str | None:
    """The package-level node of dotted `module` (None outside peagle): `peagle.data.prompts` -> `peagle.data`."""
    parts = module.split(".")
    if parts[0] != "peagle":
        return None
    if len(parts) == 1:
        return "peagle"
    return f"peagle.{parts[1]}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path) -> set[tuple[str, int]]:
    """(dotted name, line) of what every Import/ImportFrom node of the module at `path` reaches (relative
    ones resolved; `from peagle import builtin` names `peagle.builtin`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if module == "peagle":  # `from peagle import builtin` is the module; a facade name is the facade
                for alias in node.names:
                    sub = PACKAGE / alias.name
                    is_module = sub.is_dir() or sub.with_suffix(".py").is_file()
                    out.add((f"peagle.{alias.name}" if is_module else "peagle", node.lineno))
            else:
                out.add((module, node.lineno))
    return out


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(node, other node it imports) -> the `path:line` of every import that makes the edge."""
    where: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _node_of(_module_name(path))
        assert src is not None
        for name, line in sorted(_imported(path)):
            dst = _node_of(name)
            if dst is not None and dst != src:
                where.setdefault((src, dst), []).append(f"{path.relative_to(ROOT).as_posix()}:{line}")
    return where


def package_graph() -> dict[str, set[str]]:
    """Node -> the other nodes it imports, over every module under peagle/."""
    graph: dict[str, set[str]] = {_node_of(_module_name(p)) or "": set() for p in PACKAGE.rglob("*.py")}
    for src, dst in package_imports():
        graph[src].add(dst)
    return graph


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan): the nodes that sit on a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: set[str] = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component of more than one node."""
    cycles = []
    for comp in components(graph):
        start = min(comp)
        # breadth-first from start back to start inside the component: the shortest cycle through it
        paths = {start: [start]}
        frontier = [start]
        cycle: list[str] | None = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, set()) & comp):
                    if w == start:
                        cycle = [*paths[v], start]
                        break
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle or sorted(comp))
    return cycles


def test_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_every_package() -> None:
    graph = package_graph()
    assert "peagle.spec" in graph and "peagle.data" in graph
    assert "peagle.spec" in graph["peagle.data"]  # the data package reads the spec


def test_no_import_cycle_between_peagle_packages() -> None:
    where = package_imports()
    graph = package_graph()
    lines = []
    for cycle, comp in zip(find_cycles(graph), components(graph), strict=True):
        lines.append(" -> ".join(cycle) + "; every import among " + ", ".join(sorted(comp)) + ":")
        lines += [f"    {a} -> {b}: {', '.join(where[a, b])}" for a, b in sorted(where) if a in comp and b in comp]
    assert not lines, "import cycles between peagle packages (function-local imports count):\n" + "\n".join(lines)
