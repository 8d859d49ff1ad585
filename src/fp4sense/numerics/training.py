"""FP4 training numerics: how a training recipe quantizes the operands of a linear layer's
three GEMMs (fprop ``Y = X·Wᵀ``, dgrad ``dX = dY·W``, wgrad ``dW = dYᵀ·X``), as the
recipes define them; :mod:`fp4sense.numerics.training_linear` computes the GEMMs.

- ``nvfp4``: Transformer Engine's ``NVFP4BlockScaling`` (TE 2.14 and later). E2M1 in
  1×16 blocks along each GEMM's reduction dimension, so a tensor used in two GEMMs is
  quantized twice from high precision (rowwise and columnwise); an E4M3 block scale
  ``e4m3(amax_b · (S_enc · fl(1/6)))`` (round to nearest even, saturating at 448, no lower
  clamp) under the FP32 tensor scale ``S_enc = 6·448 / amax``; weights in 16×16 tiles, so
  dgrad sees exactly the transposed fprop codes; stochastic rounding for the gradient dY
  only (both its copies); the 16×16 Hadamard transform ``diag(s)·H16/4`` with TE's one
  fixed sign vector on both wgrad operands, along the tokens, its output rounded to
  BF16 (as TE's kernel does; TE requires a BF16 input, so the operand is rounded to BF16
  first). Each knob switches off as TE's ``disable_*`` fields do (:meth:`Recipe.but`).
- ``mxfp4``: the OCP MX rules with torchao's ``to_mx`` as the oracle: E2M1 in 1×32
  blocks along the reduction dimension, an E8M0 scale ``2^(floor(log2 amax) - 2)``
  (``ScaleCalculationMode.FLOOR``), round to nearest even; no tiles, no transform.
- ``mxfp8``: torchao 0.18's ``MXFP8TrainingOpConfig`` (its one MX training recipe): E4M3
  in 1×32 blocks, E8M0 scales by ``RCEIL``, round to nearest even.
- ``bf16``: the operands as they are (the compute dtype).

Sources (file and name) are cited in docs/training.md. Stochastic rounding follows TE's
software rule (8 random bits a value) and is checked statistically, as TE checks it: its
codes depend on the GPU's thread mapping and cannot be reproduced bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fp4sense.numerics.e2m1 import E2M1_MAX, round_to_e2m1
from fp4sense.numerics.formats import E4M3_MAX, E8M0_BIAS
from fp4sense.validate import InputError, register_unique

__all__ = ["GEMMS", "RECIPES", "TE_RHT_SIGNS", "Quantized", "Recipe", "get_recipe",
           "mx_quantize", "nvfp4_quantize", "register_recipe", "rht", "stochastic_e2m1"]

#: the three GEMMs of a linear layer's training step
GEMMS = ("fprop", "dgrad", "wgrad")
FLT_MAX = torch.finfo(torch.float32).max
#: the smallest normal float32, torchao's floor for an E8M0 scale of zero (FLOOR mode)
F32_MIN_NORMAL = 2.0 ** -126
#: TE's Hadamard size and its one fixed sign vector (nvfp4_tensor.py,
#: get_wgrad_sign_vector), shared by every layer for the whole run
RHT_SIZE = 16
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
#: TE's stochastic rounding draws 8 random bits a value (ptx.cuh)
SR_LEVELS = 256
#: element kinds: the largest value, and the exponent of its power of two (OCP MX emax)
_ELEMENTS = {"e2m1": (E2M1_MAX, 2), "e4m3": (E4M3_MAX, 8)}


@dataclass(frozen=True)
class Recipe:
    """One training recipe: how each GEMM operand of a linear is quantized."""

    name: str
    element: str | None  # "e2m1", "e4m3"; None: operands kept as they are (BF16)
    block: int = 16
    scale: str = "nvfp4"  # "nvfp4" (E4M3 block x FP32 tensor), "floor", "rceil" (E8M0)
    rht: bool = False  # 16x16 Hadamard on wgrad's operands, along the tokens
    stochastic_rounding: bool = False  # the gradient dY (dgrad and wgrad copies)
    weight_2d: bool = False  # 16x16 weight tiles: dgrad sees fprop's codes, transposed
    source: str = ""

    def but(self, **knobs) -> Recipe:
        """The recipe with knobs switched (``rht``, ``stochastic_rounding``, ``weight_2d``),
        as TE's ``disable_rht`` / ``disable_stochastic_rounding`` /
        ``disable_2d_quantization`` do."""
        unknown = set(knobs) - {"rht", "stochastic_rounding", "weight_2d"}
        if unknown:
            raise InputError(f"recipe {self.name}: no knob {sorted(unknown)}; the knobs are "
                             "rht, stochastic_rounding, weight_2d")
        if self.element is None and any(knobs.values()):
            raise InputError(f"recipe {self.name} quantizes nothing; it has no knobs")
        if knobs.get("weight_2d") and self.scale != "nvfp4":
            raise InputError(f"recipe {self.name}: 2-D weight tiles are NVFP4's (TE)")
        return dataclasses.replace(self, **knobs)

    def quantize(self, x: torch.Tensor, role: str, generator: torch.Generator | None = None,
                 tile: bool = False) -> torch.Tensor:
        """``x`` (rows, reduction) quantized in blocks along its last dimension and returned
        dequantized in float32; ``role``: "weight", "input" or "grad" (only a grad is
        rounded stochastically); ``tile``: a weight in 16×16 tiles."""
        if self.element is None:
            return x.float()
        sr = self.stochastic_rounding and role == "grad"
        if self.scale == "nvfp4":
            return nvfp4_quantize(x, tile_2d=tile, sr=sr, generator=generator).values
        return mx_quantize(x, self.element, self.block, self.scale, sr, generator).values


#: name -> recipe; filled by :func:`register_recipe`
RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    """Make a training recipe available by its name (a second one of a name is refused)."""
    register_unique(RECIPES, recipe.name, recipe, register_recipe, "training recipe")
    return recipe


def get_recipe(name: str | Recipe) -> Recipe:
    if isinstance(name, Recipe):
        return name
    try:
        return RECIPES[str(name).lower()]
    except KeyError:
        raise InputError(f"unknown training recipe {name!r}; known: "
                         f"{', '.join(sorted(RECIPES))}") from None


register_recipe(Recipe("nvfp4", "e2m1", 16, "nvfp4", rht=True, stochastic_rounding=True,
                       weight_2d=True, source="Transformer Engine NVFP4BlockScaling"))
register_recipe(Recipe("mxfp4", "e2m1", 32, "floor",
                       source="OCP MX v1.0; torchao to_mx (FLOOR)"))
register_recipe(Recipe("mxfp8", "e4m3", 32, "rceil",
                       source="torchao 0.18 MXFP8TrainingOpConfig (RCEIL)"))
register_recipe(Recipe("bf16", None, source="high precision"))


@dataclass
class Quantized:
    """A quantized operand: ``values`` (float32, dequantized, ``x``'s shape), the
    elements before scaling, the block scales as stored (float8_e4m3fn, or E8M0 biased
    exponents as uint8) and the tensor amax (NVFP4; what TE stores)."""

    values: torch.Tensor
    elements: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor | None = None


def _padded(x: torch.Tensor, block: int, rows: int = 1) -> torch.Tensor:
    """``x`` (float32, 2-D) with zero columns (rows) to whole blocks: a shorter last block,
    since zeros change no amax and no product."""
    pad_cols, pad_rows = -x.shape[1] % block, -x.shape[0] % rows
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows)) if pad_cols or pad_rows \
        else x


def _two_d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise InputError(f"{name}: a 2-D operand (rows, reduction), got shape "
                         f"{tuple(x.shape)}")
    return x.float()


def stochastic_e2m1(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """E2M1 with stochastic rounding (``|x| <= 6``), TE's software rule (ptx.cuh,
    ``stochastic_round_fp4_e2m1``): ``t = |x| + u·step(|x|)`` with ``u`` one of 256 levels
    in [0, 1), then ``floor(t / step(t))·step(t)``, at most 6; steps 0.5 below 2, 1 below
    4, 2 above. Unbiased inside the grid (to 1/512 of a step)."""
    a = x.abs()
    u = torch.randint(0, SR_LEVELS, x.shape, generator=generator, device=x.device)
    u = u.to(torch.float32) / SR_LEVELS

    def step(v):
        return torch.where(v < 2, 0.5, torch.where(v < 4, 1.0, 2.0))

    t = a + u * step(a)
    q = torch.clamp(torch.floor(t / step(t)) * step(t), max=E2M1_MAX)
    return torch.where(x < 0, -q, q)


def nvfp4_quantize(x: torch.Tensor, tile_2d: bool = False, sr: bool = False,
                   generator: torch.Generator | None = None) -> Quantized:
    """NVFP4 as Transformer Engine quantizes a GEMM operand (TE >= 2.14): ``x`` (rows,
    reduction) in 1×16 blocks along its last dimension (``tile_2d``: 16×16 tiles, a
    weight's), E4M3 block scales under the FP32 tensor scale, elements rounded to nearest
    even (``sr``: stochastically). All arithmetic in float32, as TE's."""
    x = _two_d(x, "nvfp4_quantize")
    rows, cols = x.shape
    padded = _padded(x, RHT_SIZE, RHT_SIZE if tile_2d else 1)
    amax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    s_enc = torch.clamp((E4M3_MAX * E2M1_MAX) / amax, max=FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    s_dec = 1.0 / s_enc
    blocks = padded.unflatten(1, (-1, RHT_SIZE))  # (R, C/16, 16)
    block_amax = blocks.abs().amax(-1)
    if tile_2d:  # one amax per 16 rows x 16 columns, every row of the tile
        block_amax = block_amax.unflatten(0, (-1, RHT_SIZE)).amax(1, keepdim=True)
        block_amax = block_amax.expand(-1, RHT_SIZE, -1).flatten(0, 1)
    sixth = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32, device=x.device)
    encoded = torch.clamp(block_amax * (s_enc * sixth), max=FLT_MAX)
    scales = torch.clamp(encoded, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    s_b = scales.float()
    e_b = torch.where(s_b == 0, FLT_MAX, torch.clamp(1.0 / (s_b * s_dec), max=FLT_MAX))
    scaled = torch.clamp(blocks * e_b.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    elements = stochastic_e2m1(scaled, generator) if sr else round_to_e2m1(scaled)
    values = elements * s_b.unsqueeze(-1) * s_dec
    return Quantized(values.flatten(1)[:rows, :cols], elements.flatten(1)[:rows, :cols],
                     scales[:rows], amax)


def mx_quantize(x: torch.Tensor, element: str = "e2m1", block: int = 32, mode: str = "floor",
                sr: bool = False, generator: torch.Generator | None = None) -> Quantized:
    """An MX operand as torchao's ``to_mx`` makes it (``mode`` "floor", the OCP rule, or
    "rceil", cuBLAS's): ``x`` (rows, reduction) in 1×``block`` blocks along its last
    dimension, E8M0 scales (biased exponents, uint8), elements E2M1 or E4M3 rounded to
    nearest even (``sr``: E2M1 stochastically)."""
    x = _two_d(x, "mx_quantize")
    rows, cols = x.shape
    if element not in _ELEMENTS or mode not in ("floor", "rceil"):
        raise InputError(f"mx_quantize: element e2m1|e4m3 and mode floor|rceil, got "
                         f"{element!r}, {mode!r}")
    max_pos, emax = _ELEMENTS[element]
    blocks = _padded(x, block).unflatten(1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    if mode == "floor":  # the exponent bits of amax, less the element's emax
        exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS - emax
        biased = (torch.clamp(exponent, -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS)
        biased = torch.where(torch.isnan(amax), 255, biased).to(torch.uint8)
        step = torch.clamp((biased.to(torch.int32) << 23).view(torch.float32),
                           min=F32_MIN_NORMAL)
        data = blocks / step
    else:  # RCEIL: ceil(log2(amax / max)), torchao's fallback (NaN 255, Inf 254)
        descale = amax / max_pos
        biased = torch.where(torch.isnan(descale), 255, torch.where(
            torch.isinf(descale), 254,
            torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
        )).to(torch.uint8)
        b = biased.to(torch.float32)
        reciprocal = torch.where(b == 254, 2.0 ** -127, torch.where(
            b == 0, 1.0, torch.exp2(E8M0_BIAS - b)))
        data = blocks * reciprocal
    data = torch.clamp(data, -max_pos, max_pos)
    if element == "e4m3":
        elements = data.to(torch.float8_e4m3fn).float()
    else:
        elements = stochastic_e2m1(data, generator) if sr else round_to_e2m1(data)
    values = elements * torch.exp2(biased.to(torch.float32) - E8M0_BIAS)
    return Quantized(values.flatten(1)[:rows, :cols], elements.flatten(1)[:rows, :cols],
                     biased.squeeze(-1)[:rows])


def rht(x: torch.Tensor) -> torch.Tensor:
    """TE's random Hadamard transform of a wgrad operand: ``x`` (rows, tokens) rounded to
    BF16, times ``diag(s)·H16/4`` in tiles of 16 tokens (zero tokens pad the last), the
    result rounded to BF16 and returned in float32 with the padding. Orthogonal: the
    transformed wgrad operands' product is the untransformed one's."""
    x = _padded(_two_d(x, "rht"), RHT_SIZE).to(torch.bfloat16).float()
    return (x.unflatten(1, (-1, RHT_SIZE)) @ _rht_matrix(x.device)).flatten(1) \
        .to(torch.bfloat16).float()


def _rht_matrix(device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < RHT_SIZE:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(TE_RHT_SIGNS, dtype=torch.float32)
    return (signs.unsqueeze(1) * h / 4).to(torch.bfloat16).float().to(device)
