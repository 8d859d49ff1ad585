"""``fp4sense train-trial``: a policy validated by training. The arms ``bf16``, ``all-fp4``,
``nvidia-rule`` (whole blocks in BF16 at the policy's share, first and last) and
``policy`` train from one start with the same data order and seeds; each arm's
held-aside loss (under its own forward, and in BF16) ± SE over seeds, the paired
differences to ``bf16``, the loss curves and the stability monitor's events go into
trial.json, report.md and loss-curves.png. Each finished arm is cached: a run stopped by
Ctrl-C or SIGTERM resumes at the next arm."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from fp4sense import defaults, options_training
from fp4sense.inputs.assets import default_model_path
from fp4sense.inputs.models import load_model
from fp4sense.inputs.texts import model_context, protocol_windows
from fp4sense.numerics.training import GEMMS, get_recipe
from fp4sense.options import check
from fp4sense.reports.training import plot_trial
from fp4sense.runtime.devices import resolve
from fp4sense.runtime.outputs import check_analysis_output, local_inputs, record_written
from fp4sense.structure.lineage import text_name
from fp4sense.structure.units import find_units, model_name
from fp4sense.training.policy import policy_linears
from fp4sense.training.store import RunStore, run_key
from fp4sense.training.trials import Arm, TrialResult, paired_differences, run_trials
from fp4sense.validate import InputError, read_json

__all__ = ["ARMS", "TRIAL_FILES", "read_policy", "train_trial"]

ARMS = ("bf16", "all-fp4", "nvidia-rule", "policy")
TRIAL_FILES = ("trial.json", "report.md", "loss-curves.png")


def read_policy(path: str | os.PathLike) -> dict:
    """training-policy.json, checked: one line naming the file and what is wrong."""
    policy = read_json(Path(path), "training policy", "write it again with fp4sense "
                       "analyze-training")
    try:
        get_recipe(policy["recipe"])
        for ch in policy["choices"]:
            if set(ch["gemms"]) != set(GEMMS) or not ch["modules"]:
                raise ValueError(f"unit {ch.get('unit')!r} lacks a GEMM or its modules")
            for p in ch["gemms"].values():
                get_recipe(p)
        policy["nvidia_rule"]["bf16_blocks"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: not a training policy fp4sense wrote ({exc}); write it "
                         "again with fp4sense analyze-training") from None
    return policy


def train_trial(
    model: str | os.PathLike | None = None,
    *,
    policy: str | os.PathLike,
    steps: int = 32,
    text: str | os.PathLike | None = None,
    eval_text: str | os.PathLike | None = None,
    analysis_windows: int = 16,
    window_tokens: int = defaults.WINDOW_TOKENS,
    raw_windows: bool = False,
    eval_windows: int = defaults.EVAL_WINDOWS,
    seeds: int = defaults.TRAINING_SEEDS,
    lr: float = defaults.TRIAL_LR,
    monitor_every: int = 4,
    out_dir: str | os.PathLike | None = None,
    cache: bool | str | os.PathLike = True,
    plots: bool = True,
    device: str = "cpu",
    dtype: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Train the four arms of ``policy`` (training-policy.json) for ``steps`` steps each;
    returns trial.json's content (``arms``: name -> loss, se, loss_bf16, se_bf16)."""
    check(options_training.TRAIN_TRIAL, locals(), "train_trial")
    plan = read_policy(policy)
    placement = resolve(device, dtype, log=log)
    cache_folder = check_analysis_output(out_dir, cache, local_inputs(
        model or default_model_path(), text, eval_text, policy), "training", TRIAL_FILES)
    hf_model, tokenizer, _ = load_model(model, placement.dtype, placement.device)
    names = {n for n, _ in hf_model.named_modules()}
    missing = [m for ch in plan["choices"] for m in ch["modules"] if m not in names]
    if missing:
        raise InputError(f"{policy}: the policy names {missing[0]!r}, which this model does "
                         "not have; make the policy for this model (analyze-training)")
    context = model_context(hf_model.config)
    train = protocol_windows(tokenizer, "calibration", analysis_windows, text, window_tokens,
                             raw_windows, context, log)
    held = protocol_windows(tokenizer, "evaluation", eval_windows, eval_text, window_tokens,
                            raw_windows, context, log)
    recipe = plan["recipe"]
    arms = [Arm("bf16", {}),
            Arm("all-fp4", {m: recipe for ch in plan["choices"] for m in ch["modules"]}),
            Arm("nvidia-rule", policy_linears(plan, rule=True)),
            Arm("policy", policy_linears(plan))]
    units = find_units(hf_model, train[:1, :16])
    store = RunStore(cache_folder, run_key(hf_model, [train, held], [
        "train-trial", steps, seeds, lr, monitor_every, recipe]))
    bar = tqdm(total=len(arms) * seeds * steps, desc="train-trial (steps)",
               disable=not progress)
    results = {}
    for arm in arms:  # each finished arm is kept: a stopped run resumes at the next
        key = hashlib.sha256(json.dumps(arm.policy, sort_keys=True).encode()).hexdigest()
        results[arm.name] = TrialResult.from_dict(store.get(
            f"arm:{arm.name}:{key[:16]}", lambda arm=arm: run_trials(
                hf_model, train, held, [arm], steps, seeds, lr, monitor_units=units,
                monitor_recipe=recipe, monitor_every=monitor_every,
                progress=bar.update)[arm.name].to_dict()))
    bar.close()
    out = {"model": model_name(hf_model, model or ""), "recipe": recipe,
           "text": text_name(text), "eval_text": text_name(eval_text), "steps": steps,
           "seeds": seeds, "lr": lr, "windows": analysis_windows,
           "window_tokens": window_tokens,
           "arms": {n: r.to_dict() for n, r in results.items()},
           "differences": {n: d.to_dict() for n, d in paired_differences(results).items()},
           "stop_helping": {n: r.monitor.stop_helping(monitor_every)
                            for n, r in results.items()}}
    for name, r in results.items():
        for event in r.monitor.events:
            log(f"{name}: {event}")
    if out_dir is not None:
        _write(Path(out_dir), out, plots, log)
    return out


def _write(folder: Path, out: dict, plots: bool, log) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trial.json").write_text(json.dumps(out, indent=1))
    written = ["trial.json"]
    if plots:
        written.append(plot_trial(folder, out["arms"]))
    lines = [f"# FP4 training trial: {out['model']} ({out['recipe']})", "",
             f"{out['steps']} AdamW steps (lr {out['lr']:g}) from one start, {out['seeds']} "
             f"seeds; held-aside loss on {out['eval_text']}.", "",
             "| arm | loss (its forward) ± SE | loss in BF16 ± SE | Δ vs bf16 ± SE (paired) |",
             "|---|---|---|---|"]
    for name, a in out["arms"].items():
        d = out["differences"].get(name)
        lines.append(f"| {name} | {a['loss']:.4f} ± {a['se']:.4f} | {a['loss_bf16']:.4f} ± "
                     f"{a['se_bf16']:.4f} | "
                     + ("-" if d is None else f"{d['delta']:+.4f} ± {d['se']:.4f}") + " |")
    events = [f"- {n}: {e}" for n, a in out["arms"].items() for e in a["events"]]
    stops = [f"- {n}: {u} from step {s}" for n, us in out["stop_helping"].items()
             for u, s in us.items()]
    lines += ["", "## Stability", ""] + (events or ["- no loss spike or divergence"])
    lines += ["", "FP4 gradients stop helping (noise above 1/√3 of the gradient):", ""] + (
        stops or ["- nowhere in these steps"])
    if plots:
        lines += ["", "![loss curves](loss-curves.png)"]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    written.append("report.md")
    record_written(folder, [folder / n for n in written])
    for name in written:
        log(f"{name:16s} {folder / name}")
