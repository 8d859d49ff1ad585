"""The console script: --help, --version, subcommands, errors and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fp4sense import __version__

FP4SENSE = str(Path(sys.executable).parent / "fp4sense")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FP4SENSE, *args], capture_output=True, text=True, timeout=300)


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fp4sense {__version__}"


def test_help_lists_subcommands():
    proc = run("--help")
    assert proc.returncode == 0
    for sub in ("setup", "convert-gguf", "schemes"):
        assert sub in proc.stdout


def test_schemes_json():
    proc = run("schemes", "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["NVFP4A16"]["bits_per_weight_576x1536"] > 4.5
    assert rows["BF16"]["bits_per_weight_576x1536"] == 16


def test_setup_json_points_at_the_assets(assets):
    proc = run("setup", "--json")
    assert proc.returncode == 0, proc.stderr
    paths = json.loads(proc.stdout)
    assert Path(paths["model"]) == assets["model"]


def test_user_error_is_one_line_with_exit_code_1(tmp_path):
    proc = run("convert-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "GGUF file not found" in proc.stderr and "Traceback" not in proc.stderr
