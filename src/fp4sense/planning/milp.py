"""Budgeted allocation: one scheme per unit, least predicted damage under a budget -> Plan.

The problem is a multiple-choice knapsack: unit ``u`` takes scheme ``s`` at a cost of
``bits(u, s)`` stored bits and a predicted damage ``d(u, s)`` (the unit's KL in a
:class:`~fp4sense.diagnosis.SensitivityReport` grid; 0 for BF16). fp4sense solves it
exactly as a 0/1 integer program with HiGHS (``scipy.optimize.milp``):

    minimize   Σ d(u,s) x(u,s)
    subject to Σ_s x(u,s) = 1 for every unit,  Σ bits(u,s) x(u,s) <= budget,

or, for a damage target, the fewest bits with Σ d x <= target. Fused groups are units
(one scheme, one rotation each); a scheme a unit cannot take is not offered; pins force
a unit (by unit name or a regex over its modules) to a scheme."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from compressed_tensors.utils.match import match_name
from scipy.optimize import Bounds, LinearConstraint, milp

from fp4sense import defaults
from fp4sense.diagnosis import SensitivityReport
from fp4sense.numerics.schemes import bits_per_weight, clip_key, get_scheme
from fp4sense.planning.plan import PLAN_VERSION, Choice, Plan, PlanError
from fp4sense.structure.units import Unit, UnitMap

__all__ = ["DEFAULT_MENU", "PLAN_VERSION", "Plan", "PlanError", "check_pins", "plan_cost",
           "solve"]

DEFAULT_MENU = defaults.MENU


def unit_bits(unit: Unit, scheme: str) -> float:
    """Stored bits per weight of ``unit`` under ``scheme`` (its linears together)."""
    total = sum(bits_per_weight(scheme, (out, width)) * out * width
                for width, out in zip(unit.inputs, unit.out_features, strict=True))
    return total / unit.numel


def _pin_hits(pattern: str, unit: Unit) -> list[bool]:
    """Which of the unit's modules a pin matches: a unit's name (``3:mlp.down_proj``)
    matches them all; else a regex over module names, whole name, or compressed-tensors'
    ``re:`` form (matched from the start)."""
    if pattern == unit.name:
        return [True] * len(unit.modules)
    if pattern.startswith("re:"):  # compressed-tensors' own target form, its own matcher
        return [match_name(m, pattern) for m in unit.modules]
    return [bool(re.fullmatch(pattern, m)) for m in unit.modules]


def _pin_matches(pattern: str, unit: Unit) -> bool:
    """A pin that matches any of a unit's modules pins the whole unit (a fused unit's
    linears share one scheme: vLLM runs q/k/v, and gate/up, as one matrix product)."""
    return any(_pin_hits(pattern, unit))


def fused_pins(pins: Mapping[str, str], units: Sequence[Unit]) -> str:
    """What a budget error adds when a pin matches only part of fused units: that it pins
    those units whole ('' when no pin does)."""
    for pattern, scheme in pins.items():
        partial = [u for u in units if u.fused and any(_pin_hits(pattern, u))
                   and not all(_pin_hits(pattern, u))]
        if partial:
            u = partial[0]
            leaves = "/".join(dict.fromkeys(m.rsplit(".", 1)[-1] for m in u.modules))
            return (f"; --pin {pattern}={scheme} matches part of {len(partial)} fused "
                    f"unit(s) (e.g. {u.name}) and pins them whole: {leaves} share one "
                    "scheme (vLLM runs them as one product), so pin fewer units or raise "
                    "the budget")
    return ""


def check_pins(pins: Mapping[str, str] | None, menu: Sequence[str], units=None) -> dict:
    """``--pin`` values against the menu (the estimate scores only the menu) and, given
    ``units``, the model's units; {pattern: scheme name}. quantize runs it first."""
    names = {get_scheme(s).name for s in menu}
    checked = {}
    for pattern, scheme in (pins or {}).items():
        try:
            name = get_scheme(scheme).name
        except ValueError as exc:
            raise PlanError(f"--pin {pattern}={scheme}: {exc}") from None
        if get_scheme(name).quantizes and name not in names:
            raise PlanError(f"--pin {pattern}={scheme}: {name} is not in --menu ("
                            f"{', '.join(sorted(names))}); add it to --menu or pin one of those")
        if units is not None and not any(_pin_matches(pattern, u) for u in units.units):
            raise PlanError(f"--pin {pattern!r} matches no unit; name a unit (e.g. "
                            f"{units.units[0].name!r}) or a regex of module names")
        checked[pattern] = name
    return checked


def _pinned(unit: Unit, pins: Mapping[str, str]) -> str | None:
    hit = None
    for pattern, scheme in pins.items():
        if _pin_matches(pattern, unit):
            if hit is not None and hit != scheme:
                raise PlanError(f"unit {unit.name} is pinned to both {hit} and {scheme}")
            hit = get_scheme(scheme).name
    return hit


def input_fraction(report: SensitivityReport, unit: Unit, scheme: str) -> float:
    """The fraction of the input maximum the analysis chose for ``unit`` under an
    ``*_ACLIP`` ``scheme`` (1.0 under any other)."""
    s = get_scheme(scheme)
    if not s.input_clip:
        return 1.0
    chosen = (report.activation_stats or {}).get(unit.modules[0], {}).get(clip_key(s.rotation))
    if chosen is None:
        raise PlanError(f"the sensitivity report chose no input tensor scale for unit "
                        f"{unit.name} under {s.name}; analyze again with --schemes "
                        f"including {s.name}")
    return float(chosen["fraction"])


def plan_cost(units: UnitMap, menu: Sequence[str]) -> tuple[float, float]:
    """The (lowest, highest) average bits per weight ``menu`` can reach on ``units``."""
    lo = hi = 0.0
    total = 0
    for u in units.units:
        options = [unit_bits(u, s) for s in menu if u.why_infeasible(s) is None] or [16.0]
        lo += min(options) * u.numel
        hi += max(options) * u.numel
        total += u.numel
    return lo / total, hi / total


def solve(
    report: SensitivityReport,
    *,
    budget_bits: float | None = None,
    budget_bytes: int | None = None,
    kl_target: float | None = None,
    menu: Sequence[str] = DEFAULT_MENU,
    pins: Mapping[str, str] | None = None,
    mode: str | None = None,
    damage: Mapping[str, Mapping[str, float]] | None = None,
    damage_source: str | None = None,
    exclude: Sequence[Mapping[str, str]] = (),
) -> Plan:
    """The exact optimum plan for one objective (give exactly one of the three).

    :param mode: which grid of the report to use ("measured" or "estimated"; default:
        measured where it covers every unit, else estimated).
    :param damage: scheme -> unit name -> damage, instead of the report's grid (e.g. a
        weight-error score); ``damage_source`` names it in the plan.
    :param exclude: assignments (unit -> scheme) the plan must differ from, so repeated
        calls give the next best plans (:func:`fp4sense.planning.select.best_plans`).
    """
    objectives = [x is not None for x in (budget_bits, budget_bytes, kl_target)]
    if sum(objectives) != 1:
        raise PlanError("give exactly one of budget_bits, budget_bytes, kl_target")
    menu = list(dict.fromkeys(get_scheme(s).name for s in menu))  # unknown names -> menu
    pins = check_pins(pins, menu, report.units)
    units = report.units.units

    if damage is None:
        damage, damage_source = _report_damage(report, menu, mode)
    options: list[tuple[int, str, float, float]] = []  # (unit index, scheme, bits, damage)
    for i, u in enumerate(units):
        forced = _pinned(u, pins)
        allowed = [forced] if forced else menu
        row = []
        for s in allowed:
            why = u.why_infeasible(s)
            if why:
                if forced:
                    raise PlanError(f"unit {u.name} is pinned to {s}, but {why}")
                continue
            d = damage[s].get(u.name) if get_scheme(s).quantizes else 0.0
            if d is None:
                raise PlanError(f"the sensitivity report has no {s} score for unit {u.name}; "
                                f"analyze with --views grid and --schemes including {s}")
            row.append((i, s, unit_bits(u, s), max(float(d), 0.0)))
        if not row:
            row.append((i, "BF16", 16.0, 0.0))  # nothing on the menu fits: left alone
        options += row

    n = len(options)
    numel = np.array([units[i].numel for i, *_ in options], dtype=np.float64)
    bits = np.array([b for _, _, b, _ in options]) * numel
    dmg = np.array([d for *_, d in options])
    pick = np.zeros((len(units), n))
    for j, (i, *_) in enumerate(options):
        pick[i, j] = 1
    constraints = [LinearConstraint(pick, 1, 1)]
    for other in exclude:  # at least one unit differs
        same = np.array([float(other.get(units[i].name) == sch) for i, sch, *_ in options])
        constraints.append(LinearConstraint(same[None], 0, len(units) - 1))
    total = sum(u.numel for u in units)
    lo, hi = _range(options, units)
    if kl_target is not None:
        cost = bits / total
        constraints.append(LinearConstraint(dmg[None], 0, kl_target))
    else:
        limit = budget_bits * total if budget_bits is not None else budget_bytes * 8
        if limit < lo * total - 1e-6:
            asked = (f"{budget_bits} bits per weight" if budget_bits is not None
                     else f"{budget_bytes:,} bytes")
            raise PlanError(
                f"budget {asked} is below what the menu {', '.join(menu)} can reach on this "
                f"model: {lo:.3f}–{hi:.3f} bits per weight "
                f"({lo * total / 8:,.0f}–{hi * total / 8:,.0f} bytes)"
                + fused_pins(pins, units))
        cost = dmg
        constraints.append(LinearConstraint(bits[None], 0, limit))
    res = milp(c=cost, constraints=constraints, integrality=np.ones(n), bounds=Bounds(0, 1),
               options={"presolve": True})
    if res.status != 0 or res.x is None:
        if kl_target is not None:
            raise PlanError(f"no plan on the menu {', '.join(menu)} keeps the predicted KL "
                            f"under {kl_target}; raise the target or add a wider scheme"
                            + fused_pins(pins, units))
        raise PlanError(f"the planner found no solution ({res.message})")  # pragma: no cover
    chosen = [options[j] for j in np.flatnonzero(res.x > 0.5)]
    k = report.units.experts_per_token
    choices = [Choice(units[i].name, s, b, units[i].numel, d, units[i].modules,
                      k / units[i].experts if units[i].experts and k else 1.0,
                      input_fraction(report, units[i], s))
               for i, s, b, d in sorted(chosen)]
    objective = ({"budget_bits": budget_bits} if budget_bits is not None else
                 {"budget_bytes": budget_bytes} if budget_bytes is not None else
                 {"kl_target": kl_target})
    return Plan(choices, menu, objective, damage_source or "custom", report.model,
                report.model_fingerprint, report.units.blocks_path, dict(pins))


def _range(options, units) -> tuple[float, float]:
    total = sum(u.numel for u in units)
    lo: dict[int, float] = {}
    hi: dict[int, float] = {}
    for i, _, b, _ in options:
        lo[i] = min(lo.get(i, b), b)
        hi[i] = max(hi.get(i, b), b)
    return (sum(lo[i] * units[i].numel for i in lo) / total,
            sum(hi[i] * units[i].numel for i in hi) / total)


def _report_damage(report: SensitivityReport, menu: Sequence[str], mode: str | None
                   ) -> tuple[dict[str, dict[str, float]], str]:
    names = {u.name for u in report.units.units}
    quantized = [s for s in menu if get_scheme(s).quantizes]
    missing = [s for s in quantized if s not in report.schemes]
    if missing:
        raise PlanError(f"the sensitivity report covers {', '.join(report.schemes)}, not "
                        f"{', '.join(missing)}; analyze again with --schemes including them "
                        "or change the menu")
    if mode is None:
        full = all(set(report.unit_scores(s, "measured")) >= names for s in quantized)
        mode = "measured" if full else "estimated"
    out = {s: report.unit_scores(s, mode) for s in quantized}
    return out, mode
