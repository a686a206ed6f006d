"""The package's layering: imports run one way, counting imports inside functions.

The graph is read from the source (every ``import`` and ``from ... import`` anywhere in a module, deferred ones
included), so a cycle hidden by an import inside a function is still a cycle. The equation modules at the top of
a2ats_ref/ are the bottom layer: nothing there may import the runtime, calibration or bench subpackages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"a2ats_ref": ROOT / "a2ats_ref", "a2ats_spec": ROOT / "spec", "a2ats_conformance": ROOT / "conformance"}
UPPER = ("a2ats_ref.runtime", "a2ats_ref.calibration", "a2ats_ref.bench", "a2ats_ref.files")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [pkg, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _known(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its source)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(filter(None, (_known(a.name, mods) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    hit = _known(f"{base}.{a.name}", mods) if f"{base}.{a.name}" in mods else _known(base, mods)
                    if hit:
                        out.add(hit)
        out.discard(mod)
        graph[mod] = out
    return graph


def cycles(graph, within: str = "") -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), restricted to names under ``within``."""
    nodes = {m for m in graph if m.startswith(within)}
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_deferred_imports():
    graph = import_graph()
    # dispatch imports the CUDA kernels' module at the top; selfcheck does so too: both must be seen
    assert "a2ats_ref.runtime.decode.cuda" in graph["a2ats_ref.runtime.decode.dispatch"]
    assert "a2ats_ref.runtime.decode.portable" in graph["a2ats_ref.runtime.decode.selfcheck"]
    # and a cycle made only by a function-level import is found
    toy = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycles(toy) == [["a", "b"]]


def test_a2ats_ref_has_no_import_cycle():
    assert cycles(import_graph(), "a2ats_ref") == []


def test_equation_modules_import_nothing_above_them():
    graph = import_graph()
    bottom = [m for m in graph if m.startswith("a2ats_ref.") and not m.startswith(UPPER)]
    up = {m: sorted(t for t in graph[m] if t.startswith(UPPER)) for m in bottom}
    assert {m: t for m, t in up.items() if t} == {}


def test_the_reference_never_imports_the_suite():
    graph = import_graph()
    assert {m: sorted(t for t in ts if t.startswith("a2ats_conformance"))
            for m, ts in graph.items() if m.startswith(("a2ats_ref", "a2ats_spec"))
            and any(t.startswith("a2ats_conformance") for t in ts)} == {}


def test_spec_and_suite_have_no_import_cycle():
    graph = import_graph()
    assert cycles(graph, "a2ats_spec") + cycles(graph, "a2ats_conformance") == []


def test_moved_module_paths_still_import_with_a_warning():
    import importlib
    import sys
    import warnings

    from a2ats_conformance import _moved as suite_moved
    from a2ats_ref import _moved

    for old, new in {**_moved.MOVED, **suite_moved.MOVED}.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mod = importlib.import_module(old)
        assert mod is importlib.import_module(new), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in seen), old


def test_public_api_from_the_package_top():
    import a2ats_ref
    from a2ats_ref import (A2ATSConfig, Codebook, enable_a2ats, load_a2ats_cache,  # noqa: F401
                           make_a2ats_cache, save_a2ats_cache)
    assert set(a2ats_ref._PUBLIC) <= set(a2ats_ref.__all__)
    assert A2ATSConfig.__module__ == "a2ats_ref.runtime.cache"
