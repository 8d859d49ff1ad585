"""Reports a person reads: Markdown with tables and findings in words, and PNG plots.

Everything here reads a :class:`~fp4sense.diagnosis.SensitivityReport` (or its saved
JSON); nothing is computed twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fp4sense.diagnosis import Entry, SensitivityReport
from fp4sense.reports.moe import moe_findings, moe_lines, plot_routing
from fp4sense.reports.plots import (
    plot_blocks,
    plot_components,
    plot_grid,
    protect_gain,
    table_mode,
)
from fp4sense.reports.rotation import plot_rotation, rotation_findings
from fp4sense.validate import register_unique

__all__ = ["RENDERINGS", "Rendering", "findings", "markdown", "register_rendering",
           "write_analysis"]

#: A difference counts as real when it exceeds this many combined standard errors.
SIGNIFICANT_SE = 2.0


def _fmt(value: float | None, se: float | None = None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = f"{value:.{digits}f}"
    if se is not None and not math.isnan(se):
        text += f" ± {se:.{digits}f}"
    return text


# --- words and tables -----------------------------------------------------------------
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
        mode = table_mode(report, "component", scheme)
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
        mode = table_mode(report, "block_isolate", scheme)
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
    return out + rotation_findings(report) + moe_findings(report)


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


# --- renderings: one per report view, registered beside its plot ------------------------
@dataclass(frozen=True)
class Rendering:
    """How report.md shows a view: its tables, and a plot saved as ``plot_name``.png.
    ``also`` names views shown inside this one (the blocks rendering shows the protect
    and whole-model views); a view without a rendering gets a plain table."""

    view: str
    tables: Callable[[SensitivityReport], list[str]]
    plot: Callable[[SensitivityReport, Path], Path | None] | None = None
    plot_name: str | None = None
    title: str | None = None
    also: tuple[str, ...] = ()


RENDERINGS: dict[str, Rendering] = {}


def register_rendering(view: str, *, plot=None, plot_name: str | None = None,
                       title: str | None = None, also: tuple[str, ...] = ()):
    """Decorator on a tables function ``report -> Markdown lines``: renders the report
    view ``view`` (registered in :mod:`fp4sense.diagnosis.views`) in report.md, with
    ``plot`` saved as ``plot_name``.png."""
    def deco(tables):
        register_unique(RENDERINGS, view, Rendering(view, tables, plot, plot_name, title, also),
                        tables, "rendering of the view")
        return tables
    return deco


@register_rendering("component", plot=plot_components, plot_name="components",
                    title="Components")
def _component_tables(report: SensitivityReport) -> list[str]:
    return _entry_tables(report, "component", "Components", "component")


@register_rendering("block_isolate", plot=plot_blocks, plot_name="blocks", title="Blocks",
                    also=("block_protect", "model"))
def _block_tables(report: SensitivityReport) -> list[str]:
    lines = []
    for scheme, mode, iso in _tables(report, "block_isolate"):
        gain = protect_gain(report, scheme, mode)
        lines += [f"### Blocks, {scheme} ({mode})", "",
                  "| block | isolate KL | isolate ΔPPL | protect: KL saved |",
                  "|---|---|---|---|"]
        lines += [f"| {b} | {_fmt(iso[b].kl, iso[b].kl_se)} | "
                  f"{_fmt(iso[b].dppl, iso[b].dppl_se, 3)} | {_fmt(gain.get(b))} |"
                  for b in sorted(iso, key=int)]
        lines.append("")
    return lines


@register_rendering("grid", plot=plot_grid, plot_name="grid", title="Unit × block grid")
def _grid_tables(report: SensitivityReport) -> list[str]:
    lines = []
    for scheme, mode, grid in _tables(report, "grid"):
        lines += [f"### Most sensitive units, {scheme} ({mode}; {len(grid)} units)", "",
                  "| unit | KL |", "|---|---|"]
        lines += [f"| {e.target} | {_fmt(e.kl, e.kl_se, 5)} |"
                  for e in sorted(grid.values(), key=lambda e: e.kl, reverse=True)[:10]]
        lines.append("")
    return lines


def _generic_tables(report: SensitivityReport, view: str) -> list[str]:
    return _entry_tables(report, view, f"View {view}", "target")


def _entry_tables(report: SensitivityReport, view: str, heading: str, label: str) -> list[str]:
    """One table per scheme and mode: every target's KL, ΔPPL and top-1, worst first."""
    lines = []
    for scheme, mode, table in _tables(report, view):
        lines += [f"### {heading}, {scheme} ({mode})", "",
                  f"| {label} | KL | ΔPPL | top-1 agreement |", "|---|---|---|---|"]
        lines += [f"| {e.target} | {_fmt(e.kl, e.kl_se)} | {_fmt(e.dppl, e.dppl_se, 3)} | "
                  f"{_fmt(e.top1, e.top1_se, 3)} |"
                  for e in sorted(table.values(), key=lambda e: e.kl, reverse=True)]
        lines.append("")
    return lines


def _prefix(text: dict) -> str:
    """How each window starts (the tokens the tokenizer starts a sequence with)."""
    prefix = text.get("window_prefix")
    if prefix is None:  # a report of an earlier fp4sense
        return ""
    return (f", each starting with token id(s) {prefix} as the tokenizer starts a sequence"
            if prefix else ", text tokens only (the tokenizer adds no sequence prefix)")


def markdown(report: SensitivityReport, plots: dict[str, str], notes: list[str]) -> str:
    """The analysis as a Markdown page (plots linked relatively)."""
    t = report.text
    lines = [
        f"# FP4 sensitivity of {report.model}",
        "",
        f"Model fingerprint `{report.model_fingerprint}`; {report.units.n_blocks} decoder "
        f"blocks, {len(report.units.units)} units ({len(report.units.linears())} linears); "
        f"text: {t.get('source', 'given windows')}, {t['windows']} windows × "
        f"{t['window_tokens']} tokens{_prefix(t)}; base perplexity {report.base_ppl:.3f}; "
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
    for r in RENDERINGS.values():
        if r.plot_name in plots:
            lines += [f"![{r.title}]({plots[r.plot_name]})", ""]
    if "routing" in plots:
        lines += [f"![tokens routed to each expert]({plots['routing']})", ""]
    if "rotation" in plots:
        lines += [f"![what a rotation buys, per unit]({plots['rotation']})", ""]
    shown = {v for r in RENDERINGS.values() for v in (r.view, *r.also)}
    for r in RENDERINGS.values():
        lines += r.tables(report)
    for view in sorted({v for v, _, _ in report.views()} - shown):
        lines += _generic_tables(report, view)
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
    lines += moe_lines(report)
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
        for r in RENDERINGS.values():
            p = r.plot(report, out / f"{r.plot_name}.png") if r.plot else None
            if p is not None:
                paths[r.plot_name] = p
                made[r.plot_name] = p.name
    for name, plot in (("routing", plot_routing), ("rotation", plot_rotation)):
        if plots and plot(report, out / f"{name}.png") is not None:
            paths[name] = out / f"{name}.png"
            made[name] = f"{name}.png"
    md = out / "report.md"
    md.write_text(markdown(report, made, notes or []))
    paths["report"] = md
    return paths
