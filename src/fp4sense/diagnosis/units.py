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
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

from fp4sense.numerics.schemes import get_scheme

__all__ = ["Unit", "UnitError", "UnitMap", "find_blocks", "find_units", "short_kind"]


class UnitError(ValueError):
    """The model's structure is not one fp4sense can split into units."""


@dataclass(frozen=True)
class Unit:
    """The smallest thing that gets one scheme: one linear, or one fused group."""

    block: int
    kind: str
    modules: tuple[str, ...]
    in_features: int
    out_features: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.block}:{self.kind}"

    @property
    def numel(self) -> int:
        return self.in_features * sum(self.out_features)

    @property
    def fused(self) -> bool:
        return len(self.modules) > 1

    def why_infeasible(self, scheme: str) -> str | None:
        """Why ``scheme`` cannot take this unit, or None when it can."""
        need = get_scheme(scheme).block_size
        if need and self.in_features % need:
            return (f"input dimension {self.in_features} is not divisible by {scheme}'s "
                    f"block size {need}")
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Unit:
        return cls(d["block"], d["kind"], tuple(d["modules"]), d["in_features"],
                   tuple(d["out_features"]))


@dataclass
class UnitMap:
    """Where the blocks are and which units they hold."""

    blocks_path: str
    n_blocks: int
    units: list[Unit]
    outside: list[str] = field(default_factory=list)  # linears left alone, not in a block

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
        return {"blocks_path": self.blocks_path, "n_blocks": self.n_blocks,
                "units": [u.to_dict() for u in self.units], "outside": self.outside}

    @classmethod
    def from_dict(cls, d: dict) -> UnitMap:
        return cls(d["blocks_path"], d["n_blocks"], [Unit.from_dict(u) for u in d["units"]],
                   list(d.get("outside", [])))


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
        # the same tensor object (or a view of the same storage) = the same input
        seen_inputs.setdefault(linear_names[module],
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
    for index, block in enumerate(blocks):
        prefix = f"{blocks_path}.{index}"
        groups: dict[tuple, list[str]] = {}
        for rel, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            full = f"{prefix}.{rel}"
            in_blocks.add(full)
            key = seen_inputs.get(full, ("unused", full))
            groups.setdefault(key, []).append(rel)
        for rels in groups.values():
            mods = [block.get_submodule(r) for r in rels]
            ins = {m.in_features for m in mods}
            if len(ins) != 1:  # pragma: no cover - same input implies same width
                raise UnitError(f"block {index}: {rels} share an input of different widths")
            units.append(Unit(index, _kind(rels), tuple(f"{prefix}.{r}" for r in rels),
                              ins.pop(), tuple(m.out_features for m in mods)))
    outside = sorted(n for n in linear_names.values() if n not in in_blocks)
    return UnitMap(blocks_path, len(blocks), units, outside)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's config and the weights of its linears and embeddings
    (identifies it in reports and caches).

    It identifies the model the user gave and survives what a host does to it while
    calibrating: weights are hashed as bf16 (one checkpoint loaded in float32 for the
    analysis or in bf16 by llm-compressor has one fingerprint), and norms are not hashed,
    since llm-compressor rewrites offset norms (Gemma's ``1 + weight``) during oneshot.
    Tied weights are hashed under each name they have."""
    import hashlib
    import json

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


def short_kind(kind: str) -> str:
    """A unit kind without its first module inside the block, for plot labels
    (``self_attn.q_proj+k_proj+v_proj`` -> ``q_proj+k_proj+v_proj``)."""
    return kind.split(".", 1)[-1]


def model_name(model: torch.nn.Module, fallback: str | os.PathLike = "") -> str:
    """How reports name a model: its Hub id where known, else its folder's name (never a
    path of this machine; see :mod:`fp4sense.publishing.lineage`)."""
    from fp4sense.publishing.lineage import public_name

    config = getattr(model, "config", None)
    return public_name(str(getattr(config, "_name_or_path", "") or fallback))
