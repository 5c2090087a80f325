"""The ``quillcache`` package has no import cycles (Python and Cython modules alike).

The graph is built statically, so an import inside a function counts as much as one at the top:
every ``import`` / ``from ... import`` of a quillcache module in a ``.py`` file (read with ``ast``)
and every ``import`` / ``cimport`` line of a ``.pyx`` / ``.pxd`` file (a ``.pyx`` and its ``.pxd``
are one module). ``from quillcache.x import y`` depends on ``quillcache.x.y`` when ``y`` is a
submodule and on ``quillcache.x`` otherwise; ``import quillcache.a.b`` depends on ``quillcache.a.b``
only, not on the package ``quillcache.a`` that Python also runs first (a package's ``__init__``
re-exporting its submodules must not count as a cycle with them).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "quillcache"
PACKAGE = "quillcache"

# ``from a.b cimport c`` / ``from . import d`` / ``cimport a.b`` / ``import a.b as c, d``
_CY_FROM = re.compile(r"^\s*from\s+(\.*[\w.]*)\s+c?import\s+([\w\s,*]+?)\s*$")
_CY_IMPORT = re.compile(r"^\s*c?import\s+([\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+(?:\s+as\s+\w+)?)*)\s*$")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(root: Path = ROOT) -> dict[str, list[Path]]:
    mods: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".pyx", ".pxd") and "__pycache__" not in path.parts:
            mods.setdefault(module_name(path, root), []).append(path)
    return mods


def _absolute(base: str, level: int, package: str) -> str:
    """The module a (possibly relative) ``from`` names, seen from ``package``."""
    if level == 0:
        return base
    parts = package.split(".")
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([base] if base else []))


def _targets(base: str, names: list[str], known: set[str]) -> set[str]:
    """``from base import names``: submodules where a name is one, else ``base`` itself."""
    out = set()
    for name in names:
        sub = f"{base}.{name}"
        out.add(sub if sub in known else base)
    return out


def imports_of(name: str, paths: list[Path], known: set[str]) -> set[str]:
    is_pkg = any(p.stem == "__init__" for p in paths)
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for path in paths:
        text = path.read_text()
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = _absolute(node.module or "", node.level, package)
                    found |= _targets(base, [a.name for a in node.names], known)
            continue
        for line in _logical_lines(text):
            if m := _CY_FROM.match(line):
                dots = len(m.group(1)) - len(m.group(1).lstrip("."))
                base = _absolute(m.group(1).lstrip("."), dots, package)
                names = [n.split()[0] for n in m.group(2).split(",") if n.strip()]
                found |= _targets(base, names, known)
            elif m := _CY_IMPORT.match(line):
                found.update(part.split()[0] for part in m.group(1).split(","))
    return {t for t in found if (t == PACKAGE or t.startswith(PACKAGE + ".")) and t != name}


def _logical_lines(text: str) -> list[str]:
    """Code lines (comments dropped) with parenthesised and backslash-continued statements joined."""
    out: list[str] = []
    pending = ""
    depth = 0
    for raw in text.splitlines():
        code = raw.split("#", 1)[0].rstrip()
        pending = f"{pending} {code.strip()}" if pending else code
        depth += code.count("(") - code.count(")")
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        if depth > 0 and re.match(r"^\s*(from|c?import)\b", pending):
            continue
        out.append(pending.replace("(", " ").replace(")", " ") if depth == 0 else pending)
        pending, depth = "", 0
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = all_modules(root)
    known = set(mods)
    return {name: {t for t in imports_of(name, paths, known)} for name, paths in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component with a cycle (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[set[str]] = []

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
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, comp) for comp in comps]


def _one_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the smallest name of a strongly connected component (BFS)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(comp)}")


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "quillcache.alloc._alloc" in graph  # the walk saw the package, .pyx included
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# --- the graph builder itself, on a throwaway package --------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / PACKAGE
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_builder_resolves_submodules_relative_and_function_imports(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "from quillcache.a.b import thing\nfrom quillcache.a import c\n",
        "a/b.py": "def f():\n    from .c import g\n    import quillcache.d\n",
        "a/c.py": "from .. import d\nfrom quillcache.a import thing\n",
        "d.py": "import os\nimport numpy\n",
        "e/_x.pyx": ("from quillcache.e._y cimport mix\ncimport quillcache.d\nfrom libc.stdint cimport uint64_t\n"
                     "from quillcache.f import (\n    Err,  # a comment\n    g,\n)\nimport os, \\\n  quillcache.h\n"),
        "e/_x.pxd": "from quillcache.a cimport b, c  # comment\n",
        "e/_y.pxd": "cdef inline int mix(int x): return x\n",
        "f/__init__.py": "", "f/g.py": "", "h.py": "",
        "e/__init__.py": "",
    })
    g = import_graph(pkg)
    assert g["quillcache.a"] == {"quillcache.a.b", "quillcache.a.c"}
    assert g["quillcache.a.b"] == {"quillcache.a.c", "quillcache.d"}  # inside a function still counts
    assert g["quillcache.a.c"] == {"quillcache.d", "quillcache.a"}  # 'thing' is not a module: the package
    assert g["quillcache.d"] == set()  # third-party imports ignored
    assert g["quillcache.e._x"] == {"quillcache.e._y", "quillcache.d", "quillcache.a.b", "quillcache.a.c",
                                    "quillcache.f", "quillcache.f.g", "quillcache.h"}
    assert find_cycles(g) == [["quillcache.a", "quillcache.a.c", "quillcache.a"]]


def test_parent_package_is_not_a_dependency(tmp_path):
    pkg = _write(tmp_path, {"__init__.py": "", "p/__init__.py": "from quillcache.p.q import x\n",
                            "p/q.py": "import quillcache.p.r\n", "p/r.py": ""})
    g = import_graph(pkg)
    assert g["quillcache.p.q"] == {"quillcache.p.r"} and find_cycles(g) == []


@pytest.mark.parametrize("n", [2, 3, 5])
def test_cycles_of_any_length_are_reported(tmp_path, n):
    files = {"__init__.py": ""}
    for i in range(n):
        files[f"m{i}.py"] = f"import quillcache.m{(i + 1) % n}\n"
    g = import_graph(_write(tmp_path, files))
    cycles = find_cycles(g)
    assert len(cycles) == 1 and len(cycles[0]) == n + 1 and cycles[0][0] == cycles[0][-1] == "quillcache.m0"
