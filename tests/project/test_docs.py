"""The documentation holds together: README.md is a front page (short, the two commands,
links), every relative link in it and in docs/ points at a file that exists, and every
anchor at a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RELEASE_PAGES = [ROOT / "CHANGELOG.md", *sorted((ROOT / "docs" / "releases").glob("*.md"))]
#: lines [Unreleased] may hold: entries of a line or two, the detail in docs/ and bench/
UNRELEASED_MAX_LINES = 60
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


@pytest.mark.parametrize("page", PAGES + RELEASE_PAGES,
                         ids=lambda p: p.relative_to(ROOT).as_posix())
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


def test_the_changelog_names_this_version_and_stays_short():
    """CHANGELOG.md: the newest release is the package's version, it links its detailed
    notes, and [Unreleased] stays a list of short entries."""
    from fp4sense import __version__

    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, re.M)
    assert releases and releases[0] == __version__, (releases[:1], __version__)
    unreleased = text.split("## [Unreleased]", 1)[1].split(f"## [{__version__}]", 1)[0]
    assert len(unreleased.strip().splitlines()) <= UNRELEASED_MAX_LINES
    newest = text.split(f"## [{__version__}]", 1)[1].split("\n## [", 1)[0]
    assert f"docs/releases/{__version__}.md" in newest
    for entry in re.split(r"^- ", newest, flags=re.M)[1:]:  # a line or two (or four)
        lines = entry.split("\n\n", 1)[0].strip().splitlines()  # to the section's end
        assert len(lines) <= 4, entry[:80]
