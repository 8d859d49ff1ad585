"""The ``*_ACLIP`` schemes: the NVFP4 input's tensor scale made from a fraction of the
calibration maximum, chosen per unit by the output error, carried by the plan and written
by the ``fp4sense_input_clip`` observer."""

import json

import pytest
import torch
from compressed_tensors.quantization.utils import generate_gparam

from fp4sense.numerics.input_clip import (
    FRACTIONS,
    ClipScores,
    InputClipError,
    check_fraction,
    input_global_scale,
)
from fp4sense.numerics.schemes import (
    MENU,
    bits_per_weight,
    get_scheme,
    to_quantization_scheme,
    with_search_twins,
)


def test_twins_of_every_w4a4_nvfp4_scheme_only():
    clipped = {n for n, s in MENU.items() if s.input_clip}
    w4a4 = {n for n, s in MENU.items() if s.weight_format == "nvfp4" and s.activations == "fp4"
            and not s.input_clip}
    assert len(clipped) == len(w4a4) and "NVFP4_ACLIP" in clipped
    for name in clipped:
        s, plain = get_scheme(name), get_scheme(name.replace("_ACLIP", ""))
        assert (s.preset, s.rotation, s.scale_search) == (plain.preset, plain.rotation,
                                                          plain.scale_search)
    assert with_search_twins(["NVFP4_ACLIP"]) == ["NVFP4_ACLIP", "NVFP4_ACLIP_SEARCH"]
    for name in clipped:  # the same tensors: the same bits
        assert bits_per_weight(name, (96, 64)) == bits_per_weight(
            name.replace("_ACLIP", ""), (96, 64))


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), "half", None])
def test_a_fraction_outside_zero_one_is_one_clear_error(bad):
    with pytest.raises(InputClipError, match=r"in \(0, 1\]"):
        check_fraction(bad, "somewhere")


def test_input_global_scale_is_generate_gparam_of_the_fraction():
    amax = torch.tensor(37.25)
    for f in FRACTIONS:
        want = generate_gparam(-(amax.reshape(1) * f), amax.reshape(1) * f)
        assert torch.equal(input_global_scale(amax, f), want)
    assert torch.equal(input_global_scale(amax, 0.5), 2 * input_global_scale(amax, 1.0))


def test_an_outlier_that_drives_blocks_under_e4m3_is_clipped_and_plain_inputs_are_not():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    plain = torch.randn(256, 64, generator=g)
    s = ClipScores(float(plain.abs().max()))
    s.add(plain, w)
    assert s.choice()["fraction"] == 1.0  # any lower saturates more than it gains
    # one element 1e6 above the rest, in a channel the weights do not read (a massive
    # activation): every other block's E4M3 scale is under 2^-9 (read as zero) at the
    # maximum; clipping costs the output nothing there and gives the blocks their steps
    spiked = plain * 1e-3
    spiked[0, 0] = 1e3
    w[:, 0] = 0
    s = ClipScores(float(spiked.abs().max()))
    s.add(spiked, w)
    chosen = s.choice()
    assert chosen["fraction"] < 1.0 and chosen["error_ratio"] < 0.5
    assert 0 < chosen["saturated"] <= 0.001 and not chosen["refused"]
    # a second outlier token: clipping would saturate 2 of 1024 blocks, more than the
    # 0.1% a candidate may: the maximum stays, the others are named as refused
    spiked[1, 0] = 1e3
    s = ClipScores(float(spiked.abs().max()))
    s.add(spiked, w)
    chosen = s.choice()
    assert chosen["fraction"] == 1.0 and len(chosen["refused"]) == len(FRACTIONS) - 1


def test_observer_equals_static_minmax_at_one_and_scales_by_the_fraction():
    """fraction 1 is llm-compressor's static_minmax bit for bit; 1/2 doubles the scale."""
    from llmcompressor.observers import Observer

    import fp4sense_llmcompressor  # noqa: F401

    x = torch.randn(4, 8, 64) * 3
    got = {}
    for name, fraction in (("static_minmax", None), ("fp4sense_input_clip", 1.0),
                           ("fp4sense_input_clip", 0.5)):
        args = to_quantization_scheme("NVFP4", ["Linear"]).input_activations
        kwargs = {} if fraction is None else {"fraction": fraction}
        obs = Observer.load_from_registry(name, base_name="input", args=args.model_copy(
            update={"observer": name, "observer_kwargs": kwargs}))
        obs(x[:2])
        obs(x[2:])
        got[(name, fraction)] = obs.get_global_scale()
    assert torch.equal(got[("fp4sense_input_clip", 1.0)], got[("static_minmax", None)])
    assert torch.equal(got[("fp4sense_input_clip", 0.5)], 2 * got[("static_minmax", None)])
    args = to_quantization_scheme("NVFP4", ["Linear"])
    with pytest.raises(InputClipError, match="fp4sense_input_clip"):
        Observer.load_from_registry("fp4sense_input_clip", base_name="input",
                                    args=args.input_activations.model_copy(update={
                                        "observer_kwargs": {"fraction": 2}}))
    with pytest.raises(ValueError, match="input_activations only"):
        Observer.load_from_registry("fp4sense_input_clip", base_name="weight",
                                    args=args.weights)


def test_plan_groups_units_by_fraction_and_refuses_a_bad_one(tmp_path):
    from fp4sense.planning.plan import Choice, Plan, PlanError

    def choice(block, fraction):
        return Choice(f"{block}:self_attn.o_proj", "NVFP4_ACLIP", 4.5, 64, 0.0,
                      (f"model.layers.{block}.self_attn.o_proj",), input_fraction=fraction)

    plan = Plan([choice(0, 1.0), choice(1, 0.5), choice(2, 0.5)], ["NVFP4_ACLIP"],
                {"budget_bits": 5.0}, "estimated", blocks_path="model.layers")
    groups = plan.config_groups()
    seen = {tuple(g.targets): g.input_activations.observer_kwargs["fraction"]
            for g in groups.values()}
    assert seen == {(r"re:^model\.layers\.(0)\.self_attn\.o_proj$",): 1.0,
                    (r"re:^model\.layers\.(1|2)\.self_attn\.o_proj$",): 0.5}
    assert {g.input_activations.observer for g in groups.values()} == {"fp4sense_input_clip"}
    assert Plan.load(plan.save(tmp_path / "plan.json")).choices == plan.choices
    d = json.loads((tmp_path / "plan.json").read_text())
    d["choices"][1]["input_fraction"] = 1.5
    (tmp_path / "plan.json").write_text(json.dumps(d))
    with pytest.raises(PlanError) as err:
        Plan.load(tmp_path / "plan.json")
    assert "1:self_attn.o_proj" in str(err.value) and "(0, 1]" in str(err.value)


def test_a_clipped_scheme_without_a_choice_is_refused():
    from fp4sense.numerics.fakequant import input_absmax

    assert input_absmax({"absmax": 8.0, "input_clip": {"fraction": 0.5}}, "NVFP4_ACLIP") == 4.0
    assert input_absmax({"absmax": 8.0, "input_clip": {"fraction": 0.5}}, "NVFP4") == 8.0
    with pytest.raises(ValueError, match="no tensor-scale fraction"):
        input_absmax({"absmax": 8.0}, "NVFP4_ACLIP")


def test_analysis_chooses_each_dense_input_once_and_plans_carry_it(tiny_llama):
    """The base pass's choice sits in every dense linear's statistics (a fused group's
    parts share it); where it is the maximum, the twin scores exactly as its plain scheme;
    the plan carries each unit's fraction."""
    from transformers import AutoModelForCausalLM

    from fp4sense.diagnosis import analyze
    from fp4sense.planning.milp import solve

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    windows = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    report = analyze(model, windows, schemes=["NVFP4", "NVFP4_ACLIP"], views=["grid"],
                     modes=["estimated"], progress=False, log=lambda m: None)
    for unit in report.units.units:
        chosen = [report.activation_stats[m]["input_clip"] for m in unit.modules]
        assert all(c == chosen[0] for c in chosen) and 0 < chosen[0]["fraction"] <= 1
    plain = report.unit_scores("NVFP4", "estimated")
    clipped = report.unit_scores("NVFP4_ACLIP", "estimated")
    at_max = [u.name for u in report.units.units
              if report.activation_stats[u.modules[0]]["input_clip"]["fraction"] == 1.0]
    assert at_max and all(clipped[u] == plain[u] for u in at_max)
    plan = solve(report, budget_bits=5.0, menu=["NVFP4_ACLIP"])
    assert {c.unit: c.input_fraction for c in plan.choices} == {
        u.name: report.activation_stats[u.modules[0]]["input_clip"]["fraction"]
        for u in report.units.units}


@pytest.mark.slow
def test_checkpoint_input_scales_follow_the_plan_and_a_foreign_plan_is_named(tiny_llama,
                                                                            tmp_path):
    """The plan's fractions reach the checkpoint: at 1 its input scales are a plain NVFP4
    oneshot's bit for bit, at 1/2 and 1/4 twice and four times them; config.json records
    the fractions, transformers loads it, and a plan.json whose fractions are not the
    checkpoint's is named."""
    import shutil

    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fp4sense.planning.plan import Plan
    from fp4sense.publishing.contents import recorded_files
    from fp4sense_llmcompressor import SensitivityGuidedModifier
    from helpers import calibration_dataset, oneshot_checkpoint

    def run(recipe, out):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
        oneshot(model=model, recipe=recipe, dataset=calibration_dataset(tiny_llama),
                num_calibration_samples=4, max_seq_length=64)
        model.save_pretrained(out, save_compressed=True)
        return load_file(out / "model.safetensors")

    solved = SensitivityGuidedModifier(budget_bits=5.0, menu=["NVFP4_ACLIP"],
                                       scale_search=False, analysis_windows=2,
                                       plan_path=str(tmp_path / "solved.json"))
    run([solved], tmp_path / "solved")
    plan = Plan.load(tmp_path / "solved.json")
    assert {c.scheme for c in plan.choices} == {"NVFP4_ACLIP"}
    fractions = {c.unit: (1.0 if i % 2 else 0.5 if i % 4 else 0.25)
                 for i, c in enumerate(plan.choices)}
    given = {}
    for name, table in (("max", dict.fromkeys(fractions, 1.0)), ("clipped", fractions)):
        plan.choices = [type(c)(**{**c.__dict__, "input_fraction": table[c.unit]})
                        for c in plan.choices]
        plan.save(tmp_path / f"{name}.json")
        given[name] = run([SensitivityGuidedModifier(plan=str(tmp_path / f"{name}.json"))],
                          tmp_path / name)
    plain = load_file(oneshot_checkpoint(tiny_llama, "NVFP4", tmp_path / "plain",
                                         dataset=calibration_dataset(tiny_llama))
                      / "model.safetensors")
    for c in plan.choices:
        for m in c.modules:
            key = f"{m}.input_global_scale"
            assert torch.equal(given["max"][key], plain[key]), m
            assert torch.equal(given["clipped"][key], plain[key] / fractions[c.unit]), m
    groups = json.loads((tmp_path / "clipped" / "config.json").read_text())[
        "quantization_config"]["config_groups"]
    assert sorted(g["input_activations"]["observer_kwargs"]["fraction"]
                  for g in groups.values()) == [0.25, 0.5, 1.0]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "clipped")
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    shutil.copy(tmp_path / "clipped.json", tmp_path / "clipped" / "plan.json")
    assert recorded_files(tmp_path / "clipped") == []
    shutil.copy(tmp_path / "max.json", tmp_path / "clipped" / "plan.json")
    problems = recorded_files(tmp_path / "clipped")
    assert len(problems) == 1 and "input tensor scale from 1 of the input maximum" in \
        problems[0] and "restore its plan.json" in problems[0]
