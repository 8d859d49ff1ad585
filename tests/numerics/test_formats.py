"""FP4 numerics, bit for bit against compressed-tensors (installed version, 0.19 here)."""

from __future__ import annotations

import pytest
import torch

from ct_reference import as_bytes, reference, reference_global_scale, same_bits, special_weights
from fp4sense.numerics import e2m1, fp4
from fp4sense.numerics import formats as F

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FORMATS = ["nvfp4", "mxfp4"]
SHAPES = [(16, 64), (33, 96), (576, 1536), (1, 32)]


def assert_matches_reference(weight: torch.Tensor, fmt: str, global_scale=None) -> None:
    expected, fake, decompressed = reference(weight, fmt, global_scale)
    ours = fp4.compress(weight, fmt, global_scale)
    assert sorted(ours) == sorted(expected)
    for key in expected:
        assert same_bits(as_bytes(ours[key]), as_bytes(expected[key])), key
    # our fake quantization == compressed-tensors' fake_quantize (weight dtype)
    assert same_bits(fp4.quantize_dequantize(weight, fmt, global_scale), fake)
    # our decompression of *their* bytes == their decompressor (bf16)
    assert same_bits(fp4.decompress(expected, fmt, torch.bfloat16), decompressed)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_tensors_match_compressed_tensors(fmt, dtype, shape):
    if shape[1] % F.get_format(fmt).block_size:
        pytest.skip("not a multiple of the block size")
    g = torch.Generator().manual_seed(hash((fmt, shape)) % 2**31)
    weight = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g)).to(dtype)
    assert_matches_reference(weight, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_cases_match_compressed_tensors(fmt, dtype):
    block = F.get_format(fmt).block_size
    for name, weight in special_weights(dtype, block):
        try:
            assert_matches_reference(weight, fmt)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from exc


def test_each_e2m1_code_round_trips():
    """Every one of the 16 codes encodes, packs, unpacks and decodes to its value."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 2)  # (2, 32)
    unpacked = e2m1.unpack_codes(e2m1.pack_codes(codes))
    assert torch.equal(unpacked, codes)
    packed = e2m1.pack_codes(codes)
    assert packed[0, 0].item() == 0x10  # code 0 in the low nibble, code 1 in the high
    values = fp4.dequantize_codes(codes, torch.zeros(2, 1, dtype=torch.uint8) + F.E8M0_BIAS,
                                "mxfp4")
    expected = torch.tensor(e2m1.E2M1_VALUES + tuple(-v for v in e2m1.E2M1_VALUES)).repeat(2, 2)
    assert same_bits(values, expected.to(torch.float32))


def test_rounding_ties_go_to_even_code():
    scale = torch.full((1, 1), F.E8M0_BIAS, dtype=torch.uint8)  # step 1.0
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4])
    codes = fp4.quantize_to_codes(x, scale, "mxfp4")[0, :8].tolist()
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7]
    neg = fp4.quantize_to_codes(-x, scale, "mxfp4")[0, :8].tolist()
    assert neg == [c | e2m1.E2M1_SIGN_BIT for c in codes]  # -0.25 -> -0 keeps its sign


def test_smollm2_every_linear_matches(smollm2_state):
    """All 210 linears of the bundled model, fused global scales, both formats."""
    groups = [("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
              ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",))]
    checked = 0
    for layer in range(30):
        for parent, parts in groups:
            names = [f"model.layers.{layer}.{parent}.{p}.weight" for p in parts]
            weights = [smollm2_state[n] for n in names]
            gs = reference_global_scale(*weights)
            assert same_bits(F.global_scale(*weights), gs)
            for name, weight in zip(names, weights, strict=True):
                for fmt in FORMATS:
                    expected, _, _ = reference(weight, fmt, gs if fmt == "nvfp4" else None)
                    ours = fp4.compress(weight, fmt, gs if fmt == "nvfp4" else None, name=name)
                    for key in expected:
                        assert same_bits(as_bytes(ours[key]), as_bytes(expected[key])), (name, key)
                checked += 1
    assert checked == 210


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_named(bad):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(F.FormatError, match=r"model\.layers\.3\.mlp\.up_proj.*NaN/Inf"):
        fp4.compress(w, "nvfp4", name="model.layers.3.mlp.up_proj")


def test_indivisible_input_dimension_names_layer_and_block():
    w = torch.randn(4, 48)
    with pytest.raises(F.FormatError, match=r"lm_head.*48.*MXFP4 block size 32"):
        fp4.compress(w, "mxfp4", name="lm_head")
    fp4.compress(w, "nvfp4")  # 48 = 3 x 16 is fine for NVFP4


def test_unknown_format_lists_choices():
    with pytest.raises(F.FormatError, match=r"mxfp4.*nvfp4"):
        F.get_format("fp3")


def test_decompress_names_missing_tensor():
    t = fp4.compress(torch.randn(4, 32), "nvfp4")
    del t["weight_global_scale"]
    with pytest.raises(F.FormatError, match="weight_global_scale"):
        fp4.decompress(t, "nvfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_fake_quant_matches_compressed_tensors_dynamic_mxfp4(dtype):
    """What vLLM's W4A4 MXFP4 (our CPU kernel) does to inputs == compressed-tensors' own."""
    from compressed_tensors.quantization import QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    args = preset_name_to_scheme("MXFP4", ["Linear"]).input_activations
    module = torch.nn.Linear(64, 4)
    module.quantization_status = QuantizationStatus.FROZEN
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 2, 64)).to(dtype)
    x[0, 0, :32] = 0
    expected = forward_quantize(module, x, "input", args)
    assert same_bits(fp4.quantize_dequantize_activations(x, "mxfp4"), expected)
