"""Rotated FP4 schemes (``NVFP4_H16``, ``MXFP4_H32``, ...): the rotation is
compressed-tensors' own Hadamard transform bit for bit, the estimate is the checkpoint bit
for bit, plans rotate per unit, the checkpoint reruns from its recipe and vLLM serves it
(with the plugin's CPU kernel for vLLM's Hadamard op)."""

from __future__ import annotations

import json
import subprocess
from copy import deepcopy
from pathlib import Path

import pytest
import torch

from conftest import FP4SENSE, SMALL
from families import make_family_model
from fp4sense.numerics.rotation import (
    hadamard,
    rotate_input,
    rotate_weight,
    rotation_flops_per_token,
    transform_config,
)
from fp4sense.numerics.schemes import MENU, get_scheme, rotations_of
from helpers import transform_targets, uniform_plan_file

ROTATED = [n for n, s in MENU.items() if s.rotation]


def test_rotated_schemes_in_the_menu():
    plain = [f"{base}_H{width}" for base, widths in (
        ("NVFP4", (16, 64, 128)), ("NVFP4A16", (16, 64, 128)), ("MXFP4", (32, 64, 128)),
        ("MXFP4A16", (32, 64, 128))) for width in widths]
    w4a4 = [n for n in plain if n.startswith("NVFP4_")]  # + the input-clip twins (W4A4)
    assert ROTATED == plain + [f"{n}_SEARCH" for n in plain] + [  # searched-scale twins
        f"{n}_ACLIP" for n in w4a4] + [f"{n}_ACLIP_SEARCH" for n in w4a4]
    for name in ROTATED:
        s, plain = get_scheme(name), MENU[get_scheme(name).preset]
        assert (s.weight_format, s.activations) == (plain.weight_format, plain.activations)
        assert s.block_size == max(s.rotation, plain.block_size)  # both powers of two
    assert rotations_of(["NVFP4", "MXFP4_H128", "NVFP4_H16", "NVFP4A16_H16"]) == (16, 128)
    h = hadamard(16)
    assert torch.allclose(h @ h.T, torch.eye(16, dtype=torch.float64), atol=1e-15)
    assert rotation_flops_per_token(4096, 4096 * 3, 128) == pytest.approx(128 / 12288)


@pytest.mark.parametrize("width", [16, 32, 128])
def test_the_rotation_is_compressed_tensors_transform_bit_for_bit(width):
    """The weight fused and the input rotated online by compressed-tensors'
    apply_transform_config (the config a plan writes) equal rotate_weight / rotate_input,
    bit for bit, in float32 and bfloat16; the product is unchanged before quantization."""
    from compressed_tensors.transform import apply_transform_config

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(width)
        model = torch.nn.Sequential()
        model.add_module("lin", torch.nn.Linear(256, 48, bias=False).to(dtype))
        base = deepcopy(model)
        scheme = {16: "NVFP4_H16", 32: "MXFP4_H32", 128: "NVFP4_H128"}[width]
        apply_transform_config(model, transform_config({scheme: ["re:.*lin$"]}))
        w = base.lin.weight.data
        assert torch.equal(model.lin.weight.data, rotate_weight(w, width))
        seen = {}
        model.lin.register_forward_pre_hook(
            lambda m, args, seen=seen: seen.setdefault("x", args[0]))
        x = torch.randn(3, 5, 256).to(dtype)
        y = model(x)
        assert torch.equal(seen["x"], rotate_input(x, width))
        exact = torch.nn.functional.linear(x.double(), w.double())
        assert torch.allclose(y.double(), exact, atol=0.05 if dtype == torch.bfloat16 else 1e-4)


def test_a_rotation_needs_a_width_it_divides():
    from fp4sense.structure.units import Unit

    with pytest.raises(ValueError, match="divisible by 128"):
        rotate_input(torch.zeros(2, 96), 128)
    attn = Unit(0, "self_attn.o_proj", ("model.layers.0.self_attn.o_proj",), 96, (96,))
    assert "block size 128" in attn.why_infeasible("NVFP4_H128")
    assert attn.why_infeasible("NVFP4_H16") is None
    experts = Unit(0, "mlp.experts", ("model.layers.0.mlp.experts.0.up_proj",), 128, (64,),
                   experts=8)
    assert "MoE experts" in experts.why_infeasible("NVFP4_H16")
    assert experts.why_infeasible("NVFP4") is None


def _amax_giving(global_scale: torch.Tensor) -> float:
    """An input maximum from which compressed-tensors makes exactly ``global_scale``."""
    from compressed_tensors.quantization.utils import generate_gparam

    amax = (448 * 6 / global_scale.double()).float().reshape(())
    for _ in range(8):
        made = generate_gparam(-amax, amax).reshape(())
        if made == global_scale.reshape(()):
            return float(amax)
        amax = torch.nextafter(amax, amax * (2.0 if made > global_scale.reshape(()) else 0.5))
    raise AssertionError(f"no input maximum gives {global_scale}")


def _uniform_rotated(base, calib, units, scheme: str, work):
    from helpers import FP32, uniform_checkpoint

    return uniform_checkpoint(base, calib, units, scheme, work, FP32)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_estimate_is_the_rotated_checkpoint_bit_for_bit(family, assets, text_file,
                                                             tmp_path):
    """A rotated checkpoint (the plugin's oneshot) decompresses, bit for bit, to the
    estimate's fake quantization in the rotated basis (W4A4 and weight-only, NVFP4 and
    MXFP4); its config carries a transform_config vLLM reads; the model fp4sense loads
    from it computes, bit for bit, what the estimate's measurement computes (given the
    NVFP4 input scales the host calibrated on its own windows); the transform matrices
    are stored once per width, in the base's dtype, and counted in the measured bits."""
    from fp4sense.checkpoint.checks import effective_bits
    from fp4sense.checkpoint.loading import load_checkpoint
    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.inputs.models import analysis_windows, load_model
    from fp4sense.structure.units import find_units, quantize_unit

    base = make_family_model(family, tmp_path / family, assets["model"])
    model, tok, _ = load_model(base)
    calib = analysis_windows(tok, text_file, 4, 64)
    units = find_units(model, calib[:1, :16])
    modules = dict(model.named_modules())
    # Qwen2's q/k/v add a bias, which vLLM's transforms do not serve: they stay BF16
    biased = {u.name for u in units.units if u.bias}
    assert biased == ({u.name for u in units.units if "q_proj" in u.kind}
                      if family == "qwen2" else set())
    assert all("bias" in units.by_name()[u].why_infeasible("NVFP4_H16") for u in biased)
    taking = [u for u in units.units if u.name not in biased]
    for scheme in ("NVFP4_H16", "MXFP4_H32", "NVFP4A16_H128"):
        width = get_scheme(scheme).rotation
        work = tmp_path / scheme
        _uniform_rotated(base, calib, units, scheme, work)
        config = json.loads((work / "config.json").read_text())["quantization_config"]
        group = config["transform_config"]["config_groups"][f"hadamard_{width}"]
        assert (group["type"], group["head_dim"]) == ("hadamard", width)
        assert [(a["location"], a["inverse"]) for a in group["apply"]] == [
            ("input", False), ("weight_input", True)]
        served, _, notes = load_checkpoint(work, dtype=torch.float32)
        assert any("rotate their inputs online" in n for n in notes)
        assert set(transform_targets(base, config)) == {m for u in taking for m in u.modules}
        for unit in taking:
            fake = quantize_unit(scheme, unit, [modules[m].weight.data for m in unit.modules],
                                 out_dtype=torch.bfloat16, dtype=torch.float32,
                                 scale_dtype=torch.bfloat16)
            for m, q in zip(unit.modules, fake, strict=True):
                got = served.get_submodule(m).weight.data.to(torch.bfloat16)
                assert torch.equal(got, q), (scheme, m)
        # the same numbers end to end: the estimate's measurement of the whole assignment
        run = Analysis(model, calib[:2], units, EntryCache(None), progress=False)
        run.rotations = (width,)
        run.base_pass()
        for m, stats in run.stats.items():  # NVFP4 inputs: the scale the host calibrated
            stored = getattr(served.get_submodule(m), "input_global_scale", None)
            if stored is not None:  # (its windows ran through the quantized blocks before)
                stats[f"absmax_h{width}"] = _amax_giving(stored)
        with torch.no_grad(), run.applied({m: (u, scheme) for u in taking
                                           for m in u.modules}):
            ours = model(input_ids=calib[:2]).logits
        theirs = served(input_ids=calib[:2]).logits
        assert torch.equal(ours, theirs), (scheme, (ours - theirs).abs().max())
        bits = effective_bits(work)
        assert bits["transform_bytes"] == width * width * 2  # one bf16 matrix, tied
        plan = json.loads((work / "plan.json").read_text())
        numel = sum(c["numel"] for c in plan["choices"])
        assert (bits["bytes"] - bits["transform_bytes"]) * 8 / numel == pytest.approx(
            plan["achieved_bits_theory"], rel=1e-9)


@pytest.mark.slow
def test_a_plan_rotates_per_unit_and_its_recipe_reruns_the_checkpoint(tiny_llama, text_file,
                                                                      tmp_path):
    """quantize with plain and rotated schemes on the menu, one pinned rotated: the plan
    says which units rotate, the checkpoint's transform_config targets exactly those
    (q/k/v share one transform), and recipe.yaml reproduces the checkpoint bit for bit."""
    from safetensors.torch import load_file

    from conftest import rerun_recipe

    out = tmp_path / "q"
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "4.6",
                           "--menu", "NVFP4,NVFP4_H16,MXFP4_H32", "--no-scale-search",
                           "--pin", r".*self_attn\.q_proj=NVFP4_H16", "--out", str(out),
                           "--text", str(text_file), *SMALL, "--no-eval"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    rotated = {c["unit"]: c["scheme"] for c in plan["choices"] if get_scheme(c["scheme"]).rotation}
    assert {"0:self_attn.q_proj+k_proj+v_proj", "1:self_attn.q_proj+k_proj+v_proj"} <= set(rotated)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    targeted = transform_targets(tiny_llama, config)
    expected = {m: get_scheme(c["scheme"]).rotation for c in plan["choices"]
                for m in c["modules"] if get_scheme(c["scheme"]).rotation}
    assert targeted == expected
    card = (out / "README.md").read_text()
    assert f"### Rotations\n\n{len(rotated)} of {len(plan['choices'])} units" in card
    assert "transformers loads the checkpoint but does not apply `transform_config`" in card
    rerun_recipe(out, tiny_llama, text_file, tmp_path / "again")
    first, again = load_file(out / "model.safetensors"), load_file(tmp_path / "again" /
                                                                   "model.safetensors")
    assert sorted(first) == sorted(again)
    assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("scheme", ["NVFP4_H16", "MXFP4A16_H32"])
def test_qad_before_calibration_trains_in_the_rotated_basis(scheme, tiny_llama, text_file,
                                                            tmp_path):
    """Before calibration the rotation is not in the model, so QAD applies it: its base
    pass takes the rotated inputs' maxima (the estimate's, to the bit), its forward is
    ``Q(x R) Q(W R)^T`` under fp4sense's rotated fake quantization (to float32 rounding of
    the straight-through sums; without the rotation it is far off), and the gradient
    reaches the master weights, kept unrotated, through ``R``."""
    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.inputs.models import load_model
    from fp4sense.numerics.fakequant import activation_quantizer
    from fp4sense.quantization.distill import DistillSettings, base_pass
    from fp4sense.quantization.straight_through import Refresher, install
    from fp4sense.structure.units import quantize_unit

    calib, units = uniform_plan_file(tiny_llama, text_file, scheme, tmp_path / "plan.json")
    schemes = {c["unit"]: c["scheme"]
               for c in json.loads((tmp_path / "plan.json").read_text())["choices"]}
    width = get_scheme(scheme).rotation
    model, _, _ = load_model(tiny_llama, dtype=torch.float32)
    settings = DistillSettings(steps=1, windows=len(calib), holdout=0)
    base = base_pass(model, units, schemes, calib, settings)
    run = Analysis(model, calib, units, EntryCache(None), progress=False)
    run.rotations = (width,)
    run.base_pass()
    rotated = [(u, get_scheme(schemes[u.name])) for u in units.units
               if get_scheme(schemes[u.name]).rotation]
    assert rotated and all(base.absmax[m] == run.stats[m][f"absmax_h{width}"]
                           for u, _ in rotated for m in u.modules)
    # Q(x R) Q(W R)^T spelled out: the rotated-basis weights in place, the inputs hooked
    reference = deepcopy(model)
    for unit, s in rotated:
        mods = [reference.get_submodule(m) for m in unit.modules]
        for mod, q in zip(mods, quantize_unit(s.name, unit, [mod.weight for mod in mods],
                                              dtype=torch.float32), strict=True):
            mod.weight.data = q
            quantize = activation_quantizer(s, base.absmax[unit.modules[mods.index(mod)]])
            mod.register_forward_pre_hook(lambda _m, args, q=quantize: (q(args[0]),))
    with torch.no_grad():
        expected = reference(calib).logits

    def qad_forward(trained):
        m = deepcopy(model)
        modules = dict(m.named_modules())
        params, _ = install(modules, trained, base.absmax, None)
        Refresher(modules, trained, base.importance, dtype=torch.float32).refresh(False)
        return m, params, m(calib).logits

    plain = [(u, MENU[s.preset]) for u, s in rotated]  # the same formats, unrotated
    _, _, unrotated = qad_forward(plain)
    trained_model, params, got = qad_forward(rotated)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert (unrotated - expected).abs().max() > 100 * (got - expected).abs().max()
    # the gradient reaches the master weight, kept unrotated, through R: the last block's
    # down_proj (nothing after it quantizes) against a central difference
    names = [m for u, _ in rotated for m in u.modules]
    assert names[-1].endswith("mlp.down_proj")
    weight = params[-1]

    def loss():
        return trained_model(calib).logits.square().mean()

    loss().backward()
    step = 1e-3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weight += step
        up = loss()
        weight -= 2 * step
        down = loss()
        weight += step
    assert float((up - down) / 2) == pytest.approx(float((weight.grad * step).sum()),
                                                   rel=2e-2)
    # and reaches the input through R too (straight through Q): dL/dx = dL/d(x R) R^T,
    # R symmetric
    assert torch.equal(hadamard(width), hadamard(width).T)
    first = trained_model.get_submodule(names[0])
    x = torch.randn(2, first.in_features, requires_grad=True)
    first(x).sum().backward()
    torch.testing.assert_close(x.grad, rotate_input(
        torch.ones(2, first.out_features) @ first.weight.detach(), width))


def _untrained_and_trained_qad(tiny_llama, text_file, tmp_path, *rounding):
    """quantize a plan with q_proj pinned to MXFP4_H32 (``rounding``: e.g. --gptq), then
    the same with 4 QAD steps, untrained (a learning rate too small to move a float32
    weight) and trained: the untrained checkpoint is the first bit for bit, and both keep
    its rotation. Returns (the first's tensors, the trained one's, its folder)."""
    from safetensors.torch import load_file

    def quantize(name, *extra):
        out = tmp_path / name
        proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "4.6",
                               "--menu", "MXFP4,MXFP4_H32,FP8_DYNAMIC", "--no-scale-search",
                               "--pin", r".*self_attn\.q_proj=MXFP4_H32", "--out", str(out),
                               "--text", str(text_file), *SMALL, *rounding, *extra,
                               "--no-eval"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out, load_file(out / "model.safetensors"), json.loads(
            (out / "config.json").read_text())["quantization_config"]["transform_config"]

    qad = ["--distill", "4", "--distill-windows", "2", "--distill-holdout", "0"]
    _, first, rotation = quantize("first")
    assert rotation["config_groups"]
    _, still, still_rotation = quantize("still", *qad, "--distill-lr", "1e-12")
    assert still_rotation == rotation and still.keys() == first.keys()
    assert all(torch.equal(still[k], first[k]) for k in first)
    out, trained, trained_rotation = quantize("trained", *qad, "--distill-lr", "1e-4")
    assert trained_rotation == rotation
    return first, trained, out


@pytest.mark.slow
def test_qad_before_calibration_trains_a_rotated_plan(tiny_llama, text_file, tmp_path):
    """--distill with rotated schemes and no GPTQ: untrained (a learning rate too small
    to move a float32 weight) the checkpoint is the rotated round-to-nearest checkpoint
    bit for bit, rotation included; trained, the loss falls, the rotated FP4 codes move,
    the rotation stays, and recipe.yaml reruns the checkpoint."""
    from safetensors.torch import load_file

    from conftest import rerun_recipe

    rtn, trained, out = _untrained_and_trained_qad(tiny_llama, text_file, tmp_path)
    record = json.loads((out / "distill.json").read_text())
    assert record["start"] == "before calibration"
    assert record["loss_after"] < record["loss_before"]
    rotated = [k for k in rtn if "q_proj" in k and k.endswith("weight_packed")]
    assert rotated and any(not torch.equal(trained[k], rtn[k]) for k in rotated)
    rerun_recipe(out, tiny_llama, text_file, tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(trained)
    assert all(torch.equal(again[k], trained[k]) for k in trained)


def test_the_qad_modifier_before_calibration_refuses_quip(tiny_llama, text_file, tmp_path):
    """The YAML path: QAD placed before calibration in a stage with llm-compressor's
    QuIPModifier, whose transforms fp4sense does not compute, is one DistillError naming
    it and what to do."""
    from llmcompressor.modifiers.transform import QuIPModifier

    from fp4sense.quantization.distill import DistillError
    from fp4sense_llmcompressor import QuantizationAwareDistillationModifier
    from fp4sense_llmcompressor.driver import calibrated_model
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    calib, _ = uniform_plan_file(tiny_llama, text_file, "NVFP4", tmp_path / "plan.json")
    with pytest.raises(DistillError, match=r"transforms linears \(QuIPModifier\)"
                       r".*put a GPTQModifier before it"):
        calibrated_model(str(tiny_llama), calib, [
            QuIPModifier(rotations=["v"], transform_type="hadamard"),
            SensitivityGuidedModifier(plan=str(tmp_path / "plan.json")),
            QuantizationAwareDistillationModifier(steps=2, windows=2, holdout=0)],
            dtype="float32")


@pytest.mark.slow
def test_qad_after_gptq_trains_a_rotated_plan(tiny_llama, text_file, tmp_path):
    """--gptq --distill with rotated schemes: untrained (a learning rate too small to move
    a float32 weight) the checkpoint is the rotated GPTQ checkpoint bit for bit, rotation
    included; trained, the loss it starts from falls and the stored rotation stays."""
    gptq, trained, out = _untrained_and_trained_qad(tiny_llama, text_file, tmp_path,
                                                    "--gptq")
    record = json.loads((out / "distill.json").read_text())
    assert record["start"] == "after GPTQ, under its scales"
    assert record["loss_after"] < record["loss_before"]
    # the stored codes move, the scales are GPTQ's. The codes that move here are FP8's:
    # after GPTQ a few steps move no FP4 code (E2M1's steps are wide; a larger learning
    # rate raises the loss), which is why the rotated units' training is proven by
    # test_qad_after_gptq_computes_what_the_rotated_model_computes instead
    codes = [k for k in gptq if k.endswith(("weight_packed", "proj.weight"))]
    assert codes and any(not torch.equal(trained[k], gptq[k]) for k in codes)
    scales = [k for k in gptq if k.endswith(("weight_scale", "weight_global_scale"))]
    assert scales and all(torch.equal(trained[k], gptq[k]) for k in scales)


def test_the_cpu_hadamard_kernel_is_vllms_op(serve_python):
    """The plugin defines vLLM's ``_C::hadacore_transform`` for the CPU: what vLLM's own
    test expects of the CUDA kernel (x times the normalized Hadamard matrix), and bit for
    bit the calibration's rotation of each block."""
    script = Path(__file__).resolve().parents[1] / "serve" / "hadamard_check.py"
    done = subprocess.run([str(serve_python), str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["cases"] == 12 and report["mismatches"] == [], report


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_moe"])
def test_a_rotated_checkpoint_passes_verify_vllm(family, assets, text_file, tmp_path,
                                                 serve_python):
    """vLLM (CPU, with the plugin) serves a rotated checkpoint as transformers computes
    it, dense and MoE (the experts are not rotated: vLLM's fused MoE takes no transform;
    nor are Qwen2's biased q/k/v: vLLM's transforms serve no bias); the dense Llama's MLP
    output takes NVFP4_ACLIP (its input observer and fraction in the config)."""
    base = make_family_model(family, tmp_path / family, assets["model"])
    out = tmp_path / "q"
    biased = family == "qwen2_moe"
    pins = ["--pin", r".*self_attn\.o_proj=MXFP4_H32"] + (
        [] if biased else ["--pin", r".*self_attn\.q_proj=NVFP4_H16"]) + (
        ["--pin", r".*mlp\.down_proj=NVFP4_ACLIP"] if family == "llama" else [])
    proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "4.6", "--menu",
                           "NVFP4,NVFP4_H16,MXFP4_H32,NVFP4_ACLIP", "--no-scale-search", *pins,
                           "--out", str(out), "--text", str(text_file), *SMALL, "--no-eval"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    rotated = transform_targets(base, config)
    assert any(m.endswith("o_proj") for m in rotated)
    assert not any(".experts." in m for m in rotated)
    assert any(m.endswith("q_proj") for m in rotated) != biased
    clipped = [t for g in config["config_groups"].values() for t in g["targets"]
               if (g.get("input_activations") or {}).get("observer") == "fp4sense_input_clip"]
    if family == "llama":  # pinned there (elsewhere the plan may take the twin on a tie)
        assert any(r"mlp\.down_proj" in t for t in clipped), clipped
    proc = subprocess.run([FP4SENSE, "verify-vllm", str(out), "--eval-windows", "1", "--tokens",
                           "128", "--serve-python", str(serve_python), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert json.loads(proc.stdout)["passed"]


def test_a_rotated_pin_on_a_biased_unit_is_refused(assets, text_file, tmp_path):
    """Qwen2's q/k/v add a bias; vLLM's transforms serve none, so pinning them to a
    rotated scheme is one clear line naming the unit and why, and nothing is written."""
    base = make_family_model("qwen2", tmp_path / "qwen2", assets["model"])
    proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "4.6", "--menu",
                           "NVFP4,NVFP4_H16", "--pin", r".*self_attn\.q_proj=NVFP4_H16",
                           "--out", str(tmp_path / "q"), "--text", str(text_file), *SMALL,
                           "--no-eval"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("fp4sense: error: unit 0:self_attn.q_proj+k_proj+v_proj is "
                           "pinned to NVFP4_H16, but vLLM's transforms serve no linear with "
                           "a bias"), line
    assert not (tmp_path / "q").exists()


def test_an_old_report_does_not_rotate_a_biased_unit(assets, text_file, tmp_path):
    """A sensitivity.json saved before units recorded their bias (fp4sense 0.5) does not
    say that Qwen2's q/k/v add one: quantize reads it from the model, so even where the
    report makes rotation the better choice everywhere, the biased q/k/v stay unrotated."""
    base = make_family_model("qwen2", tmp_path / "qwen2", assets["model"])
    proc = subprocess.run([FP4SENSE, "analyze", str(base), "--schemes", "NVFP4,NVFP4_H16",
                           "--views", "grid", "--mode", "estimated", "--analysis-windows", "2",
                           "--tokens", "64", "--text", str(text_file), "--no-cache",
                           "--no-plots", "--out", str(tmp_path / "analysis")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "analysis" / "sensitivity.json").read_text())
    assert sum(bool(u.pop("bias", False)) for u in report["units"]["units"]) == 2  # as 0.5
    # 0.5 scored the rotation on the biased units too; here rotating wins on every unit
    plain = [e for e in report["entries"] if e["scheme"] == "NVFP4"]
    report["entries"] = plain + [{**e, "scheme": "NVFP4_H16", "kl": 0.0} for e in plain]
    (tmp_path / "old.json").write_text(json.dumps(report))
    out = tmp_path / "q"
    proc = subprocess.run([FP4SENSE, "quantize", str(base), "--budget", "4.6", "--menu",
                           "NVFP4,NVFP4_H16", "--no-scale-search", "--sensitivity",
                           str(tmp_path / "old.json"), "--out", str(out), "--text",
                           str(text_file), *SMALL, "--no-eval"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = {c["unit"]: c["scheme"] for c in json.loads((out / "plan.json").read_text())[
        "choices"]}
    assert {u for u, s in chosen.items() if s == "NVFP4"} == {
        f"{b}:self_attn.q_proj+k_proj+v_proj" for b in (0, 1)}, chosen
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert not any(m.endswith(("q_proj", "k_proj", "v_proj"))
                   for m in transform_targets(base, config))


def test_the_analysis_says_where_a_rotation_pays(tiny_llama, text_file, tmp_path):
    """analyze scores rotated schemes beside the plain ones; report.md says per rotated
    scheme on how many units it lowers the damage (from sensitivity.json's own numbers)
    and draws rotation.png."""
    from fp4sense.diagnosis import SensitivityReport

    out = tmp_path / "a"
    proc = subprocess.run([FP4SENSE, "analyze", str(tiny_llama), "--schemes",
                           "NVFP4,NVFP4_H16,MXFP4,MXFP4_H32", "--views", "grid", "--mode",
                           "estimated", "--text", str(text_file), "--analysis-windows", "2",
                           "--tokens", "64", "--no-cache", "--out", str(out)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = SensitivityReport.load(out / "sensitivity.json")
    md = (out / "report.md").read_text()
    assert (out / "rotation.png").is_file() and "(rotation.png)" in md
    for rotated, plain in (("NVFP4_H16", "NVFP4"), ("MXFP4_H32", "MXFP4")):
        a, b = report.unit_scores(plain, "estimated"), report.unit_scores(rotated, "estimated")
        assert set(a) == set(b) and len(a) == 8
        helped = sum(b[u] < 0.95 * a[u] for u in a if a[u] > 0)
        assert (f"**Rotation, {rotated} vs {plain}** (grid, estimated): the rotation lowers "
                f"the damage of {helped} of 8 units") in md


def test_rotated_search_twins_weigh_the_rotated_inputs(tiny_llama):
    """``*_H*_SEARCH``: the base pass keeps E[x^2] of each rotated input (per width), and
    the searched block scales of a rotated unit are searched on ``W R`` weighted by it;
    llm-compressor's observer, attached after the transform (as calibration starts),
    sees the rotated input and picks the same scales."""
    from compressed_tensors.transform import apply_transform_config
    from llmcompressor.observers import Observer

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.numerics import formats as F
    from fp4sense.numerics.fakequant import quantize_weights
    from fp4sense.numerics.scale_search import search_block_scales
    from fp4sense.numerics.schemes import to_quantization_scheme, with_search_twins

    assert with_search_twins(["NVFP4_H16", "MXFP4_H32"]) == [
        "NVFP4_H16", "NVFP4_H16_SEARCH", "MXFP4_H32", "MXFP4_H32_SEARCH"]
    from helpers import base_pass_inputs

    name = "model.layers.1.mlp.down_proj"
    run, units, inputs = base_pass_inputs(tiny_llama, name, rotations=(16,))
    expected = rotate_input(inputs, 16).square().mean(0)
    assert torch.allclose(run.importance[(name, 16)], expected, rtol=1e-5)
    unit = next(u for u in units.units if name in u.modules)
    w = run.original[name]
    searched = run.quantized(unit, "NVFP4A16_H16_SEARCH")[unit.modules.index(name)]
    assert torch.equal(searched, quantize_weights(
        "NVFP4A16_H16_SEARCH", [w], dtype=w.dtype, importance=[expected],
        out_dtype=torch.bfloat16)[0].to(w.dtype))
    assert not torch.equal(searched, run.quantized(unit, "NVFP4A16_H16")[0])

    # the host: transform applied first, then the observer attached (start_calibration)
    linear = torch.nn.Sequential()
    linear.add_module("lin", torch.nn.Linear(64, 8, bias=False))
    plain = linear.lin.weight.detach().clone()
    apply_transform_config(linear, transform_config({"NVFP4A16_H16_SEARCH": ["re:.*lin$"]}))
    args = to_quantization_scheme("NVFP4A16_H16_SEARCH", ["Linear"]).weights
    obs = Observer.load_from_registry(args.observer, base_name="weight", args=args)
    obs.attach(linear.lin)
    x = torch.randn(3, 5, 64) * torch.linspace(0.1, 4, 64)
    linear(x)
    obs(linear.lin.weight)
    qparams = obs.get_qparams()
    turned = rotate_weight(plain, 16)
    gs = F.global_scale(turned)
    assert torch.equal(qparams["global_scale"], gs)
    scales = search_block_scales(turned, "nvfp4", gs,
                                 rotate_input(x, 16).reshape(-1, 64).square().mean(0))
    assert torch.equal(qparams["scale"], scales.to(torch.float32))
    obs.detach(linear.lin)
