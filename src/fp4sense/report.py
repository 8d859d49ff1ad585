"""Reports a person reads: Markdown with tables and findings in words, and PNG plots.

Everything here reads a :class:`~fp4sense.sensitivity.SensitivityReport` (or its saved
JSON); nothing is computed twice.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from fp4sense.sensitivity import Entry, SensitivityReport
from fp4sense.units import short_kind

__all__ = ["plot_blocks", "plot_components", "plot_grid", "write_analysis"]

#: A difference counts as real when it exceeds this many combined standard errors.
SIGNIFICANT_SE = 2.0


def _fmt(value: float | None, se: float | None = None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = f"{value:.{digits}f}"
    if se is not None and not math.isnan(se):
        text += f" ± {se:.{digits}f}"
    return text


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mode_for(report: SensitivityReport, view: str, scheme: str) -> str | None:
    for mode in ("measured", "estimated"):
        if report.table(view, scheme, mode):
            return mode
    return None


# --- plots ----------------------------------------------------------------------------
def plot_components(report: SensitivityReport, path: Path) -> Path | None:
    """Bars: KL per component kind, one bar per scheme, with ±SE whiskers (log scale)."""
    schemes = [s for s in report.schemes if _mode_for(report, "component", s)]
    if not schemes:
        return None
    plt = pyplot()
    targets = list(report.table("component", schemes[0], _mode_for(report, "component",
                                                                   schemes[0])))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(targets)), 4))
    width = 0.8 / len(schemes)
    for i, scheme in enumerate(schemes):
        mode = _mode_for(report, "component", scheme)
        table = report.table("component", scheme, mode)
        kl = [table[t].kl if t in table else np.nan for t in targets]
        se = [table[t].kl_se if t in table else 0 for t in targets]
        x = np.arange(len(targets)) + (i - (len(schemes) - 1) / 2) * width
        ax.bar(x, kl, width, yerr=np.nan_to_num(se), capsize=2, label=f"{scheme} ({mode})")
    ax.set_xticks(np.arange(len(targets)), [short_kind(t)
                                            for t in targets], rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("KL(base ‖ quantized) per token")
    ax.set_title("Component view: one kind quantized in every block")
    ax.legend()
    return save_figure(fig, path)


def plot_blocks(report: SensitivityReport, path: Path) -> Path | None:
    """Curves over block index: isolate KL, and the KL saved by protecting the block."""
    schemes = [s for s in report.schemes if report.table("block_isolate", s, "measured")
               or report.table("block_isolate", s, "estimated")]
    if not schemes:
        return None
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for scheme in schemes:
        mode = _mode_for(report, "block_isolate", scheme)
        iso = report.table("block_isolate", scheme, mode)
        blocks = sorted(int(b) for b in iso)
        kl = np.array([iso[str(b)].kl for b in blocks])
        se = np.nan_to_num(np.array([iso[str(b)].kl_se for b in blocks]))
        line, = ax1.plot(blocks, kl, marker=".", label=f"{scheme} ({mode})")
        ax1.fill_between(blocks, kl - se, kl + se, alpha=0.2, color=line.get_color())
        gain = protect_gain(report, scheme, mode)
        if gain:
            b2 = sorted(int(b) for b in gain)
            ax2.plot(b2, [gain[str(b)] for b in b2], marker=".", color=line.get_color(),
                     label=f"{scheme} ({mode})")
    ax1.set_title("Isolate: only this block quantized")
    ax1.set_xlabel("decoder block")
    ax1.set_ylabel("KL per token")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.set_title("Protect: KL saved by keeping this block in 16 bits")
    ax2.set_xlabel("decoder block")
    ax2.set_ylabel("KL(all quantized) − KL(all but this block)")
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.legend()
    return save_figure(fig, path)


def plot_grid(report: SensitivityReport, path: Path) -> Path | None:
    """Heatmap unit kind × block of the grid view, one panel per scheme (log colour)."""
    panels = [(s, _mode_for(report, "grid", s)) for s in report.schemes]
    panels = [(s, m) for s, m in panels if m]
    if not panels:
        return None
    plt = pyplot()
    from matplotlib.colors import LogNorm

    kinds = report.units.kinds
    n_blocks = report.units.n_blocks
    height = len(panels) * (1.3 + 0.4 * len(kinds))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.3 * n_blocks), height),
                             squeeze=False)
    for ax, (scheme, mode) in zip(axes[:, 0], panels, strict=True):
        table = report.table("grid", scheme, mode)
        grid = np.full((len(kinds), n_blocks), np.nan)
        for unit in report.units.units:
            if unit.name in table:
                grid[kinds.index(unit.kind), unit.block] = max(table[unit.name].kl, 1e-9)
        finite = grid[np.isfinite(grid)]
        norm = LogNorm(vmin=max(finite.min(), finite.max() * 1e-4), vmax=finite.max()) \
            if finite.size else None
        im = ax.imshow(grid, aspect="auto", cmap="magma_r", norm=norm)
        ax.set_yticks(range(len(kinds)), [short_kind(k)
                                          for k in kinds])
        ax.set_xlabel("decoder block")
        ax.set_title(f"Grid: each unit alone, {scheme} ({mode}; KL per token)")
        fig.colorbar(im, ax=ax)
    return save_figure(fig, path)


# --- words and tables -----------------------------------------------------------------
def protect_gain(report: SensitivityReport, scheme: str, mode: str) -> dict[str, float]:
    """block -> KL(all quantized) - KL(all but this block)."""
    everything = report.table("model", scheme, mode).get("all")
    protect = report.table("block_protect", scheme, mode)
    if everything is None:
        return {}
    return {b: everything.kl - e.kl for b, e in protect.items()}


def _separable(a: Entry, b: Entry) -> bool | None:
    """Whether two entries differ beyond noise (None: no uncertainty, one window)."""
    if math.isnan(a.kl_se) or math.isnan(b.kl_se):
        return None
    return abs(a.kl - b.kl) > SIGNIFICANT_SE * math.hypot(a.kl_se, b.kl_se)


def findings(report: SensitivityReport) -> list[str]:
    """The headline findings, in sentences, from whatever views the report holds."""
    out = []
    totals = {}
    for scheme in report.schemes:
        mode = _mode_for(report, "component", scheme)
        if mode:
            ranked = sorted(report.table("component", scheme, mode).values(),
                            key=lambda e: e.kl, reverse=True)
            units = [e for e in ranked if e.target in report.units.kinds]
            top, second = ranked[0], ranked[1] if len(ranked) > 1 else None
            separable = _separable(top, second) if second else None
            sure = {True: "clearly ahead of", False: "within noise of",
                    None: "(one window, no error bar) ahead of"}[separable]
            least = ranked[-1]
            out.append(
                f"**{scheme}, components ({mode})**: `{top.target}` hurts most "
                f"(KL {_fmt(top.kl, top.kl_se)}), {sure} `{second.target if second else '-'}`; "
                f"`{least.target}` hurts least (KL {_fmt(least.kl, least.kl_se)})."
                + (f" Among whole units, `{units[0].target}` leads."
                   if units and units[0] is not top else ""))
        mode = _mode_for(report, "block_isolate", scheme)
        if mode:
            iso = sorted(report.table("block_isolate", scheme, mode).values(),
                         key=lambda e: e.kl, reverse=True)
            share = sum(e.kl for e in iso[:3]) / max(sum(e.kl for e in iso), 1e-12)
            out.append(
                f"**{scheme}, blocks ({mode})**: the most sensitive blocks alone are "
                + ", ".join(f"{e.target} (KL {_fmt(e.kl, e.kl_se)})" for e in iso[:3])
                + f"; these {len(iso[:3])} carry {share:.0%} of the summed isolate damage.")
            gain = protect_gain(report, scheme, mode)
            if gain:
                best = max(gain, key=gain.get)
                everything = report.table("model", scheme, mode)["all"]
                totals[scheme] = everything
                out.append(
                    f"**{scheme}, protect ({mode})**: keeping block {best} in 16 bits saves "
                    f"the most: KL {everything.kl:.4f} → {everything.kl - gain[best]:.4f} "
                    f"({gain[best] / everything.kl:.0%} of the whole-model damage).")
    if len(totals) >= 2:
        ranked = sorted(totals.items(), key=lambda kv: kv[1].kl)
        (a, ea), (b, eb) = ranked[0], ranked[-1]
        def dppl(e: Entry) -> str:  # the estimate has no perplexity change
            return f" (ΔPPL {e.dppl:+.2f})" if e.dppl is not None else ""

        out.append(f"**Formats**: the whole model in {a} costs KL {ea.kl:.4f}{dppl(ea)}, "
                   f"in {b} KL {eb.kl:.4f}{dppl(eb)}: "
                   f"{b} does {eb.kl / max(ea.kl, 1e-12):.1f}x the damage.")
    for c in report.correlations:
        out.append(f"**Estimate vs measurement**: {c['view']} / {c['scheme']}: Spearman ρ = "
                   f"{c['spearman']:.2f} over {c['n']} targets.")
    return out


def _tables(report: SensitivityReport, view: str):
    """(scheme, mode, target -> entry) for every non-empty table of ``view``."""
    for scheme in report.schemes:
        for mode in ("measured", "estimated"):
            table = report.table(view, scheme, mode)
            if table:
                yield scheme, mode, table


def _outlier_rows(report: SensitivityReport) -> list[str]:
    rows = []
    for kind in report.units.kinds:
        ratios = [report.activation_stats[u.modules[0]]["outlier_ratio"]
                  for u in report.units.of_kind(kind)
                  if u.modules[0] in report.activation_stats]
        if not ratios:
            continue
        worst = int(np.argmax(ratios))
        rows.append(f"| {kind} | {np.median(ratios):.1f} | {max(ratios):.1f} (block "
                    f"{report.units.of_kind(kind)[worst].block}) |")
    return rows


def markdown(report: SensitivityReport, plots: dict[str, str], notes: list[str]) -> str:
    """The analysis as a Markdown page (plots linked relatively)."""
    t = report.text
    lines = [
        f"# FP4 sensitivity of {report.model}",
        "",
        f"Model fingerprint `{report.model_fingerprint}`; {report.units.n_blocks} decoder "
        f"blocks, {len(report.units.units)} units ({len(report.units.linears())} linears); "
        f"text: {t.get('source', 'given windows')}, {t['windows']} windows × "
        f"{t['window_tokens']} tokens; base perplexity {report.base_ppl:.3f}; "
        f"schemes {', '.join(report.schemes)}. KL is the mean per-token KL(base ‖ quantized) "
        "of next-token distributions; ± is one standard error over windows.",
        "",
        *[f"> {n}" for n in notes],
        "",
        "## Findings",
        "",
        *[f"- {f}" for f in findings(report)],
        "",
    ]
    for key, title in (("components", "Components"), ("blocks", "Blocks"),
                       ("grid", "Unit × block grid")):
        if key in plots:
            lines += [f"![{title}]({plots[key]})", ""]

    for scheme, mode, table in _tables(report, "component"):
        lines += [f"### Components, {scheme} ({mode})", "",
                  "| component | KL | ΔPPL | top-1 agreement |", "|---|---|---|---|"]
        lines += [f"| {e.target} | {_fmt(e.kl, e.kl_se)} | {_fmt(e.dppl, e.dppl_se, 3)} | "
                  f"{_fmt(e.top1, e.top1_se, 3)} |"
                  for e in sorted(table.values(), key=lambda e: e.kl, reverse=True)]
        lines.append("")
    for scheme, mode, iso in _tables(report, "block_isolate"):
        gain = protect_gain(report, scheme, mode)
        lines += [f"### Blocks, {scheme} ({mode})", "",
                  "| block | isolate KL | isolate ΔPPL | protect: KL saved |",
                  "|---|---|---|---|"]
        lines += [f"| {b} | {_fmt(iso[b].kl, iso[b].kl_se)} | "
                  f"{_fmt(iso[b].dppl, iso[b].dppl_se, 3)} | {_fmt(gain.get(b))} |"
                  for b in sorted(iso, key=int)]
        lines.append("")
    for scheme, mode, grid in _tables(report, "grid"):
        lines += [f"### Most sensitive units, {scheme} ({mode}; {len(grid)} units)", "",
                  "| unit | KL |", "|---|---|"]
        lines += [f"| {e.target} | {_fmt(e.kl, e.kl_se, 5)} |"
                  for e in sorted(grid.values(), key=lambda e: e.kl, reverse=True)[:10]]
        lines.append("")
    if report.correlations:
        lines += ["### Estimated vs measured", "", "| view | scheme | targets | Spearman ρ |",
                  "|---|---|---|---|"]
        lines += [f"| {c['view']} | {c['scheme']} | {c['n']} | {c['spearman']:.3f} |"
                  for c in report.correlations]
        lines.append("")
    rows = _outlier_rows(report)
    if rows:
        lines += ["### Activation outliers (input max / p99.9 of |x|)", "",
                  "W4A4 schemes quantize these inputs; large ratios mean a few outliers set "
                  "the block scales.", "", "| unit kind | median over blocks | worst |",
                  "|---|---|---|", *rows, ""]
    c = report.cost
    lines += ["### Cost", ""]
    if c.get("naive_block_forwards"):
        lines.append(f"- measured: {c['measured_block_forwards']} block forwards instead of "
                     f"{c['naive_block_forwards']} for full-model runs "
                     f"({c['measured_block_forwards'] / c['naive_block_forwards']:.0%}), "
                     f"{c['seconds'].get('measured', 0):.0f} s")
    if "estimated" in c.get("seconds", {}):
        lines.append(f"- estimated: {c.get('estimated_forward_backward_passes', 0)} forward + "
                     f"backward passes, {c['seconds']['estimated']:.0f} s")
    for name, ph in c.get("phases", {}).items():
        spent = (f", {ph['measured_block_forwards']} block forwards instead of "
                 f"{ph['naive_block_forwards']}" if ph.get("naive_block_forwards") else "")
        timed = "" if ph.get("timed", True) else " (resumed from cache: not a timing)"
        lines.append(f"- {name}: {ph['wall_s']:.0f} s{timed}{spent}")
    if "cached_entries" in c:
        lines.append(f"- results taken from the cache: {c['cached_entries']}")
    if report.skipped:
        lines += ["", "### Left out", ""]
        lines += [f"- {s['unit']} under {s['scheme']}: {s['reason']}" for s in report.skipped]
    if report.units.outside:
        lines += ["", f"Never quantized (outside the decoder blocks): "
                  f"{', '.join(report.units.outside)}."]
    return "\n".join(lines) + "\n"


def write_analysis(report: SensitivityReport, out_dir: str | os.PathLike,
                   notes: list[str] | None = None, plots: bool = True) -> dict[str, Path]:
    """Write sensitivity.json, report.md and the plots into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sensitivity": report.save(out / "sensitivity.json")}
    made: dict[str, str] = {}
    if plots:
        for key, fn in (("components", plot_components), ("blocks", plot_blocks),
                        ("grid", plot_grid)):
            p = fn(report, out / f"{key}.png")
            if p is not None:
                paths[key] = p
                made[key] = p.name
    md = out / "report.md"
    md.write_text(markdown(report, made, notes or []))
    paths["report"] = md
    return paths


# --- compatibility: the model card moved to fp4sense.model_card --------------------------
def __getattr__(name: str):
    """``fp4sense.report.write_model_card`` / ``plot_plan`` of 0.3: deprecated aliases of
    :mod:`fp4sense.model_card` for one release."""
    if name in ("write_model_card", "plot_plan", "SCHEME_COLOURS"):
        import warnings

        from fp4sense import model_card

        warnings.warn(f"fp4sense.report.{name} moved to fp4sense.model_card.{name}; the "
                      "alias goes in 0.5", DeprecationWarning, stacklevel=2)
        return getattr(model_card, name)
    raise AttributeError(f"module 'fp4sense.report' has no attribute {name!r}")
