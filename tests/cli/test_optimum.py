"""`optimum-cli fp4sense analyze|quantize|eval`: registered through optimum's command
registration for third-party packages (plugins/optimum), run as a user would."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FP4SENSE, SMALL

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")


def _optimum(*args) -> subprocess.CompletedProcess:
    return subprocess.run([OPTIMUM_CLI, "fp4sense", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def test_registered_in_optimums_namespace():
    # optimum reads optimum.commands.register.*; nothing of fp4sense is imported by hand
    assert importlib.util.find_spec("optimum.commands.register.register_fp4sense")
    proc = subprocess.run([OPTIMUM_CLI, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "fp4sense" in proc.stdout
    proc = _optimum("--help")
    assert proc.returncode == 0
    for sub in ("analyze", "quantize", "eval"):
        assert sub in proc.stdout


def test_same_flags_as_fp4sense():
    for sub in ("analyze", "quantize", "eval"):
        ours = subprocess.run([FP4SENSE, sub, "--help"], capture_output=True, text=True).stdout
        theirs = _optimum(sub, "--help").stdout
        # the option lists are the same text (only the program name differs)
        assert ours.split("options:")[1] == theirs.split("options:")[1], sub


@pytest.mark.slow
def test_eval_gives_the_same_numbers(quantized, text_file):
    args = ["eval", quantized, "--text", text_file, "--eval-windows", "2", "--tokens", "64",
            "--json"]
    theirs = _optimum(*args)
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    ours = subprocess.run([FP4SENSE, *map(str, args)], capture_output=True, text=True)
    assert json.loads(theirs.stdout) == json.loads(ours.stdout)


@pytest.mark.slow
def test_analyze_writes_a_report(tiny_llama, text_file, tmp_path):
    proc = _optimum("analyze", tiny_llama, "--text", text_file, "--mode", "estimated",
                    "--views", "grid", "--analysis-windows", "1", "--tokens", "64", "--no-cache",
                    "--out", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "report" / "report.md").is_file()
    assert (tmp_path / "report" / "sensitivity.json").is_file()


@pytest.mark.slow
def test_quantize_errors_keep_fp4sense_exit_codes(tiny_llama, text_file, tmp_path):
    proc = _optimum("quantize", tiny_llama, "--budget", "3.0", "--out", tmp_path / "q",
                    "--text", text_file, *SMALL)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("fp4sense: error:") and "bits" in lines[-1]
    assert "Traceback" not in proc.stderr and not (tmp_path / "q").exists()
    usage = _optimum("quantize", tiny_llama)  # no --budget / --out: argparse's usage error
    assert usage.returncode == 2
