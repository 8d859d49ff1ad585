"""The front door's measures (issue 35): the longest functions in ``src/`` with their
parameter counts, the share of imports inside functions, README.md's length and bench/'s
lines. ``python scripts/code_metrics.py [REPO_ROOT]`` (default: this checkout) prints
JSON, so two checkouts can be compared."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


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
            "bench_lines": bench}


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]) if len(sys.argv) > 1 else
                             Path(__file__).resolve().parents[1]), indent=1))
