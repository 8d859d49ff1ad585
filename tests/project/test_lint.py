"""The code base stays ruff clean (style.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is a dev dependency; install fp4sense[dev]"
    proc = subprocess.run([exe, "check", "src", "plugins", "tests", "bench", "examples",
                           "scripts"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_published_results_name_no_local_path():
    """bench/results, docs and examples travel with the repository: no home or cache
    folder of the machine that made them (a row once recorded its absolute folder)."""
    import re

    local = re.compile(r"(/root/|/home/[a-z]|/Users/|\.cache/fp4sense/models|\"/\S*/bench/results)")
    found = []
    for folder in ("bench/results", "docs", "examples"):
        for path in sorted((REPO / folder).rglob("*")):
            if (path.is_file() and not any(p.startswith(".") for p in path.relative_to(
                    REPO).parts) and path.suffix in (".json", ".md", ".yaml", ".txt")):
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if local.search(line):
                        found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:80]}")
    assert found == []
