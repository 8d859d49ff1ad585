"""verify-vllm: checkpoint checks (fast) and real vLLM runs in the serve environment."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import FP4SENSE
from fp4sense.checkpoint.checks import CheckpointError, check_checkpoint


@pytest.fixture(scope="module")
def tiny_nvfp4(tiny_llama, tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from helpers import oneshot_checkpoint

    out = oneshot_checkpoint(tiny_llama, "NVFP4A16", tmp_path_factory.mktemp("ck") / "nvfp4a16")
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_good_checkpoint_passes_checks(tiny_nvfp4):
    assert check_checkpoint(tiny_nvfp4)["format"] == "nvfp4-pack-quantized"


def test_missing_folder_and_plain_model_are_refused(tmp_path, tiny_llama):
    with pytest.raises(CheckpointError, match="not found"):
        check_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no compressed-tensors quantization_config"):
        check_checkpoint(tiny_llama)


def test_truncated_safetensors_is_named(tiny_nvfp4, tmp_path):
    bad = _copy(tiny_nvfp4, tmp_path / "bad")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        check_checkpoint(bad)


def test_missing_scale_tensor_is_named(tiny_nvfp4, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = _copy(tiny_nvfp4, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.down_proj has no weight_scale"):
        check_checkpoint(bad)


def test_config_group_naming_no_module(tiny_nvfp4, tmp_path):
    bad = _copy(tiny_nvfp4, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    group = dict(cfg["quantization_config"]["config_groups"]["group_0"])
    group["targets"] = ["re:.*cross_attn.*"]
    cfg["quantization_config"]["config_groups"]["group_1"] = group
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"group_1.*names no module"):
        check_checkpoint(bad)


def test_cli_reports_corrupt_checkpoint_in_one_line(tiny_nvfp4, tmp_path):
    bad = _copy(tiny_nvfp4, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x00" * 4)
    proc = subprocess.run([FP4SENSE, "verify-vllm", str(bad)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert "truncated" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_python_missing_is_explained(monkeypatch, tmp_path):
    from fp4sense.evaluation import vllm_check as verify

    monkeypatch.delenv(verify.SERVE_PYTHON_ENV, raising=False)
    monkeypatch.setattr(verify.sys, "prefix", str(tmp_path / "venv"))
    with pytest.raises(verify.VerifyError, match="--serve-python"):
        verify.find_serve_python("/nonexistent/python")


# --- real vLLM runs (serve environment, subprocess) -----------------------------------
MIXED_GROUPS = {
    # fused q/k/v kept whole in NVFP4; gate/up whole in FP8; o_proj and down_proj of
    # block 0 in NVFP4; everything else left in BF16
    "NVFP4": [r"re:.*self_attn\.(q|k|v)_proj$", r"re:.*layers\.0\.mlp\.down_proj$"],
    "FP8_DYNAMIC": [r"re:.*mlp\.(gate|up)_proj$"],
}


def _make_checkpoint(tiny_llama: Path, scheme: str, out: Path) -> Path:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoTokenizer

    from fp4sense.numerics.schemes import to_quantization_scheme
    from helpers import calibration_dataset, oneshot_checkpoint

    recipe = None
    if scheme == "MIXED":
        groups = {f"group_{i}": to_quantization_scheme(name, targets)
                  for i, (name, targets) in enumerate(MIXED_GROUPS.items())}
        recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    oneshot_checkpoint(tiny_llama, scheme, out, dataset=calibration_dataset(tiny_llama),
                       recipe=recipe)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out


FORMATS = ["NVFP4", "NVFP4A16", "MXFP4", "MXFP4A16", "FP8_DYNAMIC", "MIXED"]


@pytest.fixture(scope="module")
def served_formats(tiny_llama, tmp_path_factory, serve_python, assets) -> dict:
    """A checkpoint per format, all verified with one vLLM process (verify_vllm_many)."""
    from transformers import AutoTokenizer

    from fp4sense.evaluation.vllm_check import verify_vllm_many
    from fp4sense.inputs.texts import protocol_windows

    root = tmp_path_factory.mktemp("formats")
    cks = {s: _make_checkpoint(tiny_llama, s, root / s) for s in FORMATS}
    windows = [protocol_windows(AutoTokenizer.from_pretrained(ck), "evaluation", 1)[:, :128]
               for ck in cks.values()]
    results = verify_vllm_many(list(cks.values()), windows, serve_python=serve_python,
                               timeout_s=600)
    return {s: (cks[s], r) for s, r in zip(cks, results, strict=True)}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("scheme", FORMATS)
def test_checkpoint_passes_verify_vllm(scheme, served_formats):
    ck, result = served_formats[scheme]
    qcfg = json.loads((ck / "config.json").read_text())["quantization_config"]
    if scheme == "MIXED":
        assert qcfg["format"] == "mixed-precision" and len(qcfg["config_groups"]) == 2
    assert result.checkpoint == str(ck)
    assert result.passed, result.to_dict()
    assert result.tokens == 127
    if scheme == "MXFP4A16":
        assert any("W4A4" in n for n in result.notes)


# --- the bundled SmolLM2 in NVFP4 ----------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_nvfp4(assets, tmp_path_factory) -> Path:
    """SmolLM2 quantized to NVFP4 (W4A4) by llm-compressor, calibrated on protocol text."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from fp4sense.inputs.texts import protocol_windows
    from helpers import oneshot_checkpoint

    tok = AutoTokenizer.from_pretrained(assets["model"])
    ids = protocol_windows(tok, "calibration", 4)[:, :64]
    data = Dataset.from_dict({"input_ids": ids.tolist(),
                              "attention_mask": torch.ones_like(ids).tolist()})
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-nvfp4"
    oneshot_checkpoint(assets["model"], "NVFP4", out, dataset=data)
    tok.save_pretrained(out)
    return out


def _swap_nibbles(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose packed FP4 bytes have their two codes swapped: the classic
    packing bug (high nibble read as the even column). Structure stays valid."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if name.endswith("weight_packed"):
                tensors[name] = ((t & 0x0F) << 4) | (t >> 4)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.mark.vllm
@pytest.mark.slow
def test_smollm2_nvfp4_passes_and_a_numerics_error_fails(smollm2_nvfp4, tmp_path, serve_python):
    """The bundled model in NVFP4 passes verify-vllm; the same vLLM output judged against a
    checkpoint whose nibbles are swapped (a real numerics bug) fails by a wide margin."""
    from transformers import AutoTokenizer

    from fp4sense.evaluation.vllm_check import (
        ACTIVATION_QUANT_TOLERANCE,
        compare_logprobs,
        reference_logprobs,
        run_vllm,
    )
    from fp4sense.inputs.texts import protocol_windows

    # verify_vllm's steps one by one, so the single vLLM run serves both judgements
    check_checkpoint(smollm2_nvfp4)
    tok = AutoTokenizer.from_pretrained(smollm2_nvfp4)
    windows = protocol_windows(tok, "evaluation", 1)[:, :256]
    served = run_vllm(smollm2_nvfp4, windows, "The President said that", serve_python,
                      timeout_s=900)
    notes: list[str] = []
    reference, act_layers = reference_logprobs(smollm2_nvfp4, windows, notes)
    assert act_layers == 210  # NVFP4 is W4A4: every linear quantizes its input
    result = compare_logprobs(smollm2_nvfp4, served, reference, ACTIVATION_QUANT_TOLERANCE)
    assert result.passed, result.to_dict()
    assert result.tokens == 255
    assert 10 < result.vllm_ppl < 100, result.vllm_ppl  # a working language model
    assert result.completion.strip()

    broken = _swap_nibbles(smollm2_nvfp4, tmp_path / "swapped")
    check_checkpoint(broken)  # structurally fine: only the numbers are wrong
    reference, _ = reference_logprobs(broken, windows)
    bad = compare_logprobs(broken, served, reference, ACTIVATION_QUANT_TOLERANCE)
    assert not bad.passed
    assert bad.transformers_ppl > 2 * bad.vllm_ppl, bad.to_dict()
