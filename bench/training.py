"""FP4 training on the bundled SmolLM2-135M: analyze-training in both modes (the estimate
and short trials per block, component and GEMM, with their rank correlation), then
train-trial of its policy against all-BF16, all-FP4 and NVIDIA's rule from one start.

    .venv/bin/python -m bench training [--windows 4] [--tokens 256] [--eval-windows 4]
        [--trial-steps 4] [--seeds 2] [--steps 8] [--monitor-every 4] [--recipe nvfp4]
        [--estimate-only | --no-train-trial] [--trials-from bench/results/FILE.json]
        [--no-mxfp8] [--no-cache]
        [--out bench/results/training.json]

The analysis uses the fp4sense cache: a run stopped in its trials resumes.
``--trials-from`` scores the estimate against the trials of an earlier result instead of
running them again (its command must name the same windows, tokens, seeds, steps and
held-aside windows; the trials do not depend on the estimate): for a change of the
estimate alone.

Writes bench/results/training.json (the figures, the wall times, the diagnosis's cost in
all-BF16 training steps of the trials' batch, timed in the same run) and
bench/results/training-report.md (analyze-training's report.md, the tables).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS, command

FP4SENSE = str(Path(sys.executable).parent / "fp4sense")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--windows", type=int, default=4, help="analysis windows")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=4,
                        help="held-aside windows of the trials and train-trial")
    parser.add_argument("--trial-steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="train-trial steps")
    parser.add_argument("--monitor-every", type=int, default=4)
    parser.add_argument("--recipe", default="nvfp4")
    parser.add_argument("--estimate-only", action="store_true",
                        help="the estimate and the policy only: no trials, no train-trial")
    parser.add_argument("--no-train-trial", action="store_true",
                        help="analyze-training in both modes only: no train-trial arms")
    parser.add_argument("--trials-from", type=Path, default=None,
                        help="the trials of an earlier bench training result")
    parser.add_argument("--no-mxfp8", action="store_true",
                        help="the policy picks BF16 or FP4 per GEMM (NVIDIA's rule's menu)")
    parser.add_argument("--low-memory", action="store_true",
                        help="analyze-training --low-memory (with --estimate-only or "
                        "--trials-from: the estimate block by block)")
    parser.add_argument("--no-cache", action="store_true",
                        help="analyze without the fp4sense cache (for its wall time)")
    parser.add_argument("--out", type=Path, default=RESULTS / "training.json",
                        help="the figures (the report beside it, NAME-report.md)")


def _timed(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return time.perf_counter() - t, proc.stdout


def bf16_step_s(windows: int, tokens: int, batch: int = 2, steps: int = 3) -> float:
    """Seconds of one all-BF16 AdamW training step of the bundled model on ``batch``
    calibration windows of ``tokens`` (the trials' step), the mean of ``steps`` after one
    warm-up: the unit of the diagnosis-cost target."""
    import torch

    from fp4sense.inputs.models import analysis_windows, load_model

    model, tok, _ = load_model(None)
    data = analysis_windows(tok, None, max(windows, batch), tokens)[:batch]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(input_ids=data, labels=data).loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return sum(times[1:]) / steps


def by_windows(views: dict, eval_windows: int) -> dict:
    """Per view with three trials or more: the estimate's Spearman rho against the trials
    scored on their first 4, 8, ... held-aside windows (each window's Δ loss, seed mean,
    is in the trials' rows), to show what more text does to it."""
    from scipy.stats import spearmanr

    out = {}
    for view, rows in views.items():
        rows = [r for r in rows if (r.get("measured") or {}).get("per_window")]
        if len(rows) < 3:
            continue
        est = [r["damage"]["total"] if isinstance(r["damage"], dict) else r["damage"]
               for r in rows]
        out[view] = {n: round(float(spearmanr(est, [sum(r["measured"]["per_window"][:n]) / n
                                                  for r in rows]).statistic), 3)
                     for n in (4, 8, 12, 16, 24, 32) if n <= eval_windows}
    return out


def ceiling(agreement: dict) -> dict:
    """Per view, from the trials' split-half rho r: about what an exact estimate could
    reach against the trials on all their windows, sqrt(2r / (1 + r)) (Spearman-Brown,
    classical test theory; None where r <= 0)."""
    return {v: None if r is None or r <= 0 else round((2 * r / (1 + r)) ** 0.5, 3)
            for v, r in (agreement or {}).items()}


#: what an earlier result's trials must share with this run to be scored against it
SAME_TRIALS = ("windows", "tokens", "seeds", "trial_steps", "eval_windows", "recipe")


def with_trials(result: dict, earlier: dict, args: argparse.Namespace) -> dict:
    """``result`` (analyze-training, estimated) with the measured rows of ``earlier`` (a
    bench training result) in its views, and their rank correlations. Refused by name
    where the earlier command ran its trials on other windows, seeds or steps."""
    from fp4sense.training.views import rank_correlations, trial_agreement

    parser = argparse.ArgumentParser()
    add_args(parser)
    then = parser.parse_known_args(earlier["command"].split("bench training", 1)[-1].split())[0]
    differ = [k for k in SAME_TRIALS if getattr(then, k) != getattr(args, k)]
    if differ:
        sys.exit(f"--trials-from: its trials ran with other {', '.join(differ)} "
                 f"({', '.join(f'{k}={getattr(then, k)}' for k in differ)}); run them again "
                 "without --trials-from, or match its command")
    views = result["views"]
    for view, key in (("block", "block"), ("component", "kind"), ("gemm", "gemm")):
        measured = {r[key]: r["measured"] for r in earlier[f"{view}_view"] if "measured" in r}
        missing = [r[key] for r in views[view] if r[key] not in measured]
        if missing:
            sys.exit(f"--trials-from: no trial of {view} {missing[0]} there")
        for r in views[view]:
            r["measured"] = measured[r[key]]
    return {**result, "views": views, "rank_correlation": rank_correlations(views),
            "trial_agreement": trial_agreement(views)}


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="fp4sense-training-"))
    size = ["--analysis-windows", str(args.windows), "--tokens", str(args.tokens),
            "--seeds", str(args.seeds), "--eval-windows", str(args.eval_windows)]
    mode = "estimated" if args.estimate_only or args.trials_from else "both"
    analysis_s, _ = _timed([FP4SENSE, "analyze-training", *size, "--recipe", args.recipe,
                            "--mode", mode, "--trial-steps", str(args.trial_steps),
                            "--out", str(work / "a"), "--json",
                            *(["--no-cache"] if args.no_cache else []),
                            *(["--low-memory"] if args.low_memory else []),
                            *(["--no-mxfp8"] if args.no_mxfp8 else [])])
    result = json.loads((work / "a" / "training-sensitivity.json").read_text())
    if args.trials_from:
        result = with_trials(result, json.loads(args.trials_from.read_text()), args)
        mode = "both"
    policy = json.loads((work / "a" / "training-policy.json").read_text())
    trial_s, line, trial = None, None, None
    if not (args.estimate_only or args.no_train_trial):
        trial_s, line = _timed([FP4SENSE, "train-trial", "--policy",
                                str(work / "a" / "training-policy.json"), "--steps",
                                str(args.steps), "--monitor-every", str(args.monitor_every),
                                *size, "--out", str(work / "t"), "--json"])
        trial = json.loads((work / "t" / "trial.json").read_text())
    blocks = result["views"]["block"]
    step_s = bf16_step_s(args.windows, args.tokens)
    out = {"command": command("training", args.argv), "model": result["model"],
           "trials_from": str(args.trials_from) if args.trials_from else None,
           "recipe": result["recipe"], "analysis_s": round(analysis_s, 1),
           "bf16_step_s": round(step_s, 2),
           "analysis_in_bf16_steps": round(analysis_s / step_s, 1),
           "train_trial_s": None if trial_s is None else round(trial_s, 1),
           "rank_correlation": result["rank_correlation"],
           "trial_agreement": result.get("trial_agreement"),
           "exact_estimate_ceiling": ceiling(result.get("trial_agreement")),
           "rank_correlation_by_windows": by_windows(result["views"], args.eval_windows),
           "blocks_by_estimate": [r["block"] for r in sorted(
               blocks, key=lambda r: -r["damage"]["total"])],
           "blocks_by_trial": [r["block"] for r in sorted(
               blocks, key=lambda r: -r["measured"]["delta"])] if mode == "both" else None,
           "gemm_view": result["views"]["gemm"], "component_view": result["views"]["component"],
           "block_view": blocks,
           "policy": {k: policy[k] for k in ("predicted_damage", "cost_s",
                                             "bf16_flops_share", "budget", "nvidia_rule")},
           "policy_gemms": {p: sum(1 for c in policy["choices"] for g in c["gemms"].values()
                                   if g == p) for p in policy["options"]},
           "policy_bf16_units": {c["unit"]: [g for g, p in c["gemms"].items() if p == "bf16"]
                                 for c in policy["choices"] if "bf16" in c["gemms"].values()},
           "train_trial": None if trial is None else {
               "arms": json.loads(line)["arms"], "differences": trial["differences"],
               "stop_helping": trial["stop_helping"],
               "events": {n: a["events"] for n, a in trial["arms"].items()}}}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    report = (work / "a" / "report.md").read_text().splitlines()  # its plots stay behind
    args.out.with_name(f"{args.out.stem}-report.md").write_text(
        "\n".join(ln for ln in report if not ln.startswith("![")) + "\n")
    print(json.dumps({k: out[k] for k in ("analysis_s", "bf16_step_s", "analysis_in_bf16_steps",
                                          "train_trial_s", "rank_correlation",
                                          "trial_agreement", "exact_estimate_ceiling",
                                          "rank_correlation_by_windows", "train_trial")},
                     indent=1))
    return 0
