"""``fp4sense analyze-training``: which units, blocks and GEMMs of a model can train in
FP4. Estimates every unit's three GEMMs (one pass, every seed's draws), measures trials per
block, component and GEMM where asked, solves the policy under the budget, and writes
training-sensitivity.json, training-policy.json, the exports, report.md and plots.

The results are cached by model, text windows (the trials' also by their held-aside
windows), recipe and settings: a run stopped in its trials resumes at the next arm."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from fp4sense import defaults, options_training
from fp4sense.inputs.assets import default_model_path
from fp4sense.inputs.models import load_model
from fp4sense.inputs.texts import model_context, protocol_windows
from fp4sense.numerics.training import get_recipe
from fp4sense.options import check
from fp4sense.reports.training import plot_training_views, write_training_report
from fp4sense.runtime import distributed
from fp4sense.runtime.devices import resolve
from fp4sense.runtime.outputs import check_analysis_output, local_inputs, record_written
from fp4sense.structure.lineage import text_name
from fp4sense.structure.units import find_units, model_name
from fp4sense.training.estimate import (
    GemmError,
    UnitEstimate,
    estimate_training,
    forward_stakes,
    gradient_stakes,
    not_eligible,
    training_units,
)
from fp4sense.training.exports import EXPORTS, write_exports
from fp4sense.training.policy import solve_policy
from fp4sense.training.store import RunStore, run_key
from fp4sense.training.trials import Arm, TrialResult, paired_differences, run_trials
from fp4sense.training.views import (
    build_views,
    measured_arms,
    rank_correlations,
    trial_agreement,
)
from fp4sense.validate import InputError

__all__ = ["TRAINING_FILES", "analyze_training"]

LOW_MEMORY_INSTEAD = "run analyze-training without --low-memory (the model loaded whole)"
TRAINING_FILES = ("training-sensitivity.json", "training-policy.json", "report.md",
                  *EXPORTS, "training-block.png", "training-component.png", "training-gemm.png")


def analyze_training(
    model: str | os.PathLike | None = None,
    *,
    text: str | os.PathLike | None = None,
    recipe: str = defaults.TRAINING_RECIPE,
    views: Sequence[str] = options_training.TRAINING_VIEWS,
    modes: Sequence[str] = ("estimated",),
    analysis_windows: int = defaults.ANALYSIS_WINDOWS,
    window_tokens: int = defaults.WINDOW_TOKENS,
    raw_windows: bool = False,
    eval_windows: int = defaults.EVAL_WINDOWS,
    seeds: int = defaults.TRAINING_SEEDS,
    trial_steps: int = defaults.TRIAL_STEPS,
    trial_lr: float = defaults.TRIAL_LR,
    bf16_share: float = defaults.BF16_SHARE,
    step_time_ms: float | None = None,
    part: str = defaults.BLACKWELL_PART,
    tokens_per_step: int = defaults.TOKENS_PER_STEP,
    mxfp8: bool = True,
    out_dir: str | os.PathLike | None = None,
    cache: bool | str | os.PathLike = True,
    plots: bool = True,
    low_memory: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """``fp4sense analyze-training``: the FP4 training sensitivity of ``model`` under
    ``recipe`` (nvfp4, mxfp4) and its policy; returns training-sensitivity.json's content
    with the policy under ``"policy"``. ``modes``: estimated and/or measured (trials).
    ``low_memory``: the estimate streams one block at a time, each read from the model's
    files when it runs (the same figures; the trials train the whole model: refused)."""
    check(options_training.ANALYZE_TRAINING, locals(), "analyze_training")
    if low_memory and "measured" in modes:
        raise InputError("--low-memory streams the estimate only, and the trials (--mode "
                         "measured or both) train the whole model: run them without "
                         "--low-memory, or estimate alone (--mode estimated)")
    views = options_training.views_of(views)
    placement = resolve(device, dtype, log=log)
    cache_folder = check_analysis_output(out_dir, cache, local_inputs(
        model or default_model_path(), text), "training", TRAINING_FILES)
    distributed.init_from_env(placement.device)
    if not distributed.is_main():  # rank 0 speaks for the run
        progress, log = False, (lambda message: None)
    hf_model, tokenizer, _ = load_model(model, placement.dtype, placement.device, low_memory,
                                        instead=LOW_MEMORY_INSTEAD)
    context = model_context(hf_model.config)
    train = protocol_windows(tokenizer, "calibration", analysis_windows, text, window_tokens,
                             raw_windows, context, log)
    units_map = find_units(hf_model, train[:1, :16])
    units = training_units(units_map, hf_model)
    r = get_recipe(recipe)
    settings = [r.name, r.rht, r.stochastic_rounding, r.weight_2d, seeds, trial_steps,
                trial_lr]
    skipped = not_eligible(units, r)
    est, est8 = _estimated(hf_model, train, units_map, [u for u in units if u.name not in
                                                        skipped], r, seeds, trial_lr,
                           trial_steps, mxfp8, RunStore(cache_folder, run_key(
                               hf_model, [train], settings)), progress)
    measured = {}
    if "measured" in modes:
        held = protocol_windows(tokenizer, "evaluation", eval_windows, None, window_tokens,
                                raw_windows, context, log)
        trials = RunStore(cache_folder, run_key(hf_model, [train, held], settings))
        measured = _trials(hf_model, train, held, units, r.name, views, trials, seeds,
                           trial_steps, trial_lr, progress)
    estimates = _estimates(est["units"])
    for name, why in skipped.items():
        log(f"note: {name} stays BF16: {why}")
    fixed = [_bf16(u) for u in units if u.name in skipped]
    view_rows = build_views(estimates, views, measured)
    result = {"version": 1, "model": model_name(hf_model, model or ""), "recipe": r.name,
              "recipe_source": r.source, "knobs": {"rht": r.rht, "stochastic_rounding":
                                                   r.stochastic_rounding,
                                                   "weight_2d": r.weight_2d},
              "text": text_name(text), "windows": analysis_windows,
              "window_tokens": window_tokens, "seeds": seeds, "modes": list(modes),
              "gradient_stakes": {"steps": trial_steps, "lr": trial_lr, **est["stakes"]},
              "forward_stakes": est["forward"],
              "trials": {"steps": trial_steps, "lr": trial_lr, "eval_windows": eval_windows}
              if measured else None,
              "units": est["units"], "views": view_rows, "rank_correlation": rank_correlations(
                  view_rows), "trial_agreement": trial_agreement(view_rows),
              "not_eligible": skipped,
              "left_in_bf16": sorted(m for u in units_map.units if u not in units
                                     for m in u.modules[:1]) + units_map.outside
              + sorted(units_map.unaccounted)}
    policy = solve_policy(estimates, _estimates(est8["units"]) if est8 else None, r.name,
                          tokens_per_step, part, None if step_time_ms else bf16_share,
                          step_time_ms / 1e3 if step_time_ms else None, fixed)
    result["policy"] = policy
    if out_dir is not None and distributed.is_main():
        _write(Path(out_dir), result, policy, plots, log)
    return result


def _estimated(model, train, units_map, eligible, recipe, seeds, lr, steps, mxfp8, store,
               progress) -> tuple[dict, dict | None]:
    """The estimate under ``recipe`` (and MXFP8's, for the policy), each with its stakes:
    cached in ``store``."""
    bar = tqdm(total=seeds + 2 + 3 * mxfp8, desc="estimate (passes)", disable=not progress,
               leave=False)

    def estimated(rec, passes):
        stakes = gradient_stakes(model, train, eligible, rec, lr, steps)
        forward = forward_stakes(model, train, eligible, rec)
        bar.update(2)
        return {"stakes": stakes, "forward": forward, "units": [
            e.to_dict() for e in estimate_training(model, train, units_map, rec, passes,
                                                   bar.update, stakes, forward)]}
    est = store.get("estimate-v3", lambda: estimated(recipe, seeds))
    est8 = store.get("estimate-mxfp8-v3", lambda: estimated(get_recipe("mxfp8"), 1)
                     ) if mxfp8 else None
    bar.close()
    return est, est8


def _bf16(unit) -> UnitEstimate:
    """A unit the recipe cannot train, as the policy counts it (BF16, no damage)."""
    e = UnitEstimate(unit.name, unit.block, unit.kind, unit.modules, 2 * sum(
        i * o for i, o in zip(unit.inputs, unit.out_features, strict=True)))
    e.gemms = {g: GemmError(0.0) for g in ("fprop", "dgrad", "wgrad")}
    return e


def _estimates(rows: list[dict]):
    out = []
    for d in rows:
        e = UnitEstimate(d["name"], d["block"], d["kind"], tuple(d["modules"]),
                         d["flops_per_token"])
        e.gemms = {g: GemmError(**v) for g, v in d["gemms"].items()}
        out.append(e)
    return out


def _trials(model, train, held, units, recipe, views, store, seeds, steps, lr, progress):
    arms = {"bf16": {}, **measured_arms(units, recipe, views)}
    bar = tqdm(total=len(arms) * seeds * steps, desc="trials (steps)", disable=not progress)
    results = {}
    for name in distributed.shard(list(arms)):
        results[name] = store.get(f"trial:{name}", lambda name=name: run_trials(
            model, train, held, [Arm(name, arms[name])], steps, seeds, lr,
            progress=bar.update)[name].to_dict())
    bar.close()
    for part in distributed.gather(results):
        results.update(part)

    return paired_differences({n: TrialResult.from_dict(d) for n, d in results.items()})


def _notes(path: Path) -> list[str]:
    if path.suffix == ".yaml":
        return [ln[2:] for ln in path.read_text().splitlines()[1:] if ln.startswith("# ")]
    data = json.loads(path.read_text())
    return [n for n in data.get("notes", []) if "match by substring" not in n]


def _write(out: Path, result: dict, policy: dict, plots: bool, log) -> None:
    out.mkdir(parents=True, exist_ok=True)
    body = {k: v for k, v in result.items() if k != "policy"}
    (out / "training-sensitivity.json").write_text(json.dumps(body, indent=1))
    (out / "training-policy.json").write_text(json.dumps(policy, indent=1))
    exports = [p.name for p in write_exports(policy, out)]
    for name in exports:  # what an export could not say: one line each, the file notes all
        notes = _notes(out / name)
        if notes:
            log(f"note: {name}: {len(notes)} thing(s) the tool cannot express, e.g. "
                f"{notes[0]}")
    pngs = plot_training_views(out, result) if plots else []
    write_training_report(out, result, policy, exports, plots)
    written = ["training-sensitivity.json", "training-policy.json", "report.md", *exports,
               *pngs]
    record_written(out, [out / n for n in written])
    for name in written:
        log(f"{name:28s} {out / name}")
