"""FP4 training (QAD): it lowers the KL it trains on, rolls back a diverging run, resumes
an interrupted one to the same weights, and leaves BF16 units untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fp4sense.quantization import qad_loop as qad
from fp4sense.quantization.distill import DistillError, DistillSettings, distill
from helpers import mixed_plan_setup, uniform_plan_file, weights_of


def test_qad_lowers_the_kl_and_leaves_bf16_units_alone(tiny_llama):
    model, units, schemes, windows, bf16_unit = mixed_plan_setup(tiny_llama)
    before = weights_of(model)
    record = distill(model, units, schemes, windows,
                     DistillSettings(steps=12, lr=3e-5, windows=4, holdout=0, check_every=4,
                                     save_every=4, rescale_every=4), progress=False)
    assert record["loss_after"] < record["loss_before"]
    assert len(record["history"]["loss"]) == 12 and not record["rollbacks"]
    after = weights_of(model)
    assert list(after) == list(before)  # no parametrization left behind
    frozen = {f"{m}.weight" for m in units.by_name()[bf16_unit].modules}
    for key, value in before.items():
        if key in frozen or "norm" in key or "embed" in key:
            assert torch.equal(after[key], value), key
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert changed and all(k.endswith("proj.weight") and k not in frozen for k in changed)


def test_qad_rolls_back_a_diverging_run(tiny_llama):
    """A learning rate that makes the loss explode: back to the best state, half the rate,
    said in the log and the record; the weights end finite."""
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    lines: list[str] = []
    record = distill(model, units, schemes, windows,
                     DistillSettings(steps=12, lr=3.0, windows=4, holdout=0, check_every=2,
                                     save_every=2),
                     progress=False, log=lines.append)
    assert record["rollbacks"] and record["rollbacks"][0]["lr"] == 1.5
    assert any("rolled back to step" in line for line in lines)
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert record["loss_after"] <= record["loss_before"] * 1.5


def test_interrupted_qad_resumes_to_the_same_weights(tiny_llama, tmp_path, monkeypatch):
    settings = DistillSettings(steps=8, lr=1e-3, lr_4bit=2.0, windows=4, holdout=0, check_every=2,
                               save_every=4, rescale_every=3)  # two parameter groups
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    distill(model, units, schemes, windows, settings, progress=False)
    straight = weights_of(model)

    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    real_kl, calls = qad._kl, {"n": 0}

    def interrupting(*args):
        calls["n"] += 1
        if calls["n"] == 4 + 6:  # 4 windows of "before", then the 6th training step
            raise KeyboardInterrupt
        return real_kl(*args)

    monkeypatch.setattr(qad, "_kl", interrupting)
    with pytest.raises(KeyboardInterrupt):
        distill(model, units, schemes, windows, settings, state_dir=tmp_path, key="k",
                progress=False)
    assert (tmp_path / qad.STATE_FILE).is_file()
    monkeypatch.setattr(qad, "_kl", real_kl)
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    lines: list[str] = []
    distill(model, units, schemes, windows, settings, state_dir=tmp_path, key="k",
            progress=False, log=lines.append)
    assert any("resumed at step 4" in line for line in lines)
    resumed = weights_of(model)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("bad", [{"steps": 0}, {"steps": -3}, {"steps": 5, "lr": 0.0},
                                 {"steps": 5, "save_every": 7}, {"steps": 5, "holdout": -1},
                                 {"steps": 5, "lr_4bit": 0.0}])
def test_bad_settings_are_one_clear_error(bad):
    with pytest.raises(DistillError):
        DistillSettings(**bad).check()


def test_the_4bit_factor_scales_only_the_4bit_units_learning_rate(tiny_llama):
    """lr_4bit multiplies the learning rate of the linears with 4-bit weights only: at a
    base rate of 1e-12 (an AdamW step moves a weight by about the rate) the NVFP4 units
    train at 3e-5 and the FP8 units move by no more than rounding of the 1e-12 steps."""
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    before = weights_of(model)
    record = distill(model, units, schemes, windows,
                     DistillSettings(steps=12, lr=1e-12, lr_4bit=3e7, windows=4, holdout=0,
                                     check_every=4, save_every=4, rescale_every=4),
                     progress=False)
    assert record["settings"]["lr_4bit"] == 3e7 and not record["rollbacks"]
    assert record["loss_after"] < record["loss_before"]
    after = weights_of(model)
    by_name = units.by_name()
    for unit, scheme in schemes.items():
        keys = [f"{m}.weight" for m in by_name[unit].modules]
        moved = max(float((after[k] - before[k]).abs().max()) for k in keys)
        if scheme.startswith("NVFP4"):
            assert moved > 1e-6, unit
        else:
            assert moved < 1e-9, (unit, scheme)


def test_held_out_windows_choose_the_state_the_run_ends_on(tiny_llama):
    """With held-out windows the run ends on the checked state with the lowest KL on them:
    never worse there than it began, and a run that only hurts them (a learning rate far
    too high) leaves the weights exactly as they were."""
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    lines: list[str] = []
    record = distill(model, units, schemes, windows,
                     DistillSettings(steps=12, lr=3e-5, windows=3, holdout=1, check_every=4,
                                     save_every=4, rescale_every=4),
                     progress=False, log=lines.append)
    held = record["holdout"]
    assert held["windows"] == 1 and record["windows_trained"] == 3
    assert held["step"] in (0, 4, 8, 12) and held["after"] <= held["before"]
    assert any("held-out windows" in line for line in lines)

    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    before = weights_of(model)
    record = distill(model, units, schemes, windows,
                     DistillSettings(steps=8, lr=3.0, windows=3, holdout=1, check_every=2,
                                     save_every=2), progress=False)
    assert record["holdout"]["step"] == 0 and record["rollbacks"]
    assert all(torch.equal(v, before[k]) for k, v in weights_of(model).items())
    with pytest.raises(DistillError, match="hold out fewer"):
        distill(model, units, schemes, windows[:2],
                DistillSettings(steps=2, windows=3, holdout=2), progress=False)


def test_a_plan_for_another_model_is_refused(tiny_llama):
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    with pytest.raises(DistillError, match="does not have"):
        distill(model, units, {"model.layers.9.mlp.down_proj": "NVFP4"}, windows,
                DistillSettings(steps=2, holdout=0), progress=False)
    with pytest.raises(DistillError, match="quantizes no unit"):
        distill(model, units, {u: "BF16" for u in schemes}, windows,
                DistillSettings(steps=2, holdout=0), progress=False)


@pytest.mark.slow
def test_quantize_with_distill_writes_the_usual_checkpoint_and_its_recipe_reproduces_it(
        tiny_llama, text_file, tmp_path):
    """`fp4sense quantize --distill` trains inside the oneshot (the QAD modifier after the
    planner), writes the same kind of checkpoint with the training recorded, keeps no
    state once done, and its recipe.yaml alone writes the same tensors again."""
    import subprocess

    import yaml
    from safetensors.torch import load_file

    from conftest import FP4SENSE, SMALL, rerun_recipe
    from fp4sense.checkpoint.checks import check_checkpoint

    out = tmp_path / "qad"
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5.5", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--distill", "4",
                           "--distill-windows", "2", "--distill-holdout", "1", "--distill-lr",
                           "3e-5", "--no-eval"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_checkpoint(out)
    record = json.loads((out / "distill.json").read_text())
    assert len(record["history"]["loss"]) == 4 and (out / "distill.png").is_file()
    training = json.loads((out / "plan.json").read_text())["training"]
    assert training["steps"] == 4 and training["loss_before"] == record["loss_before"]
    assert training["start"] == "before calibration" and training["windows"] == 2
    assert training["holdout"]["windows"] == 1 and record["holdout"]["windows"] == 1
    assert "## FP4 training" in (out / "README.md").read_text()
    stage = yaml.safe_load((out / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]
    assert list(stage) == ["SensitivityGuidedModifier", "QuantizationAwareDistillationModifier"]
    assert stage["QuantizationAwareDistillationModifier"]["steps"] == 4
    assert "state_dir" not in stage["QuantizationAwareDistillationModifier"]
    assert not list(tmp_path.glob(".*"))  # no training state, no partial folder left

    rerun_recipe(out, tiny_llama, text_file, tmp_path / "again")
    a = load_file(out / "model.safetensors")
    b = load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_qad_after_gptq_starts_from_gptqs_rounding_and_ends_on_its_grid(
        tiny_llama, text_file, tmp_path):
    """With --gptq, QAD trains after GPTQ under GPTQ's scales: untrained (a learning rate
    too small to move a float32 weight) its checkpoint is GPTQ's, bit for bit; trained,
    it lowers the KL it starts from (GPTQ's model) and changes the stored codes, not the
    scales."""
    import subprocess

    import yaml
    from safetensors.torch import load_file

    from conftest import FP4SENSE, SMALL
    from fp4sense.checkpoint.checks import check_checkpoint

    def quantize(name: str, *extra: str) -> Path:
        out = tmp_path / name
        proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5.0",
                               "--out", str(out), "--text", str(text_file), *SMALL, "--gptq",
                               *extra, "--no-eval"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        check_checkpoint(out)
        return out

    def tensors(out: Path) -> dict[str, torch.Tensor]:
        return load_file(out / "model.safetensors")

    qad_args = ["--distill", "4", "--distill-windows", "2", "--distill-holdout", "1"]
    gptq = tensors(quantize("gptq"))
    still = quantize("still", *qad_args, "--distill-lr", "1e-12")
    assert tensors(still).keys() == gptq.keys()
    assert all(torch.equal(tensors(still)[k], gptq[k]) for k in gptq)
    stage = yaml.safe_load((still / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]
    assert list(stage) == ["SensitivityGuidedModifier", "GPTQModifier",
                           "QuantizationAwareDistillationModifier"]

    trained = quantize("trained", "--distill", "8", "--distill-windows", "2",
                       "--distill-holdout", "0", "--distill-lr", "1e-4")
    record = json.loads((trained / "distill.json").read_text())
    assert record["start"] == "after GPTQ, under its scales"
    training = json.loads((trained / "plan.json").read_text())["training"]
    assert training["start"] == record["start"] and "holdout" not in training
    assert "started from GPTQ's rounded weights" in (trained / "README.md").read_text()
    assert record["loss_after"] < record["loss_before"]
    # the stored codes move (FP8's grid is the finer: a few steps from GPTQ's grid points
    # flip its codes first); the scales are GPTQ's
    after = tensors(trained)
    codes = [k for k in gptq if k.endswith(("weight_packed", "proj.weight"))]
    assert codes and any(not torch.equal(after[k], gptq[k]) for k in codes)
    scales = [k for k in gptq if k.endswith(("weight_scale", "weight_global_scale"))]
    assert scales and all(torch.equal(after[k], gptq[k]) for k in scales)


def test_the_qad_modifier_without_calibration_data_names_itself(tiny_llama):
    """A recipe whose QAD has no calibration data to train on (oneshot without a dataset,
    its other modifier data-free) stops with one error naming the QAD modifier."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from fp4sense_llmcompressor.distill import QuantizationAwareDistillationModifier

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    recipe = [QuantizationModifier(targets=["Linear"], scheme="FP8_DYNAMIC",
                                   ignore=["lm_head"]),
              QuantizationAwareDistillationModifier(steps=2)]
    with pytest.raises(ValueError, match="QuantizationAwareDistillationModifier trains on the "
                                         "calibration data: pass a dataset to oneshot"):
        oneshot(model=model, recipe=recipe)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["NVFP4_H16", "MXFP4_H32"])
def test_qad_after_gptq_computes_what_the_rotated_model_computes(scheme, tiny_llama, text_file,
                                                                 tmp_path):
    """After GPTQ under a rotated plan, QAD's straight-through forward (its fixed-scale
    quantizers, hooked after compressed-tensors' input rotation) is the calibrated model's
    own forward, ``Q(x R) Q(W R)^T``, to the bit; without quantization it is not."""
    from compressed_tensors.quantization import disable_quantization
    from llmcompressor.modifiers.gptq import GPTQModifier

    from fp4sense.numerics.schemes import get_scheme
    from fp4sense.quantization.distill import trained_linears
    from fp4sense.quantization.straight_through import FrozenRefresher, install
    from fp4sense_llmcompressor.distill import frozen_quantizers
    from fp4sense_llmcompressor.driver import calibrated_model
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    calib, units = uniform_plan_file(tiny_llama, text_file, scheme, tmp_path / "plan.json")
    model = calibrated_model(str(tiny_llama), calib, [
        SensitivityGuidedModifier(plan=str(tmp_path / "plan.json")), GPTQModifier()],
        dtype="float32")
    assert hasattr(model.get_submodule(units.units[0].modules[0]), f"hadamard_"
                   f"{get_scheme(scheme).rotation}_input")  # the rotation is in the model
    model.float()  # as QAD trains it (embeddings came back bf16, scales FP8 / float32)
    with torch.no_grad():
        expected = model(calib).logits
    schemes = {c["unit"]: c["scheme"]
               for c in json.loads((tmp_path / "plan.json").read_text())["choices"]}
    names = trained_linears(units, schemes)
    frozen = frozen_quantizers(model, names)
    model.apply(disable_quantization)
    modules = dict(model.named_modules())
    with torch.no_grad():
        unquantized = model(calib).logits
        trained = [(u, get_scheme(schemes[u.name])) for u in units.units]
        install(modules, trained, {}, frozen.inputs)
        FrozenRefresher(modules, names, frozen.weights).refresh(False)
        got = model(calib).logits
    assert not torch.equal(unquantized, expected)
    assert torch.equal(got, expected)
