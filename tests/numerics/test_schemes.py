"""The scheme menu, its registration with compressed-tensors / llm-compressor, bit accounting."""

from __future__ import annotations

import json

import pytest

from ct_reference import COMPRESSOR, as_bytes, same_bits
from fp4sense.numerics import formats as F
from fp4sense.numerics import fp4
from fp4sense.numerics.schemes import (
    MENU,
    SchemeError,
    bits_per_weight,
    get_scheme,
    to_quantization_scheme,
)
from helpers import calibration_dataset, oneshot_checkpoint

EXPECTED_MENU = {"NVFP4", "NVFP4A16", "MXFP4", "MXFP4A16", "FP8_DYNAMIC", "INT8", "INT4", "BF16"}


def test_menu_has_the_issue_schemes_and_search_variants():
    assert EXPECTED_MENU <= set(MENU)
    assert {s.name for s in MENU.values() if s.scale_search and not s.rotation
            and not s.input_clip} == {
        "NVFP4_SEARCH", "NVFP4A16_SEARCH", "MXFP4_SEARCH", "MXFP4A16_SEARCH"}


def test_unknown_scheme_lists_the_menu():
    with pytest.raises(SchemeError) as info:
        get_scheme("NVFP3")
    for name in EXPECTED_MENU:
        assert name in str(info.value)


def test_theoretical_bits():
    shape = (4096, 4096)
    assert bits_per_weight("NVFP4A16", shape) == pytest.approx(4.5, abs=1e-5)
    assert bits_per_weight("MXFP4", shape) == 4.25
    assert bits_per_weight("BF16", shape) == 16
    assert bits_per_weight("FP8_DYNAMIC", shape) == pytest.approx(8.0, abs=0.01)
    assert bits_per_weight("INT4", shape) == pytest.approx(4.125, abs=1e-4)


def test_presets_registered_for_quantization_modifier():
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import fp4sense_llmcompressor  # noqa: F401  (registers presets and the observer)

    for name, scheme in MENU.items():
        # a rotation is a transform_config, an input clip's fraction the plan's unit by
        # unit: neither is a preset, ever
        if scheme.rotation or scheme.input_clip:
            assert name not in PRESET_SCHEMES, name
            continue
        if scheme.preset is None:
            continue
        mod = QuantizationModifier(targets=["Linear"], scheme=name)
        resolved = mod.resolve_quantization_config().config_groups["group_0"]
        expected = to_quantization_scheme(name, ["Linear"])
        # the modifier fills in its default observer where the preset names none
        assert resolved.weights.model_dump(exclude={"observer"}) == \
            expected.weights.model_dump(exclude={"observer"}), name
        assert resolved.weights.observer == (expected.weights.observer or "memoryless_minmax")
        if scheme.scale_search:
            assert resolved.weights.observer == "fp4sense_scale_search"
        assert (resolved.input_activations is None) == (expected.input_activations is None)


def _linear_shape(tensors: dict, linear: str) -> tuple[int, int]:
    """(out, in) of a stored linear, whatever its format."""
    if f"{linear}.weight_shape" in tensors:  # pack-quantized INT4
        return tuple(tensors[f"{linear}.weight_shape"].tolist())
    if f"{linear}.weight_packed" in tensors:  # two FP4 codes per byte
        packed = tensors[f"{linear}.weight_packed"]
        return packed.shape[0], packed.shape[1] * 2
    return tuple(tensors[f"{linear}.weight"].shape)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [s for s, v in MENU.items()
                                    if v.quantizes and not v.rotation and not v.input_clip])
def test_bit_accounting_equals_written_bytes(scheme, tiny_llama, tmp_path):
    """bits_per_weight() == bytes compressed-tensors writes for each linear, every preset
    scheme (a rotated one's: its plain scheme's plus the stored matrix, test_rotation; an
    input clip's: its plain scheme's, test_input_clip)."""
    from safetensors import safe_open

    out = oneshot_checkpoint(tiny_llama, scheme, tmp_path / scheme,
                             dataset=calibration_dataset(tiny_llama))
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    linears = sorted({k.rsplit(".", 1)[0] for k in tensors if ".layers." in k and "proj" in k})
    assert len(linears) == 14
    for linear in linears:
        own = [k for k in tensors if k.rsplit(".", 1)[0] == linear]
        stored = sum(tensors[k].numel() * tensors[k].element_size() for k in own)
        shape = _linear_shape(tensors, linear)
        n = shape[0] * shape[1]
        assert stored * 8 / n == pytest.approx(bits_per_weight(scheme, shape), rel=1e-12), (
            linear, own)
    fmt = json.loads((out / "config.json").read_text())["quantization_config"]["format"]
    assert fmt != "dense"


@pytest.mark.slow
@pytest.mark.parametrize("scheme,fmt", [("NVFP4A16", "nvfp4"), ("MXFP4A16", "mxfp4")])
def test_llmcompressor_checkpoint_bytes_match_ours(scheme, fmt, assets, smollm2_state, tmp_path):
    """What llm-compressor 0.14 writes for SmolLM2 (bf16, default observer) == compress()."""
    from safetensors.torch import load_file

    out = oneshot_checkpoint(assets["model"], scheme, tmp_path / scheme)
    written = load_file(out / "model.safetensors")
    fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
             "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
             "up_proj": ("gate_proj", "up_proj")}
    count = 0
    for key in [k for k in written if k.endswith(".weight_packed")]:
        linear = key[: -len(".weight_packed")]
        parent, proj = linear.rsplit(".", 1)
        group = [smollm2_state[f"{parent}.{p}.weight"] for p in fused.get(proj, (proj,))]
        gs = F.global_scale(*group) if fmt == "nvfp4" else None
        ours = fp4.compress(smollm2_state[f"{linear}.weight"], fmt, gs, name=linear)
        for k, v in ours.items():
            assert same_bits(as_bytes(v), as_bytes(written[f"{linear}.{k}"])), (linear, k)
        # our decompression of the written bytes == compressed-tensors' decompressor
        theirs = {k: written[f"{linear}.{k}"] for k in ours}
        scheme_obj = to_quantization_scheme(scheme, ["Linear"])
        decompressed = COMPRESSOR[fmt].decompress(dict(theirs), scheme_obj)["weight"]
        assert same_bits(fp4.decompress(theirs, fmt), decompressed)
        count += 1
    assert count == 210
