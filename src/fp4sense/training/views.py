"""The views of the FP4 training sensitivity: per block, per component (a unit kind in
every block) and per GEMM, the estimated damage summed over their units, the measured
trial beside it (the arm with just that block, kind or GEMM in FP4), the estimate's rank
correlation with the trials in each view, and the trials' agreement with themselves (the
two halves of their held-aside windows), which bounds what the first can show."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scipy.stats import spearmanr

from fp4sense.numerics.training import GEMMS
from fp4sense.training.estimate import UnitEstimate
from fp4sense.training.trials import Difference

__all__ = ["build_views", "measured_arms", "rank_correlations", "trial_agreement"]


def measured_arms(units: Sequence[UnitEstimate], recipe: str, views: Sequence[str]
                  ) -> dict[str, dict[str, object]]:
    """arm name -> policy for the measured mode: ``block:B`` (all of block B's GEMMs in FP4),
    ``component:KIND`` (that kind in every block), ``gemm:G`` (that GEMM of every unit)."""
    arms: dict[str, dict[str, object]] = {}
    if "block" in views:
        for b in sorted({u.block for u in units}):
            arms[f"block:{b}"] = {m: recipe for u in units if u.block == b for m in u.modules}
    if "component" in views:
        for k in dict.fromkeys(u.kind for u in units):
            arms[f"component:{k}"] = {m: recipe for u in units if u.kind == k
                                      for m in u.modules}
    if "gemm" in views:
        for g in GEMMS:
            arms[f"gemm:{g}"] = {m: {g: recipe} for u in units for m in u.modules}
    return arms


def _sum(units: Sequence[UnitEstimate]) -> dict[str, float]:
    d = {g: sum(u.gemms[g].damage for u in units) for g in GEMMS}
    d["total"] = sum(d.values())
    return d


def build_views(units: Sequence[UnitEstimate], views: Sequence[str],
                measured: Mapping[str, Difference] | None = None) -> dict:
    measured = measured or {}

    def with_measured(row: dict, arm: str) -> dict:
        if arm in measured:
            row["measured"] = measured[arm].to_dict()
        return row

    out = {}
    if "block" in views:
        out["block"] = [with_measured({"block": b, "damage": _sum(
            [u for u in units if u.block == b]), "nsr": max(
            u.nsr for u in units if u.block == b)}, f"block:{b}")
            for b in sorted({u.block for u in units})]
    if "component" in views:
        out["component"] = [with_measured({"kind": k, "damage": _sum(
            [u for u in units if u.kind == k])}, f"component:{k}")
            for k in dict.fromkeys(u.kind for u in units)]
    if "gemm" in views:
        out["gemm"] = [with_measured({"gemm": g, "damage": sum(u.gemms[g].damage
                                                               for u in units)}, f"gemm:{g}")
                       for g in GEMMS]
    return out


def _rho(a, b) -> float | None:
    rho = spearmanr(a, b).statistic
    return None if rho != rho else float(rho)  # NaN: a constant side


def rank_correlations(views: dict) -> dict[str, float | None]:
    """Spearman's rho of estimated damage against measured Δ loss in each view with at
    least three measured rows (None: no spread)."""
    out = {}
    for view, rows in views.items():
        pairs = [((r["damage"]["total"] if isinstance(r["damage"], dict) else r["damage"]),
                  r["measured"]["delta"]) for r in rows if "measured" in r]
        if len(pairs) >= 3:
            out[view] = _rho(*zip(*pairs, strict=True))
    return out


def trial_agreement(views: dict) -> dict[str, float | None]:
    """Per view with at least three measured rows and two held-aside windows each: Spearman's
    rho of the trials' Δ loss on the first half of the windows against the second half's.
    What the same trials rank differently on other text bounds what any estimate can
    show against them."""
    out = {}
    for view, rows in views.items():
        halves = []
        for r in rows:
            w = (r.get("measured") or {}).get("per_window") or []
            if len(w) >= 2:
                h = len(w) // 2
                halves.append((sum(w[:h]) / h, sum(w[h:]) / (len(w) - h)))
        if len(halves) >= 3:
            out[view] = _rho(*zip(*halves, strict=True))
    return out
