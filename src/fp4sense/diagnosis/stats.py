"""Statistics over analysis windows: each linear's input statistics (``InputStats``),
mean and standard error, and the rank agreement of estimated with measured damage
(Spearman's rho, scipy's)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from scipy import stats

from fp4sense.diagnosis.results import SensitivityReport
from fp4sense.numerics.rotation import rotate_input

__all__ = ["InputStats", "correlations", "mean_se"]


class InputStats:
    """Per linear, over the base pass: the input's absolute maximum (the NVFP4 input
    global scale is made from it), that of the input rotated by each of ``rotations``
    (``absmax_h16``, ...: a rotated scheme's), the mean of each window's 99.9th
    percentile, and E[x^2] per input channel (weights the scale search; a rotated
    scheme's of the rotated input, under the key ``(linear, width)``)."""

    def __init__(self, names, rotations=(), unrotated=frozenset()):
        self.rotations = tuple(rotations)
        self.unrotated = unrotated  # linears no rotated scheme takes (MoE experts)
        self.acc = {m: {"absmax": 0.0, "p999": [], "sq": None, "rows": 0} for m in names}

    def add(self, name: str, x: torch.Tensor) -> None:
        rows = x.detach().float().reshape(-1, x.shape[-1])
        flat = rows.abs().reshape(-1)
        s = self.acc[name]
        sq = rows.square().sum(0)
        s["sq"] = sq if s["sq"] is None else s["sq"] + sq
        s["rows"] += rows.shape[0]
        s["absmax"] = max(s["absmax"], float(flat.max()))
        k = max(1, int(round(0.001 * flat.numel())))
        s["p999"].append(float(flat.topk(k).values[-1]))
        for size in () if name in self.unrotated else self.rotations:
            if x.shape[-1] % size == 0:  # rotated in the input's dtype, as the host does
                turned = rotate_input(x.detach(), size).float().reshape(rows.shape)
                key = f"absmax_h{size}"
                s[key] = max(s.get(key, 0.0), float(turned.abs().max()))
                sq = turned.square().sum(0)
                s[f"sq_h{size}"] = sq if f"sq_h{size}" not in s else s[f"sq_h{size}"] + sq

    def finish(self) -> tuple[dict[str, dict], dict]:
        """(linear -> statistics, linear (or (linear, width)) -> E[x^2] per input channel)."""
        out, importance = {}, {}
        for m, s in self.acc.items():
            if s["rows"]:
                importance[m] = s["sq"] / s["rows"]
                for size in self.rotations:  # a rotated scheme's: (linear, width)
                    if f"sq_h{size}" in s:
                        importance[(m, size)] = s[f"sq_h{size}"] / s["rows"]
            p999 = float(np.mean(s["p999"]))
            out[m] = {"absmax": s["absmax"], "p999": p999,
                      "outlier_ratio": s["absmax"] / p999 if p999 > 0 else float("inf"),
                      **{k: v for k, v in s.items() if k.startswith("absmax_h")}}
        return out, importance


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error over windows (nan for a single window)."""
    v = np.asarray(values, dtype=np.float64)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return float(v.mean()), se


def correlations(report: SensitivityReport) -> list[dict]:
    """Spearman ρ between measured and estimated values wherever both exist."""
    out = []
    for view, scheme, mode in report.views():
        if mode != "measured":
            continue
        measured = report.table(view, scheme, "measured")
        estimated = report.table(view, scheme, "estimated")
        common = sorted(set(measured) & set(estimated))
        if len(common) >= 3:
            with warnings.catch_warnings():  # constant input: rho is undefined (nan)
                warnings.simplefilter("ignore", stats.ConstantInputWarning)
                rho = float(stats.spearmanr([measured[t].kl for t in common],
                                            [estimated[t].kl for t in common]).statistic)
            out.append({"view": view, "scheme": scheme, "n": len(common), "spearman": rho})
    return out
