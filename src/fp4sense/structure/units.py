"""Decoder blocks, units and fused groups of any Hugging Face decoder-only model.

Found from the module structure, not from one family's names:

- the decoder blocks are the longest ``nn.ModuleList`` whose items all hold linears;
- a *fused group* is the set of linears of one block that read the very same input
  tensor in a forward pass (q/k/v after the attention norm, gate/up after the MLP norm,
  whatever the family calls them) - exactly what vLLM fuses into one matmul;
- every other linear of a block is a unit of its own. Linears outside the blocks
  (lm_head, embeddings' projections) are never quantized (protocol.md).

A *kind* names a unit's place inside its block (``self_attn.q_proj+k_proj+v_proj``,
``mlp.down_proj``); the component view groups units by kind across blocks.

Mixture-of-Experts blocks (experts as per-expert linears, :mod:`fp4sense.inputs.moe`):

- the routed experts of a block - an ``nn.ModuleList`` whose children hold linears of
  one structure - are **one unit** (``mlp.experts``): vLLM's fused-MoE layer takes one
  scheme for all projections of all experts. Inside it, each expert's fused group
  (gate/up) shares an NVFP4 global scale (``Unit.parts``), as llm-compressor writes it;
- shared experts are ordinary linears, so units of their own;
- routers and shared-expert gates (linears of a MoE block whose output is one score per
  expert, or one) are never quantized: listed in ``UnitMap.left_alone`` with the reason;
- any other module holding more than 1% of the model's weights in tensors fp4sense does
  not quantize is named in ``UnitMap.unaccounted`` (a warning in the report), never
  skipped silently.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from fp4sense.numerics.fakequant import quantize_weights, searched_scales
from fp4sense.numerics.schemes import get_scheme
from fp4sense.structure.experts import expert_lists, expert_unit, left_alone, unaccounted
from fp4sense.structure.lineage import public_name
from fp4sense.validate import UserError

__all__ = ["Unit", "UnitError", "UnitMap", "find_blocks", "find_units", "quantize_unit",
           "short_kind"]


class UnitError(UserError, ValueError):
    """The model's structure is not one fp4sense can split into units."""


@dataclass(frozen=True)
class Unit:
    """The smallest thing that gets one scheme: one linear, or one fused group."""

    block: int
    kind: str
    modules: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]
    # MoE experts: each module's input width (when they differ), the groups of module
    # indices sharing an NVFP4 global scale (default: all), the number of experts
    in_each: tuple[int, ...] = ()
    parts: tuple[tuple[int, ...], ...] = ()
    experts: int = 0
    bias: bool = False  # a linear of the unit adds a bias (Qwen2's q/k/v)

    @property
    def name(self) -> str:
        return f"{self.block}:{self.kind}"

    @property
    def inputs(self) -> tuple[int, ...]:
        """Each module's input width."""
        return self.in_each or (self.in_features,) * len(self.modules)

    @property
    def numel(self) -> int:
        return sum(i * o for i, o in zip(self.inputs, self.out_features, strict=True))

    @property
    def per_expert(self) -> int:
        """MoE experts unit: the linears of one expert (its modules are expert-major)."""
        return len(self.modules) // self.experts if self.experts else 0

    @property
    def scale_groups(self) -> tuple[tuple[int, ...], ...]:
        """Module indices quantized together (one NVFP4 global scale each)."""
        return self.parts or (tuple(range(len(self.modules))),)

    @property
    def fused(self) -> bool:
        return len(self.modules) > 1

    def why_infeasible(self, scheme: str) -> str | None:
        """Why ``scheme`` cannot take this unit, or None when it can."""
        s = get_scheme(scheme)
        if self.experts and (s.rotation or s.input_clip):
            return ("vLLM applies no input transform to fused MoE experts, so they take no "
                    "rotated scheme" if s.rotation else "each routed expert sees its own "
                    "tokens: the input's tensor scale is chosen for dense units only")
        if s.rotation and self.bias:
            return "vLLM's transforms serve no linear with a bias: no rotated scheme here"
        need = s.block_size
        bad = [w for w in dict.fromkeys(self.inputs) if need and w % need]
        return (f"input dimension {bad[0]} is not divisible by {scheme}'s block size {need}"
                if bad else None)

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("in_each", "parts", "experts", "bias"):  # dense units: as before
            if not d[key]:
                d.pop(key)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Unit:
        return cls(d["block"], d["kind"], tuple(d["modules"]), d["in_features"],
                   tuple(d["out_features"]), tuple(d.get("in_each", ())),
                   tuple(tuple(p) for p in d.get("parts", ())), d.get("experts", 0),
                   d.get("bias", False))


@dataclass
class UnitMap:
    """Where the blocks are and which units they hold."""

    blocks_path: str
    n_blocks: int
    units: list[Unit]
    outside: list[str] = field(default_factory=list)  # linears left alone, not in a block
    left_alone: dict[str, str] = field(default_factory=dict)  # in a block: name -> why
    unaccounted: dict[str, float] = field(default_factory=dict)  # name -> share of weights
    experts_per_token: int = 0  # MoE: experts each token is routed to

    @property
    def kinds(self) -> list[str]:
        """Unit kinds in block order of appearance."""
        seen: dict[str, None] = {}
        for u in self.units:
            seen.setdefault(u.kind, None)
        return list(seen)

    def by_name(self) -> dict[str, Unit]:
        return {u.name: u for u in self.units}

    def of_kind(self, kind: str) -> list[Unit]:
        return [u for u in self.units if u.kind == kind]

    def of_block(self, block: int) -> list[Unit]:
        return [u for u in self.units if u.block == block]

    def linears(self) -> list[str]:
        return [m for u in self.units for m in u.modules]

    def to_dict(self) -> dict:
        d = {"blocks_path": self.blocks_path, "n_blocks": self.n_blocks,
             "units": [u.to_dict() for u in self.units], "outside": self.outside}
        if self.left_alone or self.unaccounted or self.experts_per_token:
            d.update(left_alone=self.left_alone, unaccounted=self.unaccounted,
                     experts_per_token=self.experts_per_token)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> UnitMap:
        return cls(d["blocks_path"], d["n_blocks"], [Unit.from_dict(u) for u in d["units"]],
                   list(d.get("outside", [])), dict(d.get("left_alone", {})),
                   dict(d.get("unaccounted", {})), d.get("experts_per_token", 0))


def find_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 1:
            continue
        if not all(any(isinstance(m, torch.nn.Linear) for m in item.modules())
                   for item in module):
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise UnitError(
            f"{type(model).__name__}: no decoder blocks found; looked for an nn.ModuleList "
            "whose items each contain nn.Linear layers (a Hugging Face decoder-only model)"
        )
    return best


def _common_prefix(rels: list[str]) -> str:
    parents = {r.rpartition(".")[0] for r in rels}
    return parents.pop() if len(parents) == 1 else ""


def _kind(rels: list[str]) -> str:
    if len(rels) == 1:
        return rels[0]
    prefix = _common_prefix(rels)
    shorts = "+".join(r.rpartition(".")[2] for r in rels)
    return f"{prefix}.{shorts}" if prefix else shorts


@torch.no_grad()
def find_units(model: torch.nn.Module, sample: torch.Tensor | None = None) -> UnitMap:
    """Split ``model`` into units. ``sample`` (1, T) token ids drive the one forward that
    finds fused groups (a few tokens are enough; default: 8 tokens of id 1..8)."""
    blocks_path, blocks = find_blocks(model)
    linear_names = {m: n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    seen_inputs: dict[str, tuple] = {}
    keep_alive: list[torch.Tensor] = []

    def hook(module, args):
        x = args[0]
        keep_alive.append(x)
        # the same tensor object (or a view of the same storage) = the same input; empty
        # ones (an expert no token reached) share no storage: told apart by identity
        seen_inputs.setdefault(linear_names[module], ("empty", id(x)) if not x.numel() else
                               (x.untyped_storage().data_ptr(), x.storage_offset(),
                                tuple(x.shape), tuple(x.stride())))

    handles = [m.register_forward_pre_hook(hook) for m in linear_names]
    if sample is None:
        sample = torch.arange(1, 9)[None]
    try:
        model(input_ids=sample.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
        keep_alive.clear()

    units: list[Unit] = []
    in_blocks: set[str] = set()
    left: dict[str, str] = {}
    for index, block in enumerate(blocks):
        prefix = f"{blocks_path}.{index}"
        lists = expert_lists(block)
        mine = [expert_unit(index, prefix, rel, children, seen_inputs)
                for rel, children in lists.items()]
        left.update(left_alone(block, prefix, lists))
        groups: dict[tuple, list[str]] = {}
        for rel, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            full = f"{prefix}.{rel}"
            in_blocks.add(full)
            if full in left or any(rel.startswith(f"{p}.") for p in lists):
                continue
            key = seen_inputs.get(full, ("unused", full))
            groups.setdefault(key, []).append(rel)
        for rels in groups.values():
            mods = [block.get_submodule(r) for r in rels]
            ins = {m.in_features for m in mods}
            if len(ins) != 1:  # pragma: no cover - same input implies same width
                raise UnitError(f"block {index}: {rels} share an input of different widths")
            mine.append(Unit(index, _kind(rels), tuple(f"{prefix}.{r}" for r in rels),
                             ins.pop(), tuple(m.out_features for m in mods),
                             bias=any(m.bias is not None for m in mods)))
        order = {f"{prefix}.{rel}": i for i, (rel, _) in enumerate(block.named_modules())}
        units += sorted(mine, key=lambda u: order[u.modules[0]])  # as the block holds them
    outside = sorted(n for n in linear_names.values() if n not in in_blocks)
    known = {m for u in units for m in u.modules} | set(outside) | set(left)
    config = getattr(model, "config", None)
    per_token = 0
    if any(u.experts for u in units) and config is not None:
        per_token = int(getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0)
    return UnitMap(blocks_path, len(blocks), units, outside, left,
                   unaccounted(model, known), per_token)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's config and the weights of its linears and embeddings
    (identifies it in reports and caches).

    It identifies the model the user gave and survives what a host does to it while
    calibrating: weights are hashed as bf16 (one checkpoint loaded in float32 for the
    analysis or in bf16 by llm-compressor has one fingerprint), and norms are not hashed,
    since llm-compressor rewrites offset norms (Gemma's ``1 + weight``) during oneshot.
    Tied weights are hashed under each name they have."""

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        # not the loading details: dtype, where it was loaded from, library versions
        skip = {"dtype", "torch_dtype", "_name_or_path", "_model_name_or_path",
                "transformers_version",
                "quantization_config", "architectures"}
        described = {k: v for k, v in config.to_diff_dict().items() if k not in skip}
        h.update(json.dumps(described, sort_keys=True, default=str).encode())
    weighted = sorted((name, module.weight) for name, module in model.named_modules()
                      if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)))
    blocks = getattr(model, "fp4sense_blocks", None)  # weights read from files on demand
    for name, tensor in weighted:
        h.update(name.encode())
        if blocks is not None and (tensor.is_meta or tensor.numel() == 0):
            tensor = blocks.tensor(f"{name}.weight")
        t = tensor.detach().to(torch.bfloat16).contiguous().cpu()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def quantize_unit(scheme: str, unit: Unit, weights: Sequence[torch.Tensor],
                  importance: Sequence[torch.Tensor | None] | None = None,
                  block_scales: Sequence[torch.Tensor] | None = None,
                  out_dtype: torch.dtype | None = None,
                  only: int | None = None, dtype: torch.dtype = torch.bfloat16,
                  scale_dtype: torch.dtype | None = None) -> list[torch.Tensor | None]:
    """``unit``'s weights fake-quantized under ``scheme``, each of its scale groups on
    its own (a fused group shares one NVFP4 global scale; MoE experts one per expert).
    ``importance``: per weight, the E[x^2] of its inputs (searched-scale schemes);
    ``block_scales``: per weight, scales from :func:`unit_scales` (no new search);
    ``out_dtype``: of the results (default: each weight's own); ``only``: the index of
    the one weight to quantize (the same bits; the others are None, and only its scale
    group's ``weights`` are read: the others may be None); ``dtype`` / ``scale_dtype``:
    the host's calibration dtype and the checkpoint's scale dtype
    (:func:`fp4sense.numerics.fakequant.quantize_weights`)."""

    out: list[torch.Tensor | None] = [None] * len(weights)
    for part in unit.scale_groups:
        if only is not None and only not in part:
            continue
        imps = None if importance is None else [importance[i] for i in part]
        given = None if block_scales is None else [block_scales[i] for i in part]
        done = quantize_weights(scheme, [weights[i] for i in part], importance=imps,
                                block_scales=given, out_dtype=out_dtype,
                                only=None if only is None else part.index(only), dtype=dtype,
                                scale_dtype=scale_dtype)
        for i, w in zip(part if only is None else (only,), done, strict=True):
            out[i] = w
    return out


def unit_scales(scheme: str, unit: Unit, weights: Sequence[torch.Tensor],
                importance: Sequence[torch.Tensor | None] | None = None,
                dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """The block scales a ``*_SEARCH`` scheme's search picks for ``unit``'s weights (per
    weight, searched in ``dtype``; each scale group's global scale as
    :func:`quantize_unit` uses it)."""

    out: list[torch.Tensor | None] = [None] * len(weights)
    for part in unit.scale_groups:
        imps = None if importance is None else [importance[i] for i in part]
        for i, s in zip(part, searched_scales(scheme, [weights[i] for i in part],
                                              dtype=dtype, importance=imps), strict=True):
            out[i] = s
    return out


def short_kind(kind: str) -> str:
    """A unit kind without its first module inside the block, for plot labels
    (``self_attn.q_proj+k_proj+v_proj`` -> ``q_proj+k_proj+v_proj``)."""
    return kind.split(".", 1)[-1]


def model_name(model: torch.nn.Module, fallback: str | os.PathLike = "") -> str:
    """How reports name a model: its Hub id where known, else its folder's name (never a
    path of this machine; see :mod:`fp4sense.structure.lineage`)."""

    config = getattr(model, "config", None)
    return public_name(str(getattr(config, "_name_or_path", "") or fallback))
