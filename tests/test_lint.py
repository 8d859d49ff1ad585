"""The code base stays ruff clean (style.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is a dev dependency; install fp4sense[dev]"
    proc = subprocess.run([exe, "check", "src", "plugins", "tests", "bench", "examples",
                           "scripts"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
