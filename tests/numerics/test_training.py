"""FP4 training numerics: MX operands bit for bit torchao's ``to_mx``; NVFP4 operands by
Transformer Engine's formulas (the 2.14 scale ordering, 2-D tiles, zero scales), their
1-D weight path against fp4sense's own inference NVFP4; stochastic rounding checked
statistically as TE checks it; TE's Hadamard transform; the emulated linear's three GEMMs
and a policy applied to several model families."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4sense.numerics.e2m1 import E2M1_VALUES
from fp4sense.numerics.training import (
    RECIPES,
    TE_RHT_SIGNS,
    Recipe,
    get_recipe,
    mx_quantize,
    nvfp4_quantize,
    register_recipe,
    rht,
    stochastic_e2m1,
)
from fp4sense.numerics.training_linear import (
    EmulatedLinear,
    GemmPrecision,
    apply_training_policy,
    emulated_linear,
    gemm_operands,
)
from fp4sense.validate import InputError, RegistryError

GRID = torch.tensor(sorted({v * s for v in E2M1_VALUES for s in (1, -1)}))


def _hard_operand(rows=64, cols=256, seed=0) -> torch.Tensor:
    """Normal values with outlier rows, an all-zero block, a tiny block, exact ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[3] *= 1e3
    x[5, :32] = 0
    x[7, 32:64] = 1e-30
    x[9, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    return x


# --- MX: torchao's to_mx is the oracle ------------------------------------------------
#: torchao 0.18, installed beside the test environment by `make setup` (not in it:
#: transformers imports torchao wherever it is installed)
ORACLES = Path(sys.prefix) / "oracles"
MX_CASES = [(element, mode, dtype) for element, mode in (("e2m1", "floor"), ("e4m3", "rceil"),
                                                         ("e4m3", "floor"), ("e2m1", "rceil"))
            for dtype in ("float32", "bfloat16")]
_ORACLE = """
import sys, torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
from torchao.prototype.mx_formats.mx_tensor import to_mx
x = torch.load(sys.argv[1])
out = {}
for element, mode, dtype in %r:
    elem = torch.float4_e2m1fn_x2 if element == "e2m1" else torch.float8_e4m3fn
    scale, data = to_mx(x.to(getattr(torch, dtype)), elem, 32, ScaleCalculationMode(mode))
    data = f4_unpacked_to_f32(unpack_uint4(data)) if element == "e2m1" else data.float()
    out[element, mode, dtype] = (scale.view(torch.uint8), data.reshape(x.shape))
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def torchao_mx(tmp_path_factory):
    """torchao's to_mx of the hard operand in every case, run in its own process."""
    assert (ORACLES / "torchao").is_dir(), f"torchao is not in {ORACLES}: run make setup"
    folder = tmp_path_factory.mktemp("oracle")
    torch.save(_hard_operand(), folder / "x.pt")
    env = {**os.environ, "PYTHONPATH": str(ORACLES)}
    proc = subprocess.run([sys.executable, "-c", _ORACLE % (MX_CASES,), str(folder / "x.pt"),
                           str(folder / "out.pt")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("element, mode, dtype", MX_CASES)
def test_mx_operands_are_torchaos_bit_for_bit(element, mode, dtype, torchao_mx):
    scale, data = torchao_mx[element, mode, dtype]
    ours = mx_quantize(_hard_operand().to(getattr(torch, dtype)), element, 32, mode)
    assert torch.equal(ours.scales, scale)
    assert torch.equal(ours.elements, data)


def test_the_mx_recipes_are_as_torchao_and_ocp_define_them():
    assert (RECIPES["mxfp4"].element, RECIPES["mxfp4"].block, RECIPES["mxfp4"].scale) == \
        ("e2m1", 32, "floor")
    assert (RECIPES["mxfp8"].element, RECIPES["mxfp8"].block, RECIPES["mxfp8"].scale) == \
        ("e4m3", 32, "rceil")
    nv = RECIPES["nvfp4"]  # TE NVFP4BlockScaling's defaults
    assert (nv.block, nv.rht, nv.stochastic_rounding, nv.weight_2d) == (16, True, True, True)


# --- NVFP4: Transformer Engine's formulas -------------------------------------------------
def test_nvfp4_scales_follow_te_2_14s_ordering():
    """s_b = e4m3(amax_b * (S_enc * fl(1/6))): block amaxes a few float32 steps from an
    E4M3 rounding midpoint, where TE before 2.14 ((amax_b / 6) * S_enc) rounds to the
    other E4M3 value, get the newer ordering's scale."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    near = ((e4m3[1:] + e4m3[:-1]) / 2) / 448.0  # tensor amax 1: S_enc = 2688
    candidates, up, down = [near], near.clone(), near.clone()
    for _ in range(8):
        up, down = torch.nextafter(up, torch.tensor(2.0)), torch.nextafter(down, torch.tensor(0.0))
        candidates += [up, down]
    block = torch.cat(candidates)
    block = block[(block > 0) & (block < 1)]
    new = (block * (2688.0 * torch.tensor(1 / 6))).to(torch.float8_e4m3fn).float()
    old = ((block / 6) * 2688.0).to(torch.float8_e4m3fn).float()
    assert (new != old).sum() >= 10  # the orderings do differ: the test tells them apart
    x = torch.zeros(len(block), 16)
    x[:, 0] = block
    x[0, 1] = 1.0  # the tensor amax
    scales = nvfp4_quantize(x).scales.float()[:, 0]
    assert torch.equal(scales[1:], new[1:]) and scales[0] == 448


def test_nvfp4_two_d_tiles_share_one_scale_and_zero_scales_dequantize_to_zero():
    x = _hard_operand(64, 64)
    q = nvfp4_quantize(x, tile_2d=True)
    tiles = q.scales.float().unflatten(0, (4, 16))  # (4 tile rows, 16 rows, 4 tile cols)
    assert torch.equal(tiles, tiles[:, :1].expand_as(tiles))
    # a 16x16 tile's scale is its amax's: the same as 1-D blocks of the tile's max
    amax = x.abs().amax()
    tile_amax = x.abs().unflatten(0, (4, 16)).unflatten(2, (4, 16)).amax((1, 3))
    expect = (tile_amax * ((2688.0 / amax) * torch.tensor(1 / 6))).clamp(max=448) \
        .to(torch.float8_e4m3fn).float()
    assert torch.equal(tiles[:, 0], expect)
    one_d = nvfp4_quantize(x)  # the tiny block's scale rounds to 0: codes saturate, value 0
    assert one_d.scales[7, 2].float() == 0 and torch.all(one_d.values[7, 32:48] == 0)
    assert torch.all(one_d.elements[7, 32:48].abs() == 6)
    zero = nvfp4_quantize(torch.zeros(16, 32))  # amax 0: S_enc 1, all zero
    assert torch.equal(zero.values, torch.zeros(16, 32)) and zero.amax == 0


def test_nvfp4_fprop_weight_path_is_fp4senses_inference_nvfp4():
    """1-D blocks (TE with 2-D off) against compressed-tensors' NVFP4 as fp4sense computes
    it: the same E4M3 block scales; the same codes but where the two orderings of the
    scale's reciprocal put a value on the other side of a rounding tie (one grid step)."""
    from fp4sense.numerics.formats import amax_block_scales, global_scale
    from fp4sense.numerics.fp4 import quantize_to_codes

    g = torch.Generator().manual_seed(0)
    total = mismatched = 0
    for _ in range(8):
        w = torch.randn(256, 512, generator=g) * torch.rand(256, 1, generator=g) * 3
        ours = nvfp4_quantize(w)
        gs = global_scale(w)
        scales = amax_block_scales(w, "nvfp4", gs)
        assert torch.equal(ours.scales.float(), scales.float())
        codes = quantize_to_codes(w, scales, "nvfp4", gs)
        table = torch.tensor(E2M1_VALUES)
        theirs = torch.where((codes & 8) != 0, -table[(codes & 7).long()],
                             table[(codes & 7).long()])
        off = ours.elements != theirs
        total, mismatched = total + w.numel(), mismatched + int(off.sum())
        steps = (torch.searchsorted(GRID, ours.elements[off]) -
                 torch.searchsorted(GRID, theirs[off])).abs()
        assert torch.all(steps == 1)
    assert mismatched <= total * 1e-5, (mismatched, total)


# --- stochastic rounding: statistically, as TE's test_nvfp4_sr_quantize does -------------
def test_stochastic_rounding_is_unbiased_and_beats_nearest_on_average():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4096, generator=g) * 12 - 6)
    draws = torch.stack([stochastic_e2m1(x, g) for _ in range(400)])
    assert torch.isin(draws, GRID).all()
    bias = (draws.mean(0) - x).abs()
    step = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0))
    assert (bias / step).mean() < 0.02  # 400 draws: sampling error about 0.025 step
    from fp4sense.numerics.e2m1 import round_to_e2m1
    rn = (round_to_e2m1(x) - x).pow(2).mean().sqrt()
    sr = (draws.mean(0) - x).pow(2).mean().sqrt()
    assert sr < rn
    again = stochastic_e2m1(x, torch.Generator().manual_seed(5))
    assert torch.equal(again, stochastic_e2m1(x, torch.Generator().manual_seed(5)))


# --- the Hadamard transform -----------------------------------------------------------
def test_the_hadamard_is_tes_fixed_sign_matrix_and_leaves_wgrad_unchanged():
    from fp4sense.numerics.training import _rht_matrix

    t = _rht_matrix("cpu")
    assert torch.equal(t @ t.T, torch.eye(16))  # orthogonal, exactly (±1/4 entries)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h16 = h2
    for _ in range(3):
        h16 = torch.kron(h16, h2)
    assert torch.equal(t, torch.tensor(TE_RHT_SIGNS, dtype=torch.float32)[:, None] * h16 / 4)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 40, generator=g), torch.randn(12, 40, generator=g)  # 40 tokens
    bf = a.bfloat16().float() @ b.bfloat16().float().T
    assert torch.allclose(rht(a) @ rht(b).T, bf, rtol=0.02, atol=0.05)


# --- the emulated linear -----------------------------------------------------------------
def _pair(seed=0, shape=(2, 48, 64), out=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out, shape[-1], generator=g) * 0.1
    return x, w


def test_bf16_gemms_are_plain_linear():
    x, w = _pair()
    bias = torch.randn(32)
    grads = []
    for fn in (lambda a, b, c: emulated_linear(a, b, c, "bf16"), torch.nn.functional.linear):
        a, b, c = (t.clone().requires_grad_() for t in (x, w, bias))
        y = fn(a, b, c)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads.append((y.detach(), a.grad, b.grad, c.grad))
    for ours, theirs in zip(*grads, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "mxfp8"])
def test_each_gemm_uses_its_quantized_operands(recipe):
    """fprop, dgrad and wgrad are the products of the operands the recipe quantizes (SR
    off, so the draw is not in the way); a GEMM left in BF16 is the plain product."""
    r = get_recipe(recipe).but(stochastic_rounding=False) if recipe == "nvfp4" else \
        get_recipe(recipe)
    x, w = _pair()
    dy = torch.randn(2, 48, 32)
    for gemms in ({"fprop": r, "dgrad": r, "wgrad": r}, {"dgrad": r}, {"wgrad": r}):
        p = GemmPrecision.of(gemms)
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = emulated_linear(a, b, None, p)
        y.backward(dy)
        x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 32)
        for gemm, got, plain in (("fprop", y.reshape(-1, 32), x2 @ w.T),
                                 ("dgrad", a.grad.reshape(-1, 64), dy2 @ w),
                                 ("wgrad", b.grad, dy2.T @ x2)):
            if gemm in gemms:
                qa, qb = gemm_operands(gemm, r, x2, w, dy2)
                assert torch.equal(got, qa @ qb.T), (recipe, gemm)
                assert not torch.equal(got, plain)
            else:
                assert torch.allclose(got, plain, rtol=1e-5, atol=1e-5), (recipe, gemm)


def test_nvfp4_dgrad_sees_the_fprop_weight_codes_transposed():
    r = get_recipe("nvfp4")
    x, w = _pair()
    dy = torch.randn(96, 32)
    _, w_fprop = gemm_operands("fprop", r, x.reshape(-1, 64), w)
    _, w_dgrad = gemm_operands("dgrad", r, x.reshape(-1, 64), w, dy)
    assert torch.equal(w_dgrad, w_fprop.T)
    one_d = r.but(weight_2d=False)  # TE's disable_2d_quantization: two 1-D copies
    _, w_dgrad = gemm_operands("dgrad", one_d, x.reshape(-1, 64), w, dy)
    assert not torch.equal(w_dgrad, gemm_operands("fprop", one_d, x.reshape(-1, 64), w)[1].T)


def test_nvfp4_gradients_are_close_and_seeded():
    x, w = _pair(shape=(4, 64, 128), out=64)
    grads = []
    for seed in (0, 0, 1):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = emulated_linear(a, b, None, "nvfp4", torch.Generator().manual_seed(seed))
        y.pow(2).sum().backward()
        grads.append(b.grad)
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.linear(a, b).pow(2).sum().backward()
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    cos = torch.nn.functional.cosine_similarity(grads[0].flatten(), b.grad.flatten(), 0)
    assert cos > 0.98


# --- policies on model families ------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral", "qwen3_moe"])
def test_a_policy_puts_each_gemm_on_each_linear_of_a_family(family):
    import transformers

    from families import COMMON, FAMILIES, MOE_FAMILIES

    model_cls, config_cls, overrides, _ = {**FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        **{**COMMON, **overrides}))
    params = list(model.parameters())
    chosen = apply_training_policy(model, {
        r"re:.*layers\.0\..*": "bf16",
        "model.layers.1.mlp.down_proj" if family != "qwen3_moe" else
        "model.layers.1.self_attn.o_proj": {"fprop": "nvfp4", "dgrad": "mxfp8"},
        "lm_head": "bf16"}, default="nvfp4", generator=torch.Generator().manual_seed(0))
    assert list(model.parameters()) == params  # the same Parameters: optimizers keep them
    assert all(isinstance(m, EmulatedLinear) for n, m in model.named_modules() if n in chosen)
    assert chosen["lm_head"].to_dict() == {g: "bf16" for g in ("fprop", "dgrad", "wgrad")}
    assert any(p.to_dict()["wgrad"] == "nvfp4" for n, p in chosen.items() if "layers.1" in n)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all()
                                        for n, p in model.named_parameters()
                                        if "layers.1" in n and p.dim() == 2
                                        and "experts" not in n)


def test_bad_policies_and_recipes_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(InputError, match="'mlp.nope' matches no linear"):
        apply_training_policy(model, {"mlp.nope": "nvfp4"})
    with pytest.raises(InputError, match="unknown training recipe 'nvfp5'"):
        apply_training_policy(model, {"0": "nvfp5"})
    with pytest.raises(InputError, match="unknown GEMM"):
        GemmPrecision.of({"fgrad": "nvfp4"})
    with pytest.raises(InputError, match="no knob"):
        get_recipe("nvfp4").but(hadamard=False)
    with pytest.raises(InputError, match="2-D weight tiles"):
        get_recipe("mxfp4").but(weight_2d=True)
    with pytest.raises(RegistryError, match="registered twice"):
        register_recipe(Recipe("nvfp4", "e2m1"))
