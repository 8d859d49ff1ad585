"""The documentation holds together: README.md is a front page (short, the two commands,
links), every relative link in it and in docs/ points at a file that exists, and every
anchor at a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)
README_MAX_LINES = 250


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (duplicates numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{target} (no such heading)")
    assert bad == [], f"{page.name}: {bad}"


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "make demo" in text and "make test" in text
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", text))
    assert linked == {p.name for p in PAGES[1:]}, "every docs page is linked from README"
