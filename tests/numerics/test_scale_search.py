"""The error-minimizing FP4 schemes: never worse than amax, standard storage, observer."""

from __future__ import annotations

import json

import pytest
import torch

from fp4sense.numerics import formats as F
from fp4sense.numerics import fp4
from fp4sense.numerics.scale_search import block_errors, search_block_scales

FORMATS = ["nvfp4", "mxfp4"]


def _amax_and_search_errors(weight, fmt, importance=None):
    gs = F.global_scale(weight) if fmt == "nvfp4" else None
    amax = F.amax_block_scales(weight, fmt, gs)
    searched = search_block_scales(weight, fmt, gs, importance)
    return (block_errors(weight, amax, fmt, gs, importance),
            block_errors(weight, searched, fmt, gs, importance), searched, gs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_never_higher_mse_than_amax_on_any_block(fmt, dtype):
    g = torch.Generator().manual_seed(3)
    for dist in ("normal", "heavy", "uniform"):
        w = torch.randn(64, 256, generator=g)
        if dist == "heavy":
            w = w * torch.rand(64, 256, generator=g).pow(4) * 10
        elif dist == "uniform":
            w = torch.rand(64, 256, generator=g) - 0.5
        err_amax, err_search, _, _ = _amax_and_search_errors(w.to(dtype), fmt)
        assert bool((err_search <= err_amax).all()), dist
        assert float(err_search.sum()) < float(err_amax.sum())  # and it does help overall


@pytest.mark.parametrize("fmt", FORMATS)
def test_smollm2_linears_never_worse(fmt, smollm2_state):
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.layers.14.mlp.up_proj.weight"):
        err_amax, err_search, _, _ = _amax_and_search_errors(smollm2_state[name], fmt)
        assert bool((err_search <= err_amax).all()), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_importance_weighted_error_never_worse(fmt):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 128, generator=g)
    importance = torch.rand(128, generator=g).pow(3) * 5
    err_amax, err_search, _, _ = _amax_and_search_errors(w, fmt, importance)
    assert bool((err_search <= err_amax).all())


def test_zero_blocks_keep_amax_scale():
    w = torch.zeros(4, 64)
    gs = F.global_scale(w)
    assert same_scales(search_block_scales(w, "nvfp4", gs), F.amax_block_scales(w, "nvfp4", gs))


def same_scales(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_bad_importance_is_refused():
    with pytest.raises(ValueError, match="input channels"):
        search_block_scales(torch.randn(4, 32), "mxfp4", importance=torch.ones(16))


def test_searched_scales_store_in_standard_format():
    """Searched tensors decompress with compressed-tensors' own NVFP4 compressor."""
    from ct_reference import COMPRESSOR
    from fp4sense.numerics.schemes import to_quantization_scheme

    w = torch.randn(16, 64, dtype=torch.bfloat16)
    _, _, searched, gs = _amax_and_search_errors(w, "nvfp4")
    ours = fp4.compress(w, "nvfp4", gs, scales=searched)
    scheme = to_quantization_scheme("NVFP4A16_SEARCH", ["Linear"])
    theirs = COMPRESSOR["nvfp4"].decompress(dict(ours), scheme)["weight"]
    assert torch.equal(theirs, fp4.decompress(ours, "nvfp4"))


@pytest.mark.parametrize("fmt,scheme", [("nvfp4", "NVFP4A16_SEARCH"), ("mxfp4", "MXFP4A16_SEARCH")])
def test_observer_uses_calibration_importance(fmt, scheme):
    """The llm-compressor observer == search_block_scales(weight, E[x^2] of its inputs)."""
    from llmcompressor.observers import Observer

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.numerics.schemes import to_quantization_scheme

    args = to_quantization_scheme(scheme, ["Linear"]).weights
    linear = torch.nn.Linear(64, 8, bias=False)
    obs = Observer.load_from_registry(args.observer, base_name="weight", args=args)
    obs.attach(linear)
    x = torch.randn(3, 5, 64) * torch.linspace(0.1, 4, 64)
    linear(x)
    obs(linear.weight)
    qparams = obs.get_qparams()
    importance = x.reshape(-1, 64).square().mean(0)
    gs = F.global_scale(linear.weight) if fmt == "nvfp4" else None
    if fmt == "nvfp4":
        assert torch.equal(qparams["global_scale"], gs)
    expected = search_block_scales(linear.weight.detach(), fmt, gs, importance)
    assert torch.equal(qparams["scale"], F.decode_scales(expected, fmt).to(torch.float32)
                       if fmt == "mxfp4" else expected.to(torch.float32))
    obs.detach(linear)


@pytest.mark.slow
def test_search_scheme_checkpoint_is_standard_and_never_worse(tiny_llama, tmp_path):
    """A data-free NVFP4A16_SEARCH oneshot writes plain nvfp4-pack-quantized tensors whose
    every block has no more weight error than the amax choice."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers import oneshot_checkpoint

    out = oneshot_checkpoint(tiny_llama, "NVFP4A16_SEARCH", tmp_path / "ck")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "nvfp4-pack-quantized"
    written = load_file(out / "model.safetensors")
    base = load_file(tiny_llama / "model.safetensors")
    changed = 0
    for key in [k for k in written if k.endswith(".weight_packed")]:
        linear = key[: -len(".weight_packed")]
        tensors = {k: written[f"{linear}.{k}"] for k in
                   ("weight_packed", "weight_scale", "weight_global_scale")}
        w = base[f"{linear}.weight"]
        amax = fp4.compress(w, "nvfp4", tensors["weight_global_scale"])
        e_search = (fp4.decompress(tensors, "nvfp4", torch.float32) - w.float()).square()
        e_amax = (fp4.decompress(amax, "nvfp4", torch.float32) - w.float()).square()
        blocks = lambda e: e.unflatten(-1, (-1, 16)).sum(-1)  # noqa: E731
        assert bool((blocks(e_search) <= blocks(e_amax)).all()), linear
        changed += int((tensors["weight_scale"].view(torch.uint8)
                        != amax["weight_scale"].view(torch.uint8)).sum())
    assert changed > 0
    # fp4sense's fake quantization of the search scheme (what the analysis scores) is the
    # checkpoint, bit for bit: fused parts share the global scale, no data -> weight MSE
    from fp4sense.structure.units import find_units, quantize_unit

    base_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    modules = dict(base_model.named_modules())
    for unit in find_units(base_model).units:
        fake = quantize_unit("NVFP4A16_SEARCH", unit,
                             [modules[m].weight.data for m in unit.modules])
        for m, q in zip(unit.modules, fake, strict=True):
            tensors = {k: written[f"{m}.{k}"] for k in
                       ("weight_packed", "weight_scale", "weight_global_scale")}
            assert torch.equal(fp4.decompress(tensors, "nvfp4", torch.bfloat16), q), m
    # and plain transformers loads it (compressed-tensors decompression, no fp4sense)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()


def test_analysis_scores_search_schemes_with_input_importance(tiny_llama):
    """The analysis's base pass keeps each linear's E[x^2] per input channel, and the
    ``*_SEARCH`` schemes' fake quantization searches block scales weighted by it (what
    the observer does with calibration data); the searched weights score lower."""

    from fp4sense.numerics.fakequant import quantize_weights
    from helpers import base_pass_inputs

    name = "model.layers.1.mlp.down_proj"
    run, units, inputs = base_pass_inputs(tiny_llama, name)
    expected = inputs.square().mean(0)
    assert torch.allclose(run.importance[name], expected, rtol=1e-5)
    unit = next(u for u in units.units if name in u.modules)
    w = run.original[name]
    searched = run.quantized(unit, "NVFP4A16_SEARCH")[unit.modules.index(name)]
    # quantized in the dtype the model computes in (the one the oneshot calibrates in),
    # kept in bf16 as transformers and vLLM dequantize them
    assert torch.equal(searched, quantize_weights(
        "NVFP4A16_SEARCH", [w], dtype=w.dtype, importance=[expected],
        out_dtype=torch.bfloat16)[0].to(w.dtype))
    scores = run.estimate(["NVFP4A16", "NVFP4A16_SEARCH"], streamed=False)
    plain = sum(sum(v) for (m, s), v in scores.items() if s == "NVFP4A16")
    search = sum(sum(v) for (m, s), v in scores.items() if s == "NVFP4A16_SEARCH")
    assert 0 < search < plain


def test_search_twins_follow_their_plain_schemes():
    from fp4sense.numerics.schemes import with_search_twins

    assert with_search_twins(["nvfp4", "FP8_DYNAMIC", "BF16"]) == [
        "NVFP4", "NVFP4_SEARCH", "FP8_DYNAMIC", "BF16"]
    assert with_search_twins(["MXFP4A16_SEARCH", "MXFP4A16", "INT4"]) == [
        "MXFP4A16_SEARCH", "MXFP4A16", "INT4"]


@pytest.mark.parametrize("scheme", ["NVFP4_SEARCH", "MXFP4A16_SEARCH"])
def test_searched_scales_once_then_reused_quantize_the_same(scheme):
    """The scales a search picks, given back to quantize_weights, give the weights the
    search gives (bit for bit): training keeps scales between searches this way."""
    from fp4sense.numerics.fakequant import quantize_weights, searched_scales

    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(32, 64, generator=gen), 3 * torch.randn(16, 64, generator=gen)]
    imps = [torch.rand(64, generator=gen) + 0.1, None]
    scales = searched_scales(scheme, ws, importance=imps)
    again = quantize_weights(scheme, ws, importance=imps, block_scales=scales)
    direct = quantize_weights(scheme, ws, importance=imps)
    assert all(torch.equal(a, b) for a, b in zip(again, direct, strict=True))
    with pytest.raises(ValueError, match="NVFP4 does not search"):
        searched_scales("NVFP4", ws)
