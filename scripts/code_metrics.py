"""The front door's measures (issue 35): the longest functions in ``src/`` with their
parameter counts, the share of imports inside functions, README.md's length and bench/'s
lines; and the import graph between packages (issue 53): the arrows that climb the floors
(the order docs/architecture.md writes; for a checkout older than that line, today's
order) and the groups of packages that import each other in a circle.
``python scripts/code_metrics.py [REPO_ROOT]`` (default: this checkout) prints
JSON, so two checkouts can be compared."""

from __future__ import annotations

import ast
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

#: the floors when a checkout's docs/architecture.md does not write them
FLOORS = ("validate, defaults, options < runtime < numerics < structure < inputs < diagnosis "
          "< planning < quantization < checkpoint < evaluation < reports < publishing < jobs "
          "< api, cli, __main__")


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    return sum(n.arg not in ("self", "cls") for n in names) + bool(a.vararg) + bool(a.kwarg)


def measure(root: Path) -> dict:
    longest, local, total = [], 0, 0
    for path in sorted((root / "src").rglob("*.py")):
        tree = ast.parse(path.read_text())
        inside = set()
        for fn in _functions(tree):
            longest.append((fn.end_lineno - fn.lineno + 1, _params(fn),
                            f"{path.relative_to(root / 'src')}:{fn.name}"))
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                    continue
                total += 1
                local += id(node) in inside
    longest.sort(reverse=True)
    bench = sum(len(p.read_text().splitlines()) for p in (root / "bench").rglob("*.py"))
    return {"longest_functions": [{"lines": n, "parameters": k, "function": name}
                                  for n, k, name in longest[:5]],
            "function_local_imports": local, "imports": total,
            "function_local_share": round(local / total, 3),
            "readme_lines": len((root / "README.md").read_text().splitlines()),
            "bench_lines": bench, **import_graph(root)}


def import_graph(root: Path) -> dict:
    """Package -> package imports of ``src/fp4sense`` (inside functions too): those that
    climb the floors, and the strongly connected groups of more than one package."""
    page = root / "docs" / "architecture.md"
    found = re.search(r"^Floors, lowest first: `([^`]+)`", page.read_text(), re.MULTILINE)
    order = found.group(1) if found else FLOORS
    floor = {n.strip(): i for i, f in enumerate(order.split("<")) for n in f.split(",")}
    floor["__init__"] = len(floor)
    edges: dict[str, set[str]] = defaultdict(set)
    src = root / "src" / "fp4sense"
    for path in src.rglob("*.py"):
        here = path.relative_to(src).parts
        part = here[0] if len(here) > 1 else path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp4sense"):
                names = ([f"fp4sense.{a.name}" for a in node.names]
                         if node.module == "fp4sense" else [node.module])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("fp4sense.")]
            else:
                continue
            for name in names:
                target = name.split(".")[1] if "." in name else "__init__"
                if target != part and target != "__version__":
                    edges[part].add(target)
    climbing = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs
                      if floor.get(b, -1) > floor.get(a, len(floor)))
    return {"climbing_arrows": climbing, "circles": _circles(edges)}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one package."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]) if len(sys.argv) > 1 else
                             Path(__file__).resolve().parents[1]), indent=1))
