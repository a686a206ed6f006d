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


#: The packages whose every import inside a function must say why it is not at the module's top.
REASONED = ("a2ats_ref", "a2ats_spec", "a2ats_conformance")
DEFERRED_MARK = "# deferred:"


def deferred_without_reason(folders, root: Path = ROOT) -> list[str]:
    """'path:line: import' for each import inside a function that carries no ``# deferred: <reason>`` comment, on
    its own line or on a comment line directly above the run of imports it belongs to."""
    bad = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            src = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(src), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for sub in ast.walk(node):
                    if not isinstance(sub, (ast.Import, ast.ImportFrom)):
                        continue
                    i = sub.lineno - 1
                    while DEFERRED_MARK not in src[i] and i > 0 and src[i - 1].strip().startswith(("import ", "from ")):
                        i -= 1
                    if DEFERRED_MARK not in src[i] and not (i > 0 and src[i - 1].strip().startswith(DEFERRED_MARK)):
                        bad.append(f"{path.relative_to(root)}:{sub.lineno}: {src[sub.lineno - 1].strip()}")
    return bad


def test_every_deferred_import_says_why():
    """An import inside a function hides a cycle or a cost from a reader; each one states which (a CUDA-only module,
    an optional extra, a CLI's --help that must not load MLX, a cycle), or moves to the module's top."""
    assert deferred_without_reason(PACKAGES[p] for p in REASONED) == []


def test_the_deferred_import_check_sees_an_unreasoned_import(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    import json\n    return json\n\n\n"
                                   "def g():\n    import os  # deferred: a reason\n    return os\n\n\n"
                                   "def h():\n    # deferred: a reason for the run\n    import os\n    import sys\n"
                                   "    return os, sys\n")
    assert deferred_without_reason([tmp_path], tmp_path) == ["m.py:2: import json"]
