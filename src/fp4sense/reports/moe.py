"""The Mixture-of-Experts part of an analysis report: experts per block, how the router
spread the analysis tokens over them (coverage), what stays in 16 bits and why, weights
nothing explains, and a routing heat map."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp4sense.diagnosis import SensitivityReport

__all__ = ["LOW_COVERAGE", "low_coverage", "moe_findings", "moe_lines", "plot_routing"]

#: an expert is named as under-calibrated below this share of an even split of tokens
LOW_COVERAGE = 0.1


def low_coverage(routing: dict[str, list[int]]) -> dict[str, list[tuple[int, int]]]:
    """MoE unit -> [(expert, tokens)] of experts that got less than LOW_COVERAGE of an
    even share of the routed tokens (``routing``: unit -> tokens per expert)."""
    out = {}
    for unit, counts in routing.items():
        even = sum(counts) / max(len(counts), 1)
        few = [(e, n) for e, n in enumerate(counts) if n < LOW_COVERAGE * even]
        if few:
            out[unit] = few
    return out


def moe_findings(report: SensitivityReport) -> list[str]:
    """Findings about experts: coverage and unexplained weights (none for dense models)."""
    out = []
    few = low_coverage(report.routing)
    if few:
        named = sum(len(v) for v in few.values())
        shown = "; ".join(f"{u}: " + ", ".join(f"expert {e} ({n} tokens)" for e, n in v[:4])
                          + (", ..." if len(v) > 4 else "") for u, v in list(few.items())[:3])
        out.append(f"**Experts with few analysis tokens**: {named} expert(s) got less than "
                   f"{LOW_COVERAGE:.0%} of an even share ({shown}); their scores rest on "
                   "little text (their input scales come from all tokens, as llm-compressor "
                   "calibrates experts). Analyze more text to cover them.")
    if report.units.unaccounted:
        shown = ", ".join(f"{n} ({s:.1%})" for n, s in report.units.unaccounted.items())
        out.append(f"**Warning - weights fp4sense does not quantize**: {shown}; they are "
                   "neither units nor a known kind (embeddings, norms, routers, lm_head).")
    return out


def moe_lines(report: SensitivityReport) -> list[str]:
    """The report's MoE section (empty for a dense model)."""
    units = report.units
    experts = [u for u in units.units if u.experts]
    lines: list[str] = []
    if experts:
        total = sum(u.numel for u in units.units)
        held = sum(u.numel for u in experts)
        k = units.experts_per_token
        lines += ["### Experts", "",
                  f"{len(experts)} blocks hold routed experts ({experts[0].experts} per block"
                  + (f", {k} per token" if k else "") + f"): {held / total:.0%} of the "
                  "quantizable weights. Each block's experts are one unit (vLLM's fused-MoE "
                  "layer takes one scheme for all of them); the `experts` view scores each "
                  "expert alone. Every expert's input statistics come from all tokens, as "
                  "llm-compressor calibrates experts, so no expert gets an empty input scale.",
                  ""]
        if report.routing:
            lines += ["| experts unit | tokens routed (min / median / max per expert) | "
                      "experts under " f"{LOW_COVERAGE:.0%} of an even share |", "|---|---|---|"]
            few = low_coverage(report.routing)
            for name, counts in report.routing.items():
                low = ", ".join(str(e) for e, _ in few.get(name, [])) or "-"
                lines.append(f"| {name} | {min(counts)} / {int(np.median(counts))} / "
                             f"{max(counts)} | {low} |")
            lines.append("")
        rows = _projection_outliers(report, experts)
        if rows:
            lines += ["| expert projection | input max / p99.9, median over experts | worst |",
                      "|---|---|---|", *rows, ""]
    if units.left_alone:
        reasons: dict[str, list[str]] = {}
        for name, why in units.left_alone.items():
            reasons.setdefault(why, []).append(name)
        lines += ["Left in 16 bits inside the blocks:", ""]
        lines += [f"- {why}: {', '.join(names)}" for why, names in reasons.items()]
        lines.append("")
    if units.unaccounted:
        lines += ["**Warning**: weights no unit covers and fp4sense does not know: "
                  + ", ".join(f"`{n}` ({s:.1%} of the model)"
                              for n, s in units.unaccounted.items()), ""]
    return lines


def _projection_outliers(report: SensitivityReport, experts) -> list[str]:
    stats = report.activation_stats
    width = experts[0].per_expert
    rows = []
    for j in range(width):
        named = [(m, stats[m]["outlier_ratio"]) for u in experts
                 for m in u.modules[j::width] if m in stats]
        if not named:
            continue
        worst = max(named, key=lambda t: t[1])
        kind = experts[0].modules[j].split(f".{experts[0].kind}.", 1)[1].split(".", 1)[1]
        rows.append(f"| {kind} | {np.median([r for _, r in named]):.1f} | {worst[1]:.1f} "
                    f"({worst[0]}) |")
    return rows


def plot_routing(report: SensitivityReport, path: Path) -> Path | None:
    """Heat map: tokens routed to each expert (columns) of each MoE block (rows)."""
    if not report.routing:
        return None
    from fp4sense.reports.plots import pyplot, save_figure

    plt = pyplot()
    names = list(report.routing)
    grid = np.array([report.routing[n] for n in names], dtype=float)
    fig, ax = plt.subplots(figsize=(min(14, 3 + 0.25 * grid.shape[1]),
                                    min(10, 1.5 + 0.3 * len(names))))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("expert")
    ax.set_title("tokens routed to each expert (analysis text)")
    fig.colorbar(im, ax=ax, label="tokens")
    return save_figure(fig, path)
