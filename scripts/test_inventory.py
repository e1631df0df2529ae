"""What each test module asserts, at two commits side by side: its test functions and its
``assert`` statements and ``pytest.raises`` checks, read from the source with ``ast`` (nothing
is imported or run).

A change that makes the suite faster must not make it weaker; this prints the evidence.

    python scripts/test_inventory.py BEFORE [AFTER]   # AFTER defaults to the work tree
    python scripts/test_inventory.py BEFORE --all     # every module, not only those that differ

Counts are of statements in the source, so a test that moved between modules shows as one
module's loss and another's gain, and a parametrized test counts once.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Module(NamedTuple):
    tests: frozenset[str]
    asserts: int
    raises: int


def _sources(commit: str | None) -> dict[str, str]:
    """Every ``tests/test_*.py`` at ``commit`` (``None``: the work tree)."""
    if commit is None:
        return {str(p.relative_to(ROOT)): p.read_text()
                for p in sorted(ROOT.glob("tests/test_*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "tests/"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{commit}:{name}"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout
            for name in names if Path(name).name.startswith("test_") and name.endswith(".py")}


def inventory(commit: str | None) -> dict[str, Module]:
    result = {}
    for name, source in _sources(commit).items():
        nodes = list(ast.walk(ast.parse(source)))
        result[name] = Module(
            tests=frozenset(n.name for n in nodes
                            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                            and n.name.startswith("test")),
            asserts=sum(isinstance(n, ast.Assert) for n in nodes),
            raises=sum(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "raises"
                       for n in nodes))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", help="a commit; default: the work tree")
    parser.add_argument("--all", action="store_true", help="every module, changed or not")
    args = parser.parse_args()
    before, after = inventory(args.before), inventory(args.after)
    empty = Module(frozenset(), 0, 0)
    print(f"| module | tests | asserts | raises | tests gone | tests new |\n|{' --- |' * 6}")
    for name in sorted(before.keys() | after.keys()):
        b, a = before.get(name, empty), after.get(name, empty)
        if b != a or args.all:
            print(f"| {name} | {len(b.tests)} -> {len(a.tests)} | {b.asserts} -> {a.asserts} "
                  f"| {b.raises} -> {a.raises} | {', '.join(sorted(b.tests - a.tests))} "
                  f"| {', '.join(sorted(a.tests - b.tests))} |")
    total = [sum(len(m.tests) for m in inv.values()) for inv in (before, after)]
    asserts = [sum(m.asserts + m.raises for m in inv.values()) for inv in (before, after)]
    print(f"\n{len(before)} -> {len(after)} modules, {total[0]} -> {total[1]} test functions, "
          f"{asserts[0]} -> {asserts[1]} asserts and raises checks")


if __name__ == "__main__":
    main()
