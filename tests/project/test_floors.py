"""The floors of the house (docs/architecture.md): the packages in pipeline order, and no
module imports one of a later floor, not even inside a function. A static rule, read from
the page itself, so the page and the code cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fp4sense

SRC = Path(fp4sense.__file__).parent
PAGE = SRC.parents[1] / "docs" / "architecture.md"


def floors() -> dict[str, int]:
    """name -> floor, from the page's line ``Floors, lowest first: `a, b < c < ...```."""
    line = re.search(r"^Floors, lowest first: `([^`]+)`", PAGE.read_text(), re.MULTILINE)
    assert line, "docs/architecture.md names no floors"
    return {name.strip(): i for i, floor in enumerate(line.group(1).split("<"))
            for name in floor.split(",")}


def _part(module: str) -> str:
    """The floor a dotted module name belongs to: its package, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(root: Path = SRC) -> list[tuple[str, str, int]]:
    """(importing module, imported fp4sense module, line) for every import under
    ``root`` (the fp4sense package folder)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp4sense"):
                targets = ([f"fp4sense.{a.name}" for a in node.names]
                           if node.module == "fp4sense" else [node.module])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("fp4sense.")]
            else:
                continue
            found += [(name, t, node.lineno) for t in targets]
    return found


def test_every_package_and_top_level_module_has_a_floor():
    named = floors()
    parts = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert parts - set(named) == set(), "place these on a floor in docs/architecture.md"
    assert set(named) - parts == set(), "the page names floors the code does not have"


def test_no_module_imports_a_later_floor():
    named = floors()
    named["__init__"] = max(named.values())  # the package root re-exports its version
    named["__version__"] = 0
    climbing = [f"{src}:{line} imports {dst}" for src, dst, line in imports()
                if named[_part(dst)] > named[_part(src)]]
    assert climbing == []


def test_a_climbing_import_would_be_caught(tmp_path):
    """The rule can fail: a stage importing a job inside a function is named."""
    root = tmp_path / "fp4sense"
    (root / "numerics").mkdir(parents=True)
    (root / "numerics" / "probe.py").write_text(
        "from fp4sense.runtime import outputs\n\ndef f():\n"
        "    from fp4sense.jobs import analyze\n")
    named = floors()
    climbing = [(src, dst) for src, dst, _ in imports(root)
                if named[_part(dst)] > named[_part(src)]]
    assert climbing == [("fp4sense.numerics.probe", "fp4sense.jobs")]
