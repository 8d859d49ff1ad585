"""The oneshot calibrates in the placement's dtype (float32 on a CPU, bfloat16 on a GPU or
when asked), the estimate quantizes in it too, and the checkpoint stores what a bf16
calibration stores: packed FP4 / FP8 tensors, and everything unquantized in the base's
own dtype."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conftest import FP4SENSE, SMALL
from families import make_family_model
from helpers import FP32, uniform_checkpoint

#: quantization parameters a format keeps in float32 whatever the model's dtype
FIXED_FLOAT32 = ("weight_global_scale", "input_global_scale")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_float32_calibration_is_what_the_estimate_scores_bit_for_bit(family, assets,
                                                                      text_file, tmp_path):
    """A float32-calibrated checkpoint decompresses, bit for bit, to the estimate's fake
    quantization of the same units (weights quantized in float32, FP8 scales stored in
    the base's bf16), for NVFP4 (W4A4), MXFP4 and FP8; its unquantized tensors are the
    base's, in the base's dtype."""
    from safetensors.torch import load_file

    from fp4sense.checkpoint.loading import load_checkpoint
    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.structure.units import find_units, quantize_unit

    base = make_family_model(family, tmp_path / family, assets["model"])
    model, tok, _ = load_model(base)  # float32, the CPU's placement
    calib = analysis_windows(tok, text_file, 4, 64)
    units = find_units(model, calib[:1, :16])
    run = Analysis(model, calib[:1], units, EntryCache(None), progress=False)
    assert (run.weight_dtype, run.stored_dtype) == (torch.float32, torch.bfloat16)
    modules = dict(model.named_modules())
    stored = load_file(base / "model.safetensors")
    for scheme in ("NVFP4", "MXFP4", "FP8_DYNAMIC"):
        work = tmp_path / scheme
        recipe = uniform_checkpoint(base, calib, units, scheme, work, FP32)
        assert recipe.startswith("# fp4sense: calibrated in float32, unquantized tensors "
                                 "stored in bfloat16.")
        assert 'precision="float32"' in recipe
        written = load_file(work / "model.safetensors")
        for name, tensor in written.items():
            if tensor.element_size() == 1:  # FP8 / packed FP4 codes, FP8 / E8M0 scales
                continue
            if name in stored:  # left unquantized: the base's tensor, in its dtype
                assert tensor.dtype == stored[name].dtype and torch.equal(tensor,
                                                                          stored[name]), name
            else:
                assert tensor.dtype == (torch.float32 if name.endswith(FIXED_FLOAT32)
                                        else torch.bfloat16), (scheme, name)
        served, _, _ = load_checkpoint(work, dtype=torch.bfloat16)
        for unit in units.units:
            fake = quantize_unit(scheme, unit, [modules[m].weight.data for m in unit.modules],
                                 out_dtype=torch.bfloat16, dtype=run.weight_dtype,
                                 scale_dtype=run.stored_dtype)
            for m, q in zip(unit.modules, fake, strict=True):
                assert torch.equal(served.get_submodule(m).weight.data, q), (scheme, m)


@pytest.mark.slow
def test_both_dtypes_store_the_same_tensors(tiny_llama, text_file,
                                                                tmp_path):
    """bf16 and float32 calibrations write the same tensor names, dtypes and shapes (the
    checkpoint a bf16 run wrote before is still what a plan without a dtype writes)."""
    from safetensors.torch import load_file

    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.structure.units import find_units

    model, tok, _ = load_model(tiny_llama)
    calib = analysis_windows(tok, text_file, 4, 64)
    units = find_units(model, calib[:1, :16])
    files = {}
    for label, calibration in (("bf16", None), ("fp32", FP32)):
        uniform_checkpoint(tiny_llama, calib, units, "NVFP4", tmp_path / label, calibration)
        files[label] = load_file(tmp_path / label / "model.safetensors")
    assert files["bf16"].keys() == files["fp32"].keys()
    for name, tensor in files["bf16"].items():
        other = files["fp32"][name]
        assert (tensor.dtype, tensor.shape) == (other.dtype, other.shape), name
    # bf16 computes the global scales in bf16 (8 significant bits); float32 keeps them
    # exact: the scales agree within one bf16 step, and the codes mostly
    for name in [k for k in files["bf16"] if k.endswith("global_scale")]:
        a, b = files["bf16"][name], files["fp32"][name]
        assert torch.allclose(a, b, rtol=2 ** -7, atol=0), name
    for name in [k for k in files["bf16"] if k.endswith("weight_packed")]:
        differ = (files["bf16"][name] != files["fp32"][name]).float().mean().item()
        assert differ < 0.1, (name, differ)


@pytest.mark.slow
def test_quantize_records_the_calibration_dtype(quantized):
    plan = json.loads((quantized / "plan.json").read_text())
    assert plan["calibration"] == FP32
    recipe = (quantized / "recipe.yaml").read_text()
    assert recipe.startswith("# fp4sense: calibrated in float32")
    card = (quantized / "README.md").read_text()
    assert "calibrated the model in float32" in card and 'precision="float32"' in card
    config = json.loads((quantized / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_a_quantized_base_is_refused_in_one_line(tiny_llama, tmp_path):
    import shutil

    base = tmp_path / "already"
    shutil.copytree(tiny_llama, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (base / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "5", "--out",
                           str(tmp_path / "q"), *SMALL], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "already quantized" in last and "Traceback" not in proc.stderr
    assert not (tmp_path / "q").exists()


def test_bfloat16_on_a_cpu_without_native_support_says_it_is_slow(monkeypatch):
    from fp4sense.runtime import devices

    said: list[str] = []
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    placement = devices.resolve("cpu", "bfloat16", log=said.append)
    assert placement.dtype == torch.bfloat16 and len(said) == 1
    assert "slower than float32" in said[0] and "--dtype" in said[0]
    assert devices.resolve("cpu", None).dtype == torch.float32
    with pytest.raises(devices.DeviceError, match="--dtype float16"):
        devices.resolve("cpu", "float16")

