"""Every model family end to end: `fp4sense quantize` (plan + oneshot) -> `fp4sense eval`
-> `fp4sense verify-vllm`, on tiny random models built from configs (tests/families.py).

Each family's checkpoint is made once and shared by its eval and vLLM tests."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from conftest import FP4SENSE, SMALL
from families import BOS_FAMILIES, FAMILIES, make_family_model

_CHECKPOINTS: dict[str, tuple[Path, dict]] = {}


def _family_checkpoint(family: str, tmp_path_factory, assets, text_file) -> tuple[Path, dict]:
    """(checkpoint folder, quantize's JSON result) for ``family``, made once per session."""
    if family not in _CHECKPOINTS:
        root = tmp_path_factory.mktemp(family)
        base = make_family_model(family, root / f"tiny-{family}", assets["model"])
        out = root / f"tiny-{family}-fp4"
        proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "5.0", "--out",
                               str(out), "--text", str(text_file), *SMALL, "--json"],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _CHECKPOINTS[family] = (out, json.loads(proc.stdout))
    return _CHECKPOINTS[family]


@pytest.fixture
def family_checkpoint(request, tmp_path_factory, assets, text_file) -> tuple[Path, dict]:
    """(checkpoint folder, quantize's JSON result) for the family in request.param."""
    return _family_checkpoint(request.param, tmp_path_factory, assets, text_file)


@pytest.fixture(scope="module")
def served_families(tmp_path_factory, assets, text_file, serve_python) -> dict:
    """Every family's checkpoint through one ``fp4sense verify-vllm A B C ...`` (one vLLM
    process, an engine per checkpoint): the exit code, stderr and each family's result."""
    outs = {f: _family_checkpoint(f, tmp_path_factory, assets, text_file)[0]
            for f in sorted(FAMILIES)}
    proc = subprocess.run([FP4SENSE, "verify-vllm", *map(str, outs.values()), "--eval-windows",
                           "1", "--tokens", "128", "--serve-python", str(serve_python),
                           "--json"], capture_output=True, text=True)
    results = json.loads(proc.stdout) if proc.stdout.strip() else []
    return {"rc": proc.returncode, "stderr": proc.stderr[-2000:],
            "by_family": dict(zip(outs, results, strict=False))}


@pytest.mark.slow
@pytest.mark.parametrize("family_checkpoint", sorted(FAMILIES), indirect=True)
def test_quantize_and_eval(family_checkpoint, text_file):
    out, result = family_checkpoint
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["config_groups"]
    # the plan the modifier applied is the one plan.json records, to the stored bit
    assert result["eval"]["effective_bits"] == pytest.approx(result["plan"]["bits_theory"],
                                                             rel=1e-9)
    assert result["eval"]["effective_bits"] <= 5.0
    # calibrated in the CPU's float32; the unquantized tensors stored as the base stores them
    # ... and on windows that start with BOS where the family's tokenizer adds one
    from transformers import AutoTokenizer

    plan = json.loads((out / "plan.json").read_text())
    bos = AutoTokenizer.from_pretrained(out).bos_token_id
    family = out.name.removeprefix("tiny-").removesuffix("-fp4")
    assert plan["calibration"] == {"dtype": "float32", "stored_dtype": "bfloat16",
                                   "window_prefix": [bos] if family in BOS_FAMILIES else []}
    assert result["eval"]["window_prefix"] == plan["calibration"]["window_prefix"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        wide = {f.get_slice(k).get_dtype() for k in f.keys() if not k.endswith("global_scale")}
    assert "F32" not in wide, wide
    proc = subprocess.run([FP4SENSE, "eval", str(out), "--text", str(text_file), "--eval-windows",
                           "2", "--tokens", "64", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    evaluation = json.loads(proc.stdout)
    assert math.isfinite(evaluation["kl"]) and evaluation["kl"] >= 0
    assert 0 < evaluation["top1"] <= 1 and math.isfinite(evaluation["ppl"])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verify_vllm(family, served_families):
    result = served_families["by_family"].get(family)
    assert result is not None, served_families["stderr"]
    assert result["checkpoint"].endswith(f"tiny-{family}-fp4")
    assert result["passed"], result
    assert result["tokens"] == 127


def test_verify_vllm_exits_0_when_every_checkpoint_passes(served_families):
    """The several-checkpoint call's exit code and JSON list (one entry per folder)."""
    assert len(served_families["by_family"]) == len(FAMILIES), served_families["stderr"]
    from fp4sense.cli import EXIT_OK, EXIT_VERIFY_FAILED

    passed = all(r["passed"] for r in served_families["by_family"].values())
    assert served_families["rc"] == (EXIT_OK if passed else EXIT_VERIFY_FAILED)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_fingerprint_survives_llmcompressor_offset_norms(family, tmp_path):
    """llm-compressor's oneshot rewrites Gemma's offset norms (1 + w) while it calibrates;
    the model is still the one the user gave, and its fingerprint says so."""
    import transformers
    from llmcompressor.modeling.offset_norm import norm_calibration_context

    from fp4sense.structure.units import model_fingerprint

    path = make_family_model(family, tmp_path / family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    before = model_fingerprint(model)
    with norm_calibration_context(model):
        assert type(model.model.norm).__name__ == "CalibrationOffsetNorm"
        assert model_fingerprint(model) == before
    other = make_family_model(family, tmp_path / "other", seed=1)
    assert model_fingerprint(transformers.AutoModelForCausalLM.from_pretrained(other)) != before
