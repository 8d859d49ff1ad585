"""What a block-Hadamard rotation buys, per unit: each rotated scheme of an analysis
(``NVFP4_H16``, ``MXFP4_H32``, ...) against its plain scheme, in sentences and a plot of
the damage ratio (below 1: the rotation helps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp4sense.diagnosis import SensitivityReport
from fp4sense.numerics.schemes import get_scheme
from fp4sense.reports.plots import pyplot, save_figure, table_mode
from fp4sense.structure.units import short_kind

__all__ = ["plot_rotation", "rotation_findings", "rotation_pairs"]

#: a ratio this close to 1 is "about the same"
SAME = 0.05


def rotation_pairs(report: SensitivityReport) -> list[tuple[str, str, str, str]]:
    """(rotated scheme, plain scheme, view, mode) for each rotated scheme whose plain one
    the report also scored in the same view (grid first, else components)."""
    out = []
    for scheme in report.schemes:
        plain = get_scheme(scheme).preset if get_scheme(scheme).rotation else None
        if plain not in report.schemes:
            continue
        for view in ("grid", "component"):
            mode = table_mode(report, view, scheme)
            if mode and report.table(view, plain, mode):
                out.append((scheme, plain, view, mode))
                break
    return out


def _ratios(report: SensitivityReport, rotated: str, plain: str, view: str, mode: str
            ) -> dict[str, tuple[float, float, float]]:
    """target -> (plain KL, rotated KL, ratio) where both are scored."""
    a, b = report.table(view, plain, mode), report.table(view, rotated, mode)
    return {t: (a[t].kl, b[t].kl, b[t].kl / a[t].kl) for t in a
            if t in b and a[t].kl > 0}


def rotation_findings(report: SensitivityReport) -> list[str]:
    """One sentence per rotated scheme: where the rotation helps and where it does not."""
    out = []
    for rotated, plain, view, mode in rotation_pairs(report):
        ratios = _ratios(report, rotated, plain, view, mode)
        if not ratios:
            continue
        helps = {t: r for t, r in ratios.items() if r[2] < 1 - SAME}
        hurts = {t: r for t, r in ratios.items() if r[2] > 1 + SAME}
        where = "units" if view == "grid" else "components"
        text = (f"**Rotation, {rotated} vs {plain}** ({view}, {mode}): the rotation lowers "
                f"the damage of {len(helps)} of {len(ratios)} {where}")
        if helps:
            t, (k0, k1, r) = min(helps.items(), key=lambda kv: kv[1][2])
            text += f" (most `{t}`: KL {k0:.4f} → {k1:.4f}, {r - 1:+.0%})"
        text += f", raises it for {len(hurts)}"
        if hurts:
            t, (k0, k1, r) = max(hurts.items(), key=lambda kv: kv[1][2])
            text += f" (most `{t}`: {k0:.4f} → {k1:.4f}, {r - 1:+.0%})"
        total0 = sum(v[0] for v in ratios.values())
        total1 = sum(v[1] for v in ratios.values())
        out.append(text + f"; summed over them {total0:.4f} → {total1:.4f}. A plan with "
                   f"both on its menu rotates only where it pays.")
    return out


def plot_rotation(report: SensitivityReport, path: Path) -> Path | None:
    """Bars: per unit (or component), the rotated scheme's damage over the plain one's
    (log scale; below 1 the rotation helps), one bar per rotated scheme."""
    pairs = rotation_pairs(report)
    if not pairs:
        return None
    plt = pyplot()
    targets = sorted({t for r, p, v, m in pairs for t in _ratios(report, r, p, v, m)})
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(targets) * len(pairs)), 4))
    width = 0.8 / len(pairs)
    for i, (rotated, plain, view, mode) in enumerate(pairs):
        ratios = _ratios(report, rotated, plain, view, mode)
        y = [ratios[t][2] if t in ratios else np.nan for t in targets]
        x = np.arange(len(targets)) + (i - (len(pairs) - 1) / 2) * width
        ax.bar(x, np.asarray(y) - 1, width, bottom=1,  # from 1: up hurts, down helps
               label=f"{rotated} / {plain} ({view}, {mode})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    labels = [f"{t.partition(':')[0]}:{short_kind(t.partition(':')[2])}" if ":" in t
              else short_kind(t) for t in targets]
    ax.set_xticks(np.arange(len(targets)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("KL rotated / KL plain")
    ax.set_title("What a block-Hadamard rotation buys (below 1: it helps)")
    ax.legend(fontsize=7)
    return save_figure(fig, path)
