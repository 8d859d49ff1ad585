"""Scores after GPTQ (`fp4sense quantize --gptq --gptq-scores`): the estimate reads given
quantized weights instead of rounding to nearest; the llm-compressor rounder saves the
weights GPTQ writes into the checkpoint; the whole command on several families."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from conftest import FP4SENSE, SMALL
from families import make_family_model
from helpers import transform_targets


def _estimate(model, windows, scheme, rounded=None):
    from fp4sense.diagnosis import analyze

    return analyze(model, windows, schemes=[scheme], views=["grid"], modes=["estimated"],
                   cache_dir=None, progress=False, log=lambda m: None, rounded=rounded)


@pytest.fixture(scope="module")
def tiny(tiny_llama, text_file):
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.structure.units import find_units

    model, tok, _ = load_model(tiny_llama)
    windows = analysis_windows(tok, text_file, 2, 64)
    return model, windows, find_units(model, windows[:1, :16])


@pytest.mark.parametrize("scheme", ["NVFP4A16", "NVFP4_H16", "MXFP4A16_H32"])
def test_estimate_reads_the_given_weights_instead_of_rounding_to_nearest(scheme, tiny,
                                                                         tmp_path):
    """Given the round-to-nearest weights (a rotated scheme's in the rotated basis, as its
    checkpoint and the rounder store them), the estimate scores every unit as it does
    rounding to nearest itself, to the bit."""
    from fp4sense.quantization.rounded import RoundedWeights
    from fp4sense.structure.units import quantize_unit

    model, windows, units = tiny
    weight = {m: model.get_submodule(m).weight.data for u in units.units for m in u.modules}
    rtn = {}
    for u in units.units:
        # in the model's compute dtype, as the estimate quantizes
        rtn.update(zip(u.modules, quantize_unit(scheme, u, [weight[m] for m in u.modules],
                                                out_dtype=torch.bfloat16,
                                                dtype=weight[u.modules[0]].dtype), strict=True))
    save_file(rtn, tmp_path / "rtn.safetensors")

    plain = _estimate(model, windows, scheme)
    given_rtn = _estimate(model, windows, scheme,
                          RoundedWeights({scheme: tmp_path / "rtn.safetensors"}))
    assert given_rtn.unit_scores(scheme, "estimated") == plain.unit_scores(scheme, "estimated")
    assert given_rtn.text["quantized_weights"].startswith("GPTQ")
    assert "quantized_weights" not in plain.text


def test_estimate_of_unquantized_given_weights_is_zero(tiny, tmp_path):
    from fp4sense.quantization.rounded import RoundedWeights

    model, windows, units = tiny
    weight = {m: model.get_submodule(m).weight.data for u in units.units for m in u.modules}
    save_file({m: w.to(torch.bfloat16) for m, w in weight.items()}, tmp_path / "same.safetensors")
    plain = _estimate(model, windows, "NVFP4A16")
    # the unquantized weights given (the model is bf16-born: exact): nothing is damaged
    same = _estimate(model, windows, "NVFP4A16",
                     RoundedWeights({"NVFP4A16": tmp_path / "same.safetensors"}))
    scores = same.unit_scores("NVFP4A16", "estimated")
    assert len(scores) == len(units.units) and set(scores.values()) == {0.0}
    assert min(plain.unit_scores("NVFP4A16", "estimated").values()) > 0


def test_a_weight_missing_from_the_rounded_file_is_named(tiny, tmp_path):
    from fp4sense.quantization.rounded import RoundedWeights, RoundedWeightsError

    model, windows, units = tiny
    kept = {m: model.get_submodule(m).weight.data.to(torch.bfloat16)
            for u in units.units for m in u.modules}
    lost = units.units[0].modules[0]
    del kept[lost]
    save_file(kept, tmp_path / "short.safetensors")
    with pytest.raises(RoundedWeightsError, match=lost.replace(".", r"\.")):
        _estimate(model, windows, "NVFP4A16",
                  RoundedWeights({"NVFP4A16": tmp_path / "short.safetensors"}))


@pytest.mark.slow
@pytest.mark.parametrize("family,scheme", [("llama", "NVFP4A16"), ("qwen2", "FP8_DYNAMIC"),
                                           ("gemma3", "NVFP4_SEARCH"),
                                           ("mistral", "MXFP4_H32")])
def test_rounder_saves_the_weights_gptq_writes_into_the_checkpoint(family, scheme, assets,
                                                                   text_file, tmp_path):
    """The rounded file holds, bit for bit, each linear's weight in the checkpoint that
    `quantize --gptq` writes for the same plan (decompressed by compressed-tensors; a
    rotated scheme's in the rotated basis, where GPTQ rounded it); a second call with the
    file present uses it again."""
    from fp4sense.checkpoint.loading import load_checkpoint
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.quantization.rounded import round_menu, uniform_plan
    from fp4sense.runtime.hosts import quantizer
    from fp4sense.structure.units import find_units, model_fingerprint

    base = make_family_model(family, tmp_path / family, assets["model"])
    model, tok, _ = load_model(base)
    calib = analysis_windows(tok, text_file, 4, 64)
    units, fingerprint = find_units(model, calib[:1, :16]), model_fingerprint(model)
    said = []
    files = round_menu(str(base), calib, units, [scheme], tmp_path / "rounded", model=family,
                       fingerprint=fingerprint, log=said.append)
    work = tmp_path / "ckpt"
    work.mkdir()
    uniform_plan(units, scheme, family, fingerprint).save(work / "plan.json")
    quantizer()(str(base), calib, work, plan="plan.json", gptq=True)
    written, _, _ = load_checkpoint(work, dtype=torch.bfloat16)
    transform = json.loads((work / "config.json").read_text())["quantization_config"].get(
        "transform_config")
    assert bool(transform) == ("_H" in scheme)  # the rotated plan stores its rotation

    from safetensors import safe_open

    with safe_open(str(files[scheme]), "pt") as f:
        names = list(f.keys())
        assert sorted(names) == sorted(m for u in units.units for m in u.modules)
        for name in names:
            assert torch.equal(f.get_tensor(name), written.get_submodule(name).weight.data), name
    # the same model, windows and scheme: the file is used again, not rounded again
    stamp = files[scheme].stat().st_mtime_ns
    again = round_menu(str(base), calib, units, [scheme], tmp_path / "rounded", model=family,
                       fingerprint=fingerprint, log=said.append)
    assert again == files and files[scheme].stat().st_mtime_ns == stamp
    assert "rounded by an earlier run" in said[-1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_quantize_with_gptq_scores_plans_from_scores_after_gptq(family, assets, text_file,
                                                                tmp_path):
    base = make_family_model(family, tmp_path / family, assets["model"])
    out = tmp_path / f"{family}-fp4"
    proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "5.0", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--gptq", "--gptq-scores",
                           "--menu", "NVFP4A16,FP8_DYNAMIC,BF16", "--no-scale-search",
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["plan"]["damage_source"] == "after-GPTQ estimated"
    assert result["plan"]["bits_theory"] <= 5.0  # (a MoE's written bits add its routers)
    assert result["timings"]["gptq_scores_s"] > 0
    # one uniform GPTQ rounding per quantizing scheme of the menu, in menu order
    assert "rounding every unit NVFP4A16 with GPTQ (1/2)" in proc.stderr
    assert "rounding every unit FP8_DYNAMIC with GPTQ (2/2)" in proc.stderr
    report = json.loads((out / "sensitivity.json").read_text())
    assert report["text"]["quantized_weights"].startswith("GPTQ")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["damage_source"] == "after-GPTQ estimated"
    assert "GPTQModifier" in (out / "recipe.yaml").read_text()
    # published: the rounded weights beside the output are gone
    assert not (tmp_path / f".{out.name}.gptq-scores").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([family, out.name])


@pytest.mark.parametrize("extra,culprit", [([], "--gptq"),
                                           (["--gptq", "--sensitivity", "s.json"],
                                            "--sensitivity")])
def test_gptq_scores_refuses_what_it_cannot_honour(extra, culprit, tiny_llama, tmp_path):
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5.0", "--out",
                           str(tmp_path / "out"), "--gptq-scores", *extra],
                          capture_output=True, text=True, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "--gptq-scores" in last and culprit in last, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_gptq_scores_score_rotated_schemes_in_the_rotated_basis(family, assets, text_file,
                                                                 tmp_path):
    """With rotated schemes on the menu, each is rounded by GPTQ once, in its rotated
    basis; the plan is made from those scores, and the checkpoint's transform_config
    rotates exactly the units the plan rotates (a MoE's experts take no rotation)."""
    from fp4sense.numerics.schemes import get_scheme

    base = make_family_model(family, tmp_path / family, assets["model"])
    out = tmp_path / "q"
    proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "4.6", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--gptq", "--gptq-scores",
                           "--menu", "MXFP4,MXFP4_H32,BF16", "--no-scale-search", "--no-eval",
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rounding every unit MXFP4 with GPTQ (1/2)" in proc.stderr
    assert "rounding every unit MXFP4_H32 with GPTQ (2/2)" in proc.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["damage_source"] == "after-GPTQ estimated"
    report = json.loads((out / "sensitivity.json").read_text())
    assert report["text"]["quantized_weights"].startswith("GPTQ")
    rotated = {m for c in plan["choices"] if get_scheme(c["scheme"]).rotation
               for m in c["modules"]}
    assert rotated and not any(".experts." in m for m in rotated)  # (random weights: some)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(transform_targets(base, config)) == rotated
