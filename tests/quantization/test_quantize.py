"""`fp4sense quantize` / `fp4sense eval`, the SensitivityGuidedModifier in recipes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import FP4SENSE, SMALL, rerun_recipe


def _run(*args, cwd=None):
    return subprocess.run([FP4SENSE, *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_quantize_writes_a_complete_checkpoint(quantized):
    for name in ("config.json", "model.safetensors", "plan.json", "sensitivity.json",
                 "recipe.yaml", "README.md", "plan.png", "tokenizer.json"):
        assert (quantized / name).is_file(), name
    qcfg = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "mixed-precision"
    assert sorted(qcfg["config_groups"]) == [f"group_{i}" for i in range(len(
        qcfg["config_groups"]))]
    assert "lm_head" in qcfg["ignore"]
    result = json.loads((quantized / "fp4sense-quantize.json").read_text())
    # the bits the plan promised are the bits the checkpoint stores
    assert result["eval"]["effective_bits"] == pytest.approx(result["plan"]["bits_theory"],
                                                             rel=1e-9)
    assert result["eval"]["effective_bits"] <= 5.5
    card = (quantized / "README.md").read_text()
    assert card.startswith("---\n") and "compressed-tensors" in card and "vllm serve" in card
    assert not list(quantized.parent.glob(".*partial*"))


@pytest.mark.slow
def test_checkpoint_loads_with_plain_transformers(quantized):
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(quantized)!r}, dtype=torch.bfloat16);"
            " m(input_ids=torch.tensor([[1, 2, 3]])); "
            "assert not any(k.startswith('fp4sense') for k in sys.modules); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.slow
def test_saved_recipe_reproduces_the_checkpoint(quantized, tiny_llama, text_file, tmp_path):
    """recipe.yaml, run from the checkpoint folder with the plugin installed, writes the
    same tensors."""
    from safetensors.torch import load_file

    rerun_recipe(quantized, tiny_llama, text_file, tmp_path / "again")
    a = load_file(quantized / "model.safetensors")
    b = load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_eval_command(quantized, text_file):
    proc = _run("eval", quantized, "--text", text_file, "--eval-windows", "2", "--tokens", "64",
                "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["format"] == "mixed-precision" and r["tokens"] == 126
    assert 0 < r["kl"] < 0.1 and 0.9 < r["top1"] <= 1
    assert 4.5 < r["effective_bits"] < 5.5


def test_non_empty_out_is_refused_and_untouched(tiny_llama, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", out)
    assert proc.returncode == 1 and "--overwrite" in proc.stderr
    assert (out / "mine.txt").read_text() == "keep me" and len(list(out.iterdir())) == 1


@pytest.mark.slow
def test_budget_out_of_reach_names_the_range(tiny_llama, text_file, tmp_path):
    proc = _run("quantize", tiny_llama, "--budget", "3.0", "--out", tmp_path / "q",
                "--text", text_file, *SMALL)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "can reach on this model: 4.503–16.000 bits per weight" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no partial folder left


def test_select_plans_measures_the_best_predicted_and_keeps_the_lowest(tiny_llama, text_file,
                                                                      tmp_path):
    """--select-plans K: the K best plans by prediction are measured on calibration windows
    the estimate did not use; the written plan is the one measured lowest."""
    out = tmp_path / "q"
    proc = _run("quantize", tiny_llama, "--budget", "6.0", "--out", out, "--text", text_file,
                "--select-plans", "3", "--no-eval", "--json", *SMALL[:6])
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = json.loads(proc.stdout)["plan"]["selection"]
    assert len(trials) == 3 and [t for t in trials if t.get("kept")]
    predicted = [t["predicted"] for t in trials]
    assert predicted == sorted(predicted)
    kept = min(trials, key=lambda t: t["measured"])
    assert kept.get("kept") and all(t["measured"] > 0 for t in trials)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["predicted_kl"] == pytest.approx(kept["predicted"], rel=1e-12)
    assert "selection: 3 plans measured on 2 calibration windows" in proc.stderr
    bad = _run("quantize", tiny_llama, "--budget", "6.0", "--out", tmp_path / "b",
               "--select-plans", "0")
    assert bad.returncode == 2 and "--select-plans" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_interrupted_quantize_leaves_nothing_that_looks_complete(tiny_llama, text_file,
                                                                tmp_path, monkeypatch):
    from fp4sense.jobs import quantize as pipeline
    from fp4sense.jobs import quantize_run as run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "oneshot_plan", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.quantize_model(tiny_llama, out_dir=tmp_path / "q", budget_bits=5.0,
                                text=text_file, calib_windows=4, analysis_windows=2,
                                window_tokens=64, progress=False, log=lambda m: None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_report_of_another_model_is_refused(quantized, tmp_path, text_file):
    from transformers import AutoTokenizer

    from conftest import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", seed=1)
    AutoTokenizer.from_pretrained(quantized).save_pretrained(other)
    proc = _run("quantize", other, "--budget", "5", "--out", tmp_path / "q", "--text",
                text_file, "--sensitivity", quantized / "sensitivity.json", *SMALL)
    assert proc.returncode == 1 and "not this one" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "q").exists()


@pytest.mark.slow
def test_modifier_estimates_from_calibration_data_and_composes_with_gptq(tiny_llama, tmp_path):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM

    from fp4sense.checkpoint.checks import check_checkpoint, effective_bits
    from fp4sense_llmcompressor import SensitivityGuidedModifier
    from helpers import calibration_dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    planner = SensitivityGuidedModifier(budget_bits=6.0, analysis_windows=2)
    oneshot(model=model, recipe=[planner, GPTQModifier()], dataset=calibration_dataset(tiny_llama),
            num_calibration_samples=4, max_seq_length=64)
    assert planner.applied_plan is not None and planner.applied_plan.damage_source == "estimated"
    out = tmp_path / "gptq"
    model.save_pretrained(out, save_compressed=True)
    check_checkpoint(out)
    assert effective_bits(out)["bits"] == pytest.approx(planner.applied_plan.bits, rel=1e-9)


@pytest.mark.vllm
@pytest.mark.slow
def test_quantize_output_passes_verify_vllm(quantized, serve_python):
    proc = _run("verify-vllm", quantized, "--eval-windows", "1", "--tokens", "128",
                "--serve-python", serve_python, "--json")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert json.loads(proc.stdout)["passed"]


def test_a_given_report_plans_without_the_twins_it_does_not_score():
    """--sensitivity with scale search on: the searched-scale twins quantize added to the
    menu and the report did not score are left out (and named); twins asked for on the
    menu with scale search off stay."""
    from types import SimpleNamespace

    from fp4sense.jobs.quantize_request import Objective

    report = SimpleNamespace(schemes=["NVFP4", "FP8_DYNAMIC"])
    rest = dict(budget_bits=5.0, budget_bytes=None, kl_target=None, pins=None,
                sensitivity="s.json", sensitivity_mode=None, select_plans=1)
    added = Objective.parse(menu=["NVFP4", "FP8_DYNAMIC", "BF16"], scale_search=True, **rest)
    assert "NVFP4_SEARCH" in added.menu
    assert added.menu_for(report) == (["NVFP4", "FP8_DYNAMIC", "BF16"], ["NVFP4_SEARCH"])
    asked = Objective.parse(menu=["NVFP4_SEARCH", "BF16"], scale_search=False, **rest)
    assert asked.menu_for(report) == (["NVFP4_SEARCH", "BF16"], [])
