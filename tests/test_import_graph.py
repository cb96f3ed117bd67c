"""No import circle among the modules of src/ampkit, counting every import the source writes.

The graph is read with ``ast`` at module granularity: module ``a`` imports ``b`` when it imports
``b`` or any name from it, at module level, inside a function, or in an ``if TYPE_CHECKING:``
block (a circle of type-only imports is still a circle of meaning).  ``from pkg import sub``
imports the submodule ``sub`` when it is one, else ``pkg``; a package's ``__init__`` that
re-exports its children imports them.  A circle is reported as its chain of modules.
"""

from __future__ import annotations

from tests.helpers.imports import imports_of, modules


def imports_of_all(module: str) -> frozenset[str]:
    return imports_of(module, type_checking=True)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of ``graph`` with more than one module, as a chain
    ``[a, b, ..., a]`` of imports; sorted, so the report is the same on every run."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(component)
    return sorted(_chain(graph, component) for component in components)


def _chain(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest circle through the first module of ``component`` (breadth first, within it)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return [start, *reversed(chain[:-1]), start] if len(chain) > 1 else [start, v, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


def test_import_graph_reads_type_checking_function_local_and_reexport_imports() -> None:
    # hooks.py imports precision for its Protocol; the engine package's face imports its engine module,
    # the telemetry spec imports the engine only inside TYPE_CHECKING, the engine module imports
    # ``_boundary`` as a submodule of its own package.
    assert "ampkit.precision" in imports_of_all("ampkit.hooks")
    assert "ampkit.engine.engine" in imports_of_all("ampkit.engine")
    assert "ampkit.engine" in imports_of_all("ampkit.telemetry.spec")
    assert "ampkit.engine._boundary" in imports_of_all("ampkit.engine.engine")


def test_import_graph_cycles_are_reported_as_module_chains() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]


def test_import_graph_has_no_cycle() -> None:
    graph = {module: set(imports_of(module, type_checking=True)) for module in modules()}
    cycles = import_cycles(graph)
    assert cycles == [], "import circles (each a chain of imports): " + "; ".join(" -> ".join(c) for c in cycles)
