"""In-memory fake quantization equals what llm-compressor writes and compressed-tensors
reads back, bit for bit, for every scheme of the menu."""

from __future__ import annotations

import pytest
import torch

from fp4sense.numerics import fakequant
from fp4sense.numerics.fakequant import activation_quantizer, quantize_weights
from fp4sense.numerics.schemes import MENU

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _groups(block: str) -> list[list[str]]:
    attn, mlp = f"{block}.self_attn", f"{block}.mlp"
    return [[f"{attn}.{p}" for p in FUSED[0]], [f"{mlp}.{p}" for p in FUSED[1]],
            [f"{attn}.o_proj"], [f"{mlp}.down_proj"]]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "FP8_DYNAMIC", "INT8", "INT4"])
def test_weights_equal_the_decompressed_checkpoint(scheme, tiny_llama, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from helpers import calibration_dataset, oneshot_checkpoint

    data = calibration_dataset(tiny_llama) if MENU[scheme].activations else None
    ck = oneshot_checkpoint(tiny_llama, scheme, tmp_path / scheme, dataset=data)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    served = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    served(input_ids=torch.tensor([[1, 2]]))  # the first forward decompresses
    base_w = {n: m.weight for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    served_w = {n: m.weight for n, m in served.named_modules()
                if isinstance(m, torch.nn.Linear)}
    checked = 0
    monkeypatch.setattr(fakequant, "ROW_SLICE_ELEMENTS", 3 * 128)  # a few rows at a time
    for block in ("model.layers.0", "model.layers.1"):
        for names in _groups(block):
            ours = quantize_weights(scheme, [base_w[n].float() for n in names])
            for name, w in zip(names, ours, strict=True):
                assert torch.equal(w.to(torch.bfloat16), served_w[name].data), (scheme, name)
                checked += 1
    assert checked == 14


@pytest.mark.parametrize("scheme", [n for n, s in MENU.items() if s.quantizes])
def test_quantizing_a_slice_of_rows_at_a_time_gives_the_whole_tensors_bits(scheme,
                                                                             monkeypatch):
    """Weights are quantized a slice of rows at a time (memory): the same bits as the
    whole tensor at once, for every scheme, searched scales and a fused group included."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(rows, 256, generator=gen) * 0.02 for rows in (301, 64)]
    ws[0][5, 7] = 0.9  # an outlier: the NVFP4 global scale is the whole group's
    imps = [torch.rand(256, generator=gen) for _ in ws]
    monkeypatch.setattr(fakequant, "ROW_SLICE_ELEMENTS", 1 << 40)
    whole = quantize_weights(scheme, ws, importance=imps)
    monkeypatch.setattr(fakequant, "ROW_SLICE_ELEMENTS", 7 * 256)  # 7 rows, uneven end
    sliced = quantize_weights(scheme, ws, importance=imps)
    assert all(a.dtype == torch.float32 and torch.equal(a, b)
               for a, b in zip(whole, sliced, strict=True))
    assert not torch.equal(whole[0], ws[0])
    # one part of the group alone (what a streamed run quantizes when a block loads):
    # the same bits, its global scale still the group's (the outlier is in the other)
    alone = quantize_weights(scheme, ws, importance=imps, only=1)
    assert len(alone) == 1 and torch.equal(alone[0], whole[1])


def test_activation_quantizer_kinds_and_needs():
    x = torch.randn(3, 5, 64) * 3
    assert activation_quantizer("NVFP4A16") is None
    with pytest.raises(ValueError, match="absolute maximum"):
        activation_quantizer("NVFP4")
    nv = activation_quantizer("NVFP4", input_amax=float(x.abs().max()))
    y = nv(x)
    assert y.shape == x.shape and not torch.equal(y, x)
    assert (y - x).abs().max() < 0.5 * x.abs().max()
    fp8 = activation_quantizer("FP8_DYNAMIC")(x)
    assert (fp8 - x).abs().max() < 0.07 * x.abs().max()


def test_e2m1_rounding_equals_compressed_tensors_on_every_boundary():
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    grid = torch.arange(-6.0, 6.0 + 1e-9, 1 / 64)  # every tie and boundary, both signs
    x = torch.cat([grid, (torch.randn(100_000) * 3).clamp(-6, 6)])
    from fp4sense.numerics.e2m1 import round_to_e2m1

    assert torch.equal(round_to_e2m1(x), cast_to_fp4(x.clone()))
    # and the codes it stores name those values, sign of zero included
    from fp4sense.numerics.e2m1 import E2M1_SIGN_BIT, E2M1_VALUES, e2m1_codes

    codes = e2m1_codes(round_to_e2m1(x), x < 0)
    table = torch.tensor(E2M1_VALUES)
    decoded = table[(codes & 7).long()] * torch.where(codes & E2M1_SIGN_BIT > 0, -1.0, 1.0)
    assert torch.equal(decoded, round_to_e2m1(x))


@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4", "FP8_DYNAMIC", "INT8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantizer_equals_compressed_tensors_forward_quantize(scheme, dtype):
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.utils import generate_gparam

    from fp4sense.numerics.schemes import to_quantization_scheme

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 33, 128, generator=g) * torch.logspace(-3, 2, 128)).to(dtype)
    x[0, 0, :16] = 0  # an all-zero block
    amax = float(x.abs().max())
    ref_module = torch.nn.Module()
    ref_module.quantization_status = QuantizationStatus.FROZEN
    if scheme == "NVFP4":
        t = torch.tensor(amax)
        ref_module.input_global_scale = generate_gparam(-t, t)
    args = to_quantization_scheme(scheme, ["Linear"]).input_activations
    expected = forward_quantize(ref_module, x.clone(), "input", args)
    assert torch.equal(activation_quantizer(scheme, amax)(x), expected)


@pytest.mark.parametrize("scheme", sorted(s for s in MENU if MENU[s].activations is not None))
def test_activation_quantizer_follows_its_inputs_device(scheme):
    """The quantizer's own tensors (the static global scale, the rotation) go to the
    input's device: a GPU model's inputs met a CPU global scale (the first GPU run). The
    meta device stands in for a GPU here: a CPU tensor meeting it raises as CUDA does."""
    x = torch.randn(4, 128, device="meta")
    assert activation_quantizer(scheme, input_amax=3.0)(x).device == x.device
