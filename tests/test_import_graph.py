"""No import cycle among semkv's and the vLLM adapter's modules; the core never imports vLLM.

The graph is read from the source (``ast``), not from an import: every ``import`` and
``from ... import`` that can run counts, at module level and inside functions alike (a lazy
import still ties the two modules together). Imports under ``if TYPE_CHECKING:`` never run and
are left out of the cycle check (as grimp's ``exclude_type_checking_imports``: a type-only back
reference is the usual way to annotate without a cycle), but not out of the core's check.
``from a import b`` is an edge to ``a.b`` where that is a module, else to ``a`` (the package's
``__init__``). The implicit import of a module's parent packages is not an edge (it would make
every package a cycle with its children). The vLLM adapter is held to more: no cycle even
through a type-only import (its helpers are handed what they need, issue #69).

The core distribution (``semkv.*``) may not import the adapter (``semkv_vllm``) nor vLLM:
driving an engine is the adapter's job (``semkv_vllm.bench``), and the design keeps vLLM out of
the core. The first tests check the checker itself on a made-up package, so the real check is
seen able to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"semkv": ROOT / "semkv", "semkv_vllm": ROOT / "adapters" / "vllm" / "semkv_vllm"}
FORBIDDEN_IN_CORE = ("semkv_vllm", "vllm")


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under each package folder."""
    found: dict[str, Path] = {}
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(module: str, path: Path) -> tuple[set[str], set[str]]:
    """(names ``module`` imports at run time, names imported under ``TYPE_CHECKING`` only),
    absolute, relative imports resolved."""
    runtime: set[str] = set()
    typing_only: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, names: set[str]) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                visit(child, typing_only)
            for child in node.orelse:
                visit(child, names)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `a.b` where it is a module, else `a` (see graph: the longest known prefix)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(ast.parse(path.read_text(), str(path)), runtime)
    return runtime, typing_only


def graph(packages: dict[str, Path], *, type_checking: bool = False,
          ) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(run-time edges among the packages' own modules, every imported name per module);
    ``type_checking``: imports under ``TYPE_CHECKING`` are edges too."""
    known = modules(packages)
    edges: dict[str, set[str]] = {m: set() for m in known}
    raw: dict[str, set[str]] = {}
    for module, path in known.items():
        runtime, typing_only = _imported(module, path)
        raw[module] = runtime | typing_only
        for name in runtime | typing_only if type_checking else runtime:
            target = name
            while target and target not in known:  # `from a import b` where b is not a module
                target = target.rpartition(".")[0]
            if target and target != module:
                edges[module].add(target)
    return edges, raw


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def core_violations(raw: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((module, name) for module, names in raw.items()
                  if module.split(".")[0] == "semkv" for name in names
                  if name.split(".")[0] in FORBIDDEN_IN_CORE)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_check_sees_a_lazy_cycle_and_a_core_importing_vllm(tmp_path: Path) -> None:
    _write(tmp_path, {
        "semkv/__init__.py": "",
        "semkv/a.py": "from semkv.b import thing\n",
        "semkv/b.py": "def f():\n    from semkv import a\n",  # lazy, and via `from pkg import`
        "semkv/c.py": "import typing\nif typing.TYPE_CHECKING:\n    import vllm.config\n",
        "semkv/d.py": "from semkv_vllm.bench import run_bench\n",
        # a type-only back reference is no cycle
        "semkv/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import semkv.f\n",
        "semkv/f.py": "import semkv.e\n",
    })
    edges, raw = graph({"semkv": tmp_path / "semkv"})
    assert cycles(edges) == [["semkv.a", "semkv.b"]]
    assert core_violations(raw) == [("semkv.c", "vllm.config"),
                                    ("semkv.d", "semkv_vllm.bench.run_bench")]


def test_the_check_resolves_relative_imports_and_passes_a_tree(tmp_path: Path) -> None:
    _write(tmp_path, {"p/__init__.py": "from p.x import y\n", "p/x.py": "from . import z\n",
                      "p/z.py": "from .sub import w\n", "p/sub/__init__.py": "",
                      "p/sub/w.py": "from ..z import q\n"})
    edges, _ = graph({"p": tmp_path / "p"})
    assert edges["p"] == {"p.x"} and edges["p.x"] == {"p.z"} and edges["p.sub.w"] == {"p.z"}
    assert cycles(edges) == [["p.sub.w", "p.z"]]


def test_no_import_cycle_among_semkv_and_semkv_vllm_modules() -> None:
    edges, _ = graph(PACKAGES)
    assert "semkv_vllm.bench.engine" in edges and "semkv.bench.config" in edges
    assert cycles(edges) == []


# The adapter's helpers are handed what they need, not the object that drives them (issue #69):
# no cycle even through a type-only import.


def test_the_check_sees_a_type_only_cycle_when_asked(tmp_path: Path) -> None:
    _write(tmp_path, {
        "q/__init__.py": "",
        "q/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import q.f\n",
        "q/f.py": "import q.e\n",
    })
    assert cycles(graph({"q": tmp_path / "q"})[0]) == []
    assert cycles(graph({"q": tmp_path / "q"}, type_checking=True)[0]) == [["q.e", "q.f"]]


def test_no_cycle_in_the_adapter_even_through_type_only_imports() -> None:
    edges, _ = graph({"semkv_vllm": PACKAGES["semkv_vllm"]}, type_checking=True)
    assert cycles(edges) == []


def test_the_core_imports_neither_the_adapter_nor_vllm() -> None:
    _, raw = graph(PACKAGES)
    assert core_violations(raw) == []
