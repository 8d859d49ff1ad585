"""Statistics over analysis windows: mean and standard error, and the rank agreement of
estimated with measured damage (Spearman's rho, scipy's)."""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy import stats

from fp4sense.diagnosis.results import SensitivityReport

__all__ = ["correlations", "mean_se"]


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
