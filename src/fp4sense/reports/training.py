"""The FP4 training report: the views of training-sensitivity.json (block, component,
GEMM) as tables and plots, the findings (which blocks and GEMMs hurt, the first/last
blocks question for this model), the policy beside NVIDIA's rule, and the exports."""

from __future__ import annotations

from pathlib import Path

from fp4sense.numerics.training import GEMMS
from fp4sense.structure.units import short_kind

__all__ = ["PLOTS", "findings", "plot_training_views", "plot_trial", "write_training_report"]

PLOTS = {"block": "training-block.png", "component": "training-component.png",
         "gemm": "training-gemm.png"}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _measured(row: dict) -> str:
    m = row.get("measured")
    return "-" if not m else f"{m['delta']:+.4f} ± {m['se']:.4f}"


def findings(result: dict, policy: dict | None = None) -> list[str]:
    """A few lines a reader acts on."""
    out = []
    blocks = result["views"].get("block") or []
    if blocks:
        worst = sorted(blocks, key=lambda r: -r["damage"]["total"])[:3]
        n = len(blocks)
        edge = max(1, round(0.15 * n))
        first = sum(r["damage"]["total"] for r in blocks[:edge])
        last = sum(r["damage"]["total"] for r in blocks[n - edge:])
        out.append(f"Blocks whose FP4 hurts training most (estimated): "
                   f"{', '.join(str(r['block']) for r in worst)}; the first {edge} "
                   f"block(s) carry {first:.3g} of the damage, the last {edge} {last:.3g}: "
                   + ("the **last** blocks matter more here, as NVIDIA's rule assumes"
                      if last >= first else "the **first** blocks matter more here, "
                      "unlike NVIDIA's rule (most BF16 blocks at the end)"))
    gemms = result["views"].get("gemm") or []
    if gemms:
        top = max(gemms, key=lambda r: r["damage"])
        out.append(f"Of the three GEMMs, **{top['gemm']}** in FP4 does the most damage "
                   f"({top['damage']:.3g} of {sum(r['damage'] for r in gemms):.3g}).")
    hurt = [u["name"] for u in result["units"] if not u["fp4_gradients_help"]]
    if hurt:
        out.append(f"{len(hurt)} unit(s) have wgrad noise above 1/√3 of their gradient, "
                   f"where FP4 gradients stop helping: {', '.join(hurt[:5])}"
                   + (" ..." if len(hurt) > 5 else ""))
    held = (result.get("trials") or {}).get("eval_windows", 0) * result["window_tokens"]
    agree = result.get("trial_agreement") or {}
    for view, rho in (result.get("rank_correlation") or {}).items():
        if rho is not None:
            own = ("" if agree.get(view) is None else f"; the trials on one half of those "
                   f"tokens against the other half: {agree[view]:.2f}")
            out.append(f"Estimate vs trials ({view} view): Spearman {rho:.2f} (trials "
                       f"scored on {held:,} held-aside tokens: fewer rank by the text drawn"
                       f"{own}).")
    if policy:
        rule = policy["nvidia_rule"]
        out.append(f"Policy at {policy['budget']['step_time_s'] * 1e3:.4g} ms of linear GEMMs "
                   f"per step ({policy['part']}): predicted damage "
                   f"{policy['predicted_damage']:.3g}; NVIDIA's rule (BF16 blocks "
                   f"{rule['bf16_blocks']}) {rule['predicted_damage']:.3g} at "
                   f"{rule['cost_s'] * 1e3:.4g} ms.")
    return out


def _kinds(forward: dict | None) -> str:
    """The clause of the report's first paragraph on fprop's damage."""
    if not forward:  # a result from before the forward's costs were measured
        return "fprop's is its diagonal Fisher form alone"
    return ("each kind's fprop in FP4 costs " + ", ".join(
        f"{short_kind(k)} {v:.3g}" for k, v in forward.items())
        + ", measured, shared out to its units by their diagonal Fisher form")


def write_training_report(folder: Path, result: dict, policy: dict | None,
                          exports: list[str], plots: bool) -> Path:
    stakes = result["gradient_stakes"]
    lines = [f"# FP4 training sensitivity: {result['model']}", "",
             f"Recipe **{result['recipe']}** ({result['recipe_source']}); "
             f"{result['windows']} windows × {result['window_tokens']} tokens of "
             f"{result['text']}, {result['seeds']} seed(s); modes: "
             f"{', '.join(result['modes'])}. Damage: nats of training loss, fprop's the "
             "loss its forward adds, dgrad's and wgrad's their share of what that GEMM in "
             f"FP4 costs over {stakes['steps']} steps at lr {stakes['lr']:g}, measured ("
             f"exact steps gain {stakes['progress']:.3g}; FP4 dgrad costs "
             f"{stakes['dgrad']:.3g}, wgrad {stakes['wgrad']:.3g}; "
             f"{_kinds(result.get('forward_stakes'))}; docs/training.md).", "",
             "## Findings", ""]
    lines += [f"- {f}" for f in findings(result, policy)] + [""]
    views = result["views"]
    for view, key in (("block", "block"), ("component", "kind"), ("gemm", "gemm")):
        rows = views.get(view)
        if not rows:
            continue
        lines += [f"## {view.capitalize()} view", ""]
        if plots:
            lines += [f"![{view}]({PLOTS[view]})", ""]
        if view == "gemm":
            lines += ["| GEMM | estimated damage | measured Δ loss ± SE |", "|---|---|---|"]
            lines += [f"| {r['gemm']} | {_fmt(r['damage'])} | {_measured(r)} |" for r in rows]
        else:
            lines += [f"| {key} | fprop | dgrad | wgrad | total | measured Δ loss ± SE |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {r[key]} | " + " | ".join(_fmt(r['damage'][g]) for g in GEMMS)
                      + f" | {_fmt(r['damage']['total'])} | {_measured(r)} |" for r in rows]
        lines.append("")
    lines += ["## Units", "", "| unit | fprop err | dgrad err | wgrad err | wgrad cos | "
              "wgrad bias | NSR |", "|---|---|---|---|---|---|---|"]
    for u in result["units"]:
        g = u["gemms"]
        lines.append(f"| {u['name']} | {_fmt(g['fprop']['rel_error'])} | "
                     f"{_fmt(g['dgrad']['rel_error'])} | {_fmt(g['wgrad']['rel_error'])} | "
                     f"{_fmt(g['wgrad'].get('cosine'))} | {_fmt(g['wgrad'].get('bias'))} | "
                     f"{_fmt(u['nsr'])} |")
    if result.get("not_eligible"):
        lines += ["", "Not eligible for the recipe (BF16 in every policy): " + "; ".join(
            f"{u} ({why})" for u, why in result["not_eligible"].items())]
    if result.get("left_in_bf16"):
        lines += ["", "Left in BF16 (not emulated): " + ", ".join(result["left_in_bf16"])]
    if policy:
        lines += ["", "## Policy", "", f"training-policy.json; exports: {', '.join(exports)}.",
                  "", "| unit | fprop | dgrad | wgrad | damage |", "|---|---|---|---|---|"]
        lines += [f"| {c['unit']} | " + " | ".join(c["gemms"][g] for g in GEMMS)
                  + f" | {_fmt(c['damage'])} |" for c in policy["choices"]]
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_training_views(folder: Path, result: dict) -> list[str]:
    """One PNG per view: estimated damage by GEMM (stacked), measured Δ loss beside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for view, key in (("block", "block"), ("component", "kind"), ("gemm", "gemm")):
        rows = result["views"].get(view)
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(rows) + 3), 3.6))
        labels = [str(r[key]) for r in rows]
        x = range(len(rows))
        if view == "gemm":
            ax.bar(x, [r["damage"] for r in rows], color="tab:blue", label="estimated")
        else:
            bottom = [0.0] * len(rows)
            for g, color in zip(GEMMS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
                vals = [r["damage"][g] for r in rows]
                ax.bar(x, vals, bottom=bottom, color=color, label=f"{g} (estimated)")
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(list(x), labels, rotation=45 if view == "component" else 0,
                      ha="right" if view == "component" else "center", fontsize=7)
        ax.set_ylabel("damage (share of gradient power)")
        measured = [r.get("measured") for r in rows]
        if any(measured):
            twin = ax.twinx()
            twin.errorbar([i for i, m in zip(x, measured, strict=True) if m],
                          [m["delta"] for m in measured if m], [m["se"] for m in measured if m],
                          fmt="o", color="black", label="measured Δ loss")
            twin.set_ylabel("Δ held-aside loss vs BF16")
            twin.legend(loc="upper right", fontsize=7)
        ax.legend(loc="upper left", fontsize=7)
        ax.set_title(f"FP4 training sensitivity, {view} view ({result['recipe']})")
        fig.tight_layout()
        fig.savefig(folder / PLOTS[view], dpi=110)
        plt.close(fig)
        written.append(PLOTS[view])
    return written


def plot_trial(folder: Path, arms: dict) -> str:
    """The loss curves of a train-trial's arms (first seed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, arm in arms.items():
        ax.plot(arm["curves"][0], label=f"{name}: {arm['loss']:.4f} ± {arm['se']:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "loss-curves.png", dpi=110)
    plt.close(fig)
    return "loss-curves.png"
