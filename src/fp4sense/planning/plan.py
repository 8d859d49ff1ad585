"""A plan, the planning stage's object: one scheme per unit with its cost and predicted
damage, saved as plan.json (plain data with a JSON form; :mod:`fp4sense.planning.milp`
solves it), and the compressed-tensors config groups it becomes."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fp4sense import __version__
from fp4sense.numerics.input_clip import check_fraction
from fp4sense.numerics.schemes import get_scheme, to_quantization_scheme
from fp4sense.validate import UserError, read_json

__all__ = ["PLAN_VERSION", "Choice", "Plan", "PlanError"]

PLAN_VERSION = 1


class PlanError(UserError, ValueError):
    """A budget, menu, pin or report the planner cannot use (the message says why)."""


@dataclass(frozen=True)
class Choice:
    """One unit's scheme in a plan."""

    unit: str
    scheme: str
    bits: float  # stored bits per weight of the unit under the scheme
    numel: int
    damage: float  # predicted KL contribution
    modules: tuple[str, ...]
    active: float = 1.0  # share of the unit's weights one token computes with (MoE: k/E)
    #: an ``*_ACLIP`` scheme's chosen fraction of the input maximum its tensor scale is
    #: made from (1: the maximum, as every other scheme)
    input_fraction: float = 1.0


@dataclass
class Plan:
    """unit -> scheme, with its cost and predicted damage; saved as plan.json."""

    choices: list[Choice]
    menu: list[str]
    objective: dict  # {"budget_bits": 4.75} | {"budget_bytes": n} | {"kl_target": x}
    damage_source: str  # what damage means: "measured" | "estimated" | "weight_mse" | ...
    model: str = ""
    model_fingerprint: str = ""
    blocks_path: str = ""
    pins: dict[str, str] = field(default_factory=dict)
    #: FP4 training applied after planning (QAD: steps, text, loss before / after)
    training: dict = field(default_factory=dict)
    #: how the host calibrates: {"dtype": the model's dtype during the oneshot,
    #: "stored_dtype": the dtype the checkpoint keeps unquantized tensors in}
    calibration: dict = field(default_factory=dict)
    version: int = PLAN_VERSION
    fp4sense_version: str = __version__

    @property
    def bits(self) -> float:
        """Average stored bits per weight over the quantizable linears (theory)."""
        return (sum(c.bits * c.numel for c in self.choices)
                / sum(c.numel for c in self.choices))

    @property
    def active_bits(self) -> float:
        """Average bits per weight one token computes with: a MoE's routed experts count
        with the share of them a token runs (equals :attr:`bits` for a dense model)."""
        return (sum(c.bits * c.numel * c.active for c in self.choices)
                / sum(c.numel * c.active for c in self.choices))

    @property
    def predicted_kl(self) -> float:
        return float(sum(c.damage for c in self.choices))

    def schemes(self) -> dict[str, int]:
        """scheme -> number of units."""
        out: dict[str, int] = {}
        for c in self.choices:
            out[c.scheme] = out.get(c.scheme, 0) + 1
        return dict(sorted(out.items()))

    def targets(self, stored: dict | None = None) -> dict[str, list[str]]:
        """scheme -> compressed-tensors targets (one regex per unit kind) for its units.

        ``stored`` (:func:`fp4sense.inputs.moe.stored_expert_names`): experts the files
        store under other names; their regex names the linears and the stored names."""
        return {scheme: targets for (scheme, _), targets in self._targets(
            stored, lambda c: (c.scheme, 1.0)).items()}

    def _targets(self, stored: dict | None, key) -> dict[tuple[str, float], list[str]]:
        """``key(choice)`` -> the targets of the choices it groups."""
        by: dict[tuple[str, float], dict[str, list[str]]] = {}
        experts: dict[str, list[str]] = {}  # MoE kind -> the projections of one expert
        for c in self.choices:
            if not get_scheme(c.scheme).quantizes:
                continue
            block, _, kind = c.unit.partition(":")
            by.setdefault(key(c), {}).setdefault(kind, []).append(block)
            inside = f"{self.blocks_path}.{block}.{kind}."
            if all(m.startswith(inside) for m in c.modules):  # experts.E.<projection>
                experts[kind] = sorted({m[len(inside):].split(".", 1)[1] for m in c.modules})
        out: dict[tuple[str, float], list[str]] = {}
        for group, kinds in by.items():
            out[group] = []
            for kind, blocks in kinds.items():
                parent, _, leaves = kind.rpartition(".")
                leaf = leaves.split("+")
                leaf_re = re.escape(leaf[0]) if len(leaf) == 1 else \
                    "(" + "|".join(re.escape(x) for x in leaf) + ")"
                path = (re.escape(parent) + r"\." if parent else "") + leaf_re
                if kind in experts:  # every expert's projections
                    path = (re.escape(kind) + r"\.\d+\.("
                            + "|".join(re.escape(p) for p in experts[kind]) + ")")
                    if kind in (stored or {}):  # and the names vLLM gives them
                        alias, leaves = stored[kind]
                        path = (f"({re.escape(kind)}|{re.escape(alias)})" + r"\.\d+\.("
                                + "|".join(re.escape(p) for p in (*experts[kind], *leaves))
                                + ")")
                nums = "|".join(sorted(blocks, key=int))
                out[group].append(f"re:^{re.escape(self.blocks_path)}\\.({nums})\\.{path}$")
        return out

    def config_groups(self, stored: dict | None = None) -> dict:
        """``group_0 … group_N`` compressed-tensors schemes (names vLLM expects); an
        ``*_ACLIP`` scheme has a group per fraction of the input maximum its units chose."""
        groups = self._targets(stored, lambda c: (c.scheme, c.input_fraction))
        return {f"group_{i}": to_quantization_scheme(scheme, targets, fraction)
                for i, ((scheme, fraction), targets) in enumerate(sorted(groups.items()))}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["achieved_bits_theory"] = self.bits
        d["active_bits"] = self.active_bits
        d["predicted_kl"] = self.predicted_kl
        d["schemes"] = self.schemes()
        return d

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """A saved plan.json; one :class:`PlanError` naming the file when it is not one
        (not JSON, cut short, a field missing or of the wrong kind)."""
        d = read_json(Path(path), "plan", "plan again (fp4sense quantize writes it)")
        if not isinstance(d, dict):
            raise PlanError(f"{path}: not a plan (a JSON object); plan again")
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"{path}: plan layout version {d.get('version')!r}, this fp4sense "
                            f"reads {PLAN_VERSION}; plan again")
        for key in ("achieved_bits_theory", "active_bits", "predicted_kl", "schemes"):
            d.pop(key, None)
        if "score" in d:  # plan.json of 0.4
            d["damage_source"] = d.pop("score")
        try:
            d["choices"] = [Choice(**{**c, "modules": tuple(c["modules"])})
                            for c in d["choices"]]
            plan = cls(**d)
            for c in plan.choices:
                get_scheme(c.scheme)
                check_fraction(c.input_fraction, f"unit {c.unit}")
        except (KeyError, TypeError) as exc:
            raise PlanError(f"{path}: not a plan fp4sense can read ({type(exc).__name__}: "
                            f"{exc}); plan again") from None
        except UserError as exc:
            raise PlanError(f"{path}: {exc}; plan again") from None
        return plan
