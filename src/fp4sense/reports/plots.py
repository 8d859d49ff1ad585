"""The analysis report's plots (PNG): components, blocks, the unit × block grid; FP4
training curves; and the matplotlib set-up the model card's plan picture shares."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp4sense.diagnosis import SensitivityReport
from fp4sense.structure.units import short_kind

__all__ = ["plot_blocks", "plot_components", "plot_grid", "plot_training", "protect_gain",
           "pyplot", "table_mode", "save_figure"]


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


def table_mode(report: SensitivityReport, view: str, scheme: str) -> str | None:
    """The mode a view was computed in for a scheme (measured first), or None."""
    for mode in ("measured", "estimated"):
        if report.table(view, scheme, mode):
            return mode
    return None


# --- plots ----------------------------------------------------------------------------
def plot_components(report: SensitivityReport, path: Path) -> Path | None:
    """Bars: KL per component kind, one bar per scheme, with ±SE whiskers (log scale)."""
    schemes = [s for s in report.schemes if table_mode(report, "component", s)]
    if not schemes:
        return None
    plt = pyplot()
    targets = list(report.table("component", schemes[0], table_mode(report, "component",
                                                                   schemes[0])))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(targets)), 4))
    width = 0.8 / len(schemes)
    for i, scheme in enumerate(schemes):
        mode = table_mode(report, "component", scheme)
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
        mode = table_mode(report, "block_isolate", scheme)
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
    panels = [(s, table_mode(report, "grid", s)) for s in report.schemes]
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


def protect_gain(report: SensitivityReport, scheme: str, mode: str) -> dict[str, float]:
    """block -> KL(all quantized) - KL(all but this block)."""
    everything = report.table("model", scheme, mode).get("all")
    protect = report.table("block_protect", scheme, mode)
    if everything is None:
        return {}
    return {b: everything.kl - e.kl for b, e in protect.items()}


def plot_training(record: dict, path: Path) -> Path:
    """QAD's loss and gradient-norm curves per step, rollbacks marked."""
    plt = pyplot()
    hist = record["history"]
    fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(9, 3.2))
    block = record.get("mode") == "block"  # each block's own loss, block after block
    ax_loss.plot(hist["step"], hist["loss"], lw=0.8,
                 label=("relative output error of the block trained, per step" if block
                        else "KL(base ‖ quantized), per step"))
    if not block:
        ax_loss.axhline(record["loss_before"], color="grey", ls="--", lw=0.8, label="before")
        ax_loss.axhline(record["loss_after"], color="green", ls="--", lw=0.8, label="after")
    ax_norm.plot(hist["step"], hist["grad_norm"], lw=0.8, color="tab:orange")
    for r in record["rollbacks"]:
        for ax in (ax_loss, ax_norm):
            ax.axvline(r["step"], color="red", lw=0.8)
    ax_loss.set(xlabel="step (block-wise: block x steps + step)" if block else "step",
                ylabel="relative output error" if block else "KL", title="distillation loss",
                yscale="log" if block else "linear")
    ax_norm.set(xlabel="step", ylabel="gradient norm (before clipping at 1)", yscale="log",
                title="gradient norm")
    ax_loss.legend(fontsize=7)
    return save_figure(fig, path)
