"""The examples run (on a tiny model, so they never rot)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import FP4SENSE, REPO


@pytest.mark.slow
def test_python_example_writes_a_standard_checkpoint(tiny_llama, tmp_path, assets):
    out = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "search_scales.py"),
                           str(tiny_llama), "--out", str(out), "--windows", "2"],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "nvfp4-pack-quantized"
    assert qcfg["config_groups"]["group_0"]["weights"]["observer"] == "fp4sense_scale_search"


@pytest.mark.slow
def test_yaml_recipe_runs_through_oneshot(tiny_llama, tmp_path):
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    import fp4sense_llmcompressor  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    oneshot(model=model, recipe=str(REPO / "examples" / "search_scales_recipe.yaml"))
    model.save_pretrained(tmp_path / "ck", save_compressed=True)
    qcfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "nvfp4-pack-quantized"
    assert qcfg["config_groups"]["group_0"]["weights"]["observer"] == "fp4sense_scale_search"


@pytest.mark.slow
def test_sensitivity_guided_recipe_with_gptq_runs_through_oneshot(tiny_llama, tmp_path):
    import torch
    import yaml
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.checkpoint.checks import effective_bits
    from helpers import calibration_dataset

    recipe = yaml.safe_load((REPO / "examples" / "sensitivity_guided_recipe.yaml").read_text())
    planner = recipe["quant_stage"]["quant_modifiers"]["SensitivityGuidedModifier"]
    # the tiny model has 2 blocks: the pinned down_proj of block 1 is a large share of its
    # weights, so 4.75 bits is out of reach there; the bundled model reaches it
    planner["budget_bits"] = 5.5
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    oneshot(model=model, recipe=str(path), dataset=calibration_dataset(tiny_llama),
            num_calibration_samples=4, max_seq_length=64)
    model.save_pretrained(tmp_path / "ck", save_compressed=True)
    qcfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    groups = qcfg["config_groups"]
    assert list(groups) == [f"group_{i}" for i in range(len(groups))]
    pinned = [g for g in groups.values() if g["format"] == "float-quantized"]
    assert pinned and any("down_proj" in t for g in pinned for t in g["targets"])
    assert effective_bits(tmp_path / "ck")["bits"] <= 5.5 + 1e-9


@pytest.mark.slow
def test_python_api_example_runs_every_step(tiny_llama, text_file, tmp_path):
    out = tmp_path / "example"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "python_api.py"),
                           str(tiny_llama), "--text", str(text_file), "--out", str(out),
                           "--windows", "2", "--tokens", "64", "--budget", "5.5"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "analysis" / "report.md").is_file()
    qcfg = json.loads((out / "checkpoint" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
    assert "KL " in proc.stdout and "Hub-ready: " in proc.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_cli_walkthrough_runs_every_step(tiny_llama, text_file, tmp_path, serve_python):
    import os

    env = {**os.environ, "MODEL": str(tiny_llama), "TEXT": str(text_file),
           "OUT": str(tmp_path / "walk"), "WINDOWS": "2", "TOKENS": "64", "BUDGET": "5.5",
           "FP4SENSE": FP4SENSE,
           "REPO_ID": "acme/tiny-fp4"}
    proc = subprocess.run(["bash", str(REPO / "examples" / "cli_walkthrough.sh")], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    walk = tmp_path / "walk"
    report = json.loads((walk / "analysis" / "sensitivity.json").read_text())
    assert report["entries"], "the analysis wrote no entries"
    assert json.loads((walk / "eval.json").read_text())["effective_bits"] <= 5.5
    assert "\nPASS" in proc.stdout
    assert "dry run: every check passed; nothing was uploaded" in proc.stdout


@pytest.mark.slow
def test_qad_recipe_trains_after_gptq_through_oneshot(tiny_llama, tmp_path, monkeypatch):
    """The QAD example recipe (planner, GPTQ, block-wise QAD) runs through llm-compressor's
    oneshot as it stands, a few steps and samples fewer, and saves a checkpoint. Its
    default pipeline gives each modifier that needs calibration data a pass through the
    model of its own: the planner and GPTQ get one each, QAD (which reads the calibration
    windows itself) none."""
    import torch
    import yaml
    from llmcompressor import oneshot
    from llmcompressor.pipelines.sequential.pipeline import SequentialPipeline
    from transformers import AutoModelForCausalLM

    passes = []
    run = SequentialPipeline.__call__
    monkeypatch.setattr(SequentialPipeline, "__call__", staticmethod(
        lambda *a, **k: passes.append(1) or run(*a, **k)))

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.checkpoint.checks import check_checkpoint
    from helpers import calibration_dataset

    recipe = yaml.safe_load((REPO / "examples" / "qad_recipe.yaml").read_text())
    stage = recipe["quant_stage"]["quant_modifiers"]
    stage["SensitivityGuidedModifier"]["budget_bits"] = 5.5  # the tiny model's blocks
    stage["QuantizationAwareDistillationModifier"].update(steps=4, windows=3, holdout=1)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))  # the modifiers' order
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    oneshot(model=model, recipe=str(path), dataset=calibration_dataset(tiny_llama),
            num_calibration_samples=4, max_seq_length=64)
    assert len(passes) == 2  # SensitivityGuidedModifier, GPTQModifier
    model.save_pretrained(tmp_path / "ck", save_compressed=True)
    check_checkpoint(tmp_path / "ck")
