"""The package's import graph, read from the AST (no vLLM import, no module executed).

Every ``import`` counts: module level and inside functions, except those under
``if TYPE_CHECKING:``. Checks: no import cycles; nothing under ``integration/`` reaches
``bench``; the vLLM-free core packages never reach ``vllm``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "vllm_anisotropic"
ROOT = Path(__file__).resolve().parent.parent / PKG

# Packages that must run without vLLM installed (and without reaching it through us).
CORE = ("tree", "proposers", "verifiers", "allocator", "selector", "kernels", "attention")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Yield Import / ImportFrom nodes, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def build_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, external top-level names each module imports)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, set[str]] = {m: set() for m in modules}

    def add(src: str, target: str) -> None:
        if target.split(".")[0] != PKG:
            external[src].add(target.split(".")[0])
            return
        # The longest prefix that is one of our modules (``pkg.mod.attr`` -> ``pkg.mod``).
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != src:
            edges[src].add(target)

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(mod, alias.name)
                continue
            if node.level:
                base = mod.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                # ``from pkg import submodule`` imports the submodule; any other name, ``pkg``
                sub = f"{target}.{alias.name}"
                add(mod, sub if sub in modules else target)
    return edges, external


EDGES, EXTERNAL = build_graph()


def _reach(start: str) -> dict[str, str | None]:
    """Every module ``start`` imports, transitively, with the module that imported it."""
    parent: dict[str, str | None] = {start: None}
    stack = [start]
    while stack:
        m = stack.pop()
        for n in sorted(EDGES[m]):
            if n not in parent:
                parent[n] = m
                stack.append(n)
    return parent


def _chain(parent: dict[str, str | None], end: str) -> str:
    path = [end]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])
    return " -> ".join(reversed(path))


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(EDGES[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    return out


def test_graph_is_read():
    # Guards the test itself: a broken parser would make every check below pass vacuously.
    assert len(EDGES) > 50
    assert f"{PKG}.tree" in EDGES[f"{PKG}.verifiers.base"] or any(
        f"{PKG}.tree" in _reach(m) for m in EDGES if m.startswith(f"{PKG}.verifiers")
    )
    assert any("vllm" in EXTERNAL[m] for m in EDGES if m.startswith(f"{PKG}.integration"))


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_integration_never_imports_bench():
    bad = []
    for m in sorted(EDGES):
        if not m.startswith(f"{PKG}.integration"):
            continue
        parent = _reach(m)
        for n in sorted(parent):
            if n == f"{PKG}.bench" or n.startswith(f"{PKG}.bench."):
                bad.append(_chain(parent, n))
                break
    assert not bad, "integration/ reaches bench/:\n" + "\n".join(bad)


def test_core_never_imports_vllm():
    """Nor the layers above it (``integration``, ``bench``), which would bring vLLM in later."""
    above = (f"{PKG}.integration", f"{PKG}.bench")
    bad = []
    for m in sorted(EDGES):
        rel = m[len(PKG) + 1 :]
        if rel.split(".")[0] not in CORE:
            continue
        parent = _reach(m)
        for n in sorted(parent):
            if "vllm" in EXTERNAL[n]:
                bad.append(_chain(parent, n) + " -> vllm")
                break
            if n in above or n.startswith(tuple(a + "." for a in above)):
                bad.append(_chain(parent, n))
                break
    assert not bad, "core package reaches vllm (or integration/, bench/):\n" + "\n".join(bad)
