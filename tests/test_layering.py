"""The package's layers import one way only, with no import cycles (not even inside functions), and the
integrations and examples use the public API alone.

Layers, bottom to top (docs/DESIGN.md): `errors` / `paths` (shared by all), `kernels`, `store`,
`models`, `engine`, `routing`, `memory`, `adapters`, `bench`, `server`, `cli`, then `kvmemory/__init__.py` (the
public API, which may name anything). A module may import its own layer or the ones below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvmemory"
LAYERS = ["errors", "paths", "kernels", "store", "models", "engine", "routing", "memory", "adapters", "bench", "server",
          "cli"]
RANK = {"errors": 0, "paths": 0, **{name: i for i, name in enumerate(LAYERS) if i >= 2}}
TOP = len(LAYERS)  # kvmemory/__init__.py


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    if parts[1] not in RANK:
        raise AssertionError(f"{module} is in no layer: add it to tests/test_layering.py and docs/DESIGN.md")
    return RANK[parts[1]]


def _resolve(source: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The kvmemory modules an import statement loads (a package and, for `from P import m`, the
    submodule m when it is one)."""
    out = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = source.split(".") if (MODULES[source].name == "__init__.py") else source.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    for name in names:
        if name == "kvmemory" or name.startswith("kvmemory."):
            # the deepest existing module of the dotted name
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                out.append(name)
    return out


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deps = set()
        for node in ast.walk(tree):  # every import, at module level or inside a function
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(d for d in _resolve(name, node) if d != name)
        graph[name] = deps
    return graph


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _rank(name)


def test_lower_layers_never_import_higher_ones():
    bad = []
    for source, deps in _imports().items():
        for dep in deps:
            if dep == "kvmemory" and source.count(".") >= 1 and _rank(source) < TOP:
                bad.append(f"{source} imports the package's public API (kvmemory/__init__.py)")
            elif _rank(dep) > _rank(source):
                bad.append(f"{source} (layer {source.split('.')[1]}) imports {dep}")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _imports()
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# The places that must use kvmemory's public API only (`import kvmemory` / `from kvmemory import ...`).
PUBLIC_ONLY = [ROOT / "integrations", ROOT / "examples"]


@pytest.mark.parametrize("folder", PUBLIC_ONLY, ids=lambda p: p.name)
def test_integrations_and_examples_touch_no_private_module(folder: Path):
    bad = []
    for path in folder.rglob("*.py"):
        if "tests" in path.relative_to(folder).parts or path.name == "conftest.py":
            continue  # tests may check internals
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                if n.startswith("kvmemory."):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {n}")
    assert not bad, "use `from kvmemory import ...` (the public API):\n" + "\n".join(bad)


def test_public_api_names_resolve():
    import kvmemory

    missing = [n for n in kvmemory.__all__ if not hasattr(kvmemory, n)]
    assert not missing, missing
