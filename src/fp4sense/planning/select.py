"""Plans checked: a menu that can quantize before any work, a plan that quantizes before
it is applied, and by measurement (the additivity correction).

A plan's predicted KL adds up unit scores measured one unit at a time; the damage of the
whole plan is not their sum (units interact), so the predicted optimum need not be the
measured one. :func:`select_measured` measures the best few plans by prediction at the
same objective (each differs from the ones before by at least one unit) and keeps the
one with the lowest measured KL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp4sense.diagnosis import SensitivityReport
from fp4sense.diagnosis.cache import EntryCache
from fp4sense.diagnosis.engine import Analysis
from fp4sense.numerics.schemes import clips_of, get_scheme, rotations_of, with_search_twins
from fp4sense.planning.milp import Plan, PlanError, solve
from fp4sense.structure.units import UnitMap

__all__ = ["best_plans", "check_menu", "check_quantizes", "effective_menu", "measure_on",
           "select_measured", "select_on_calibration"]


def effective_menu(menu, scale_search: bool, scored=None) -> tuple[list[str], list[str]]:
    """The menu a plan draws from, the one rule of every front door (``quantize``, its
    Python function and the YAML ``SensitivityGuidedModifier``): ``menu`` by its
    canonical names, with each FP4 scheme's searched-scale twin when ``scale_search``
    (their default); given the schemes a saved report ``scored``, less the searched-scale
    schemes it does not score. Returns (menu, schemes left out)."""
    names = with_search_twins(menu) if scale_search else [get_scheme(s).name for s in menu]
    unscored = [s for s in names if get_scheme(s).scale_search and s not in scored
                ] if scale_search and scored is not None else []
    return [s for s in names if s not in unscored], unscored


def check_menu(menu) -> None:
    """``--menu`` holds at least one scheme that quantizes (checked before the model
    loads)."""
    if not any(get_scheme(s).quantizes for s in menu):
        raise PlanError(f"--menu {','.join(menu)} has no scheme that quantizes, so nothing "
                        "would be quantized; add one (e.g. --menu NVFP4,FP8_DYNAMIC,BF16)")


def check_quantizes(plan: Plan, objective: dict, lo: float, hi: float, numel: int,
                    log: Callable[[str], None]) -> None:
    """A budget above what the menu can use plans at the menu's top (said in a note); a
    plan that quantizes nothing is refused, naming the flag that asked for it: it would
    not be a quantized checkpoint."""
    bits, size = objective.get("budget_bits"), objective.get("budget_bytes")
    asked = bits if bits is not None else size * 8 / numel if size is not None else None
    if asked is not None and asked > hi + 1e-9:
        log(f"note: the budget ({asked:.3f} bits per weight) is above what the menu can use "
            f"({hi:.3f}); planned at the menu's top")
    if any(get_scheme(c.scheme).quantizes for c in plan.choices):
        return
    if objective.get("kl_target") is not None:
        raise PlanError(
            f"--kl-target {objective['kl_target']:g} is met only by leaving every unit in "
            "BF16 (quantizing any unit is predicted to cost more), so nothing would be "
            "quantized; give a larger --kl-target or a --budget")
    raise PlanError(
        f"the plan leaves every unit in BF16, so nothing would be quantized; give a "
        f"budget below {hi:.3f} bits per weight (the menu reaches {lo:.3f}–{hi:.3f}) or "
        "drop BF16 from the menu")


def assignment(plan: Plan) -> dict[str, str]:
    """unit -> scheme of ``plan``."""
    return {c.unit: c.scheme for c in plan.choices}


def best_plans(report: SensitivityReport, k: int, **objective) -> list[Plan]:
    """Up to ``k`` distinct plans in order of predicted KL (``objective``: the keyword
    arguments of :func:`solve`); fewer when the menu has no more at the objective."""
    if k < 1:
        raise PlanError(f"k must be at least 1, got {k}")
    plans: list[Plan] = []
    for _ in range(k):
        try:
            plans.append(solve(report, exclude=[assignment(p) for p in plans], **objective))
        except PlanError:
            if not plans:
                raise
            break
    return plans


def select_measured(report: SensitivityReport, measure: Callable[[dict[str, str]], float],
                    k: int = 6, **objective) -> tuple[Plan, list[dict]]:
    """The plan with the lowest measured KL among the ``k`` best by prediction.

    :param measure: unit -> scheme assignment -> measured KL (on windows other than the
        ones the result is judged on).
    :return: the kept plan and one record per candidate (predicted, measured, bits; the
        kept one marked ``kept``), in order of prediction.
    """
    plans = best_plans(report, k, **objective)
    trials = [{"predicted": p.predicted_kl, "measured": float(measure(assignment(p))),
               "bits": p.bits} for p in plans]
    best = min(range(len(plans)), key=lambda i: trials[i]["measured"])
    trials[best]["kept"] = True
    return plans[best], trials


class Judge:
    """Measures unit -> scheme assignments on ``windows``: fp4sense's bit-exact fake
    quantization of every unit at once, against the base model's log-probs from one base
    pass made here. That pass also gives the input scales and the scale-search weights,
    unless ``calibration`` (other windows: the protocol's evaluation takes them from
    calibration text and measures on held-out text) or ``stats`` / ``importance`` (a
    report's activation statistics, or another judge's :attr:`calibrated`) give them.
    ``rounded``: the quantized weights of the schemes it covers are its (GPTQ's), not
    round-to-nearest; ``schemes``: those the assignments may hold (a rotated one's input
    maxima are taken then). Calling it gives the KL alone."""

    def __init__(self, model: torch.nn.Module, units: UnitMap, windows: torch.Tensor,
                 rounded=None, schemes=(), calibration: torch.Tensor | None = None,
                 stats: dict | None = None, importance: dict | None = None):

        def analysis(on: torch.Tensor, own_stats: bool) -> Analysis:
            a = Analysis(model, on, units, EntryCache(None), progress=False, rounded=rounded)
            # the statistics it keeps: the *_ACLIP choices too
            a.rotations, a.clips = rotations_of(schemes), clips_of(schemes) if own_stats else ()
            return a

        if calibration is not None:
            calibrated = analysis(calibration, stats is None)
            calibrated.base_pass()
            calibrated.release_replay()  # its statistics are what is kept
        self.analysis = analysis(windows, calibration is None and stats is None)
        self.analysis.base_pass()
        if calibration is not None:
            self.analysis.stats = calibrated.stats
            self.analysis.importance = calibrated.importance
        if stats is not None:
            self.analysis.stats = stats
        if importance is not None:
            self.analysis.importance = importance
        self.by_name = units.by_name()

    def measure(self, assign: dict[str, str]) -> dict:
        """KL (± its standard error), perplexity and top-1 agreement of ``assign``."""
        r = self.analysis.measure({m: (self.by_name[u], s) for u, s in assign.items()
                                   if get_scheme(s).quantizes
                                   for m in self.by_name[u].modules})
        return {"kl": r["kl"], "kl_se": r["kl_se"], "ppl": self.base_ppl() + r["dppl"],
                "top1": r["top1"]}

    def __call__(self, assign: dict[str, str]) -> float:
        return self.measure(assign)["kl"]

    @property
    def calibrated(self) -> dict:
        """The input statistics and scale-search weights it quantizes with, as keywords
        for another judge."""
        return {"stats": self.analysis.stats, "importance": self.analysis.importance}

    def base_ppl(self) -> float:
        """The unquantized model's perplexity on the windows."""
        return self.analysis.base_ppl()


def measure_on(model: torch.nn.Module, units: UnitMap, windows: torch.Tensor, rounded=None,
               schemes=()) -> Callable[[dict[str, str]], float]:
    """unit -> scheme assignment -> the KL it measures on ``windows`` (a :class:`Judge`
    whose input scales and scale-search weights come from these windows)."""
    return Judge(model, units, windows, rounded=rounded, schemes=schemes)


def select_on_calibration(model, report: SensitivityReport, calib: torch.Tensor,
                          analysis_windows: int, k: int, objective: dict,
                          log: Callable[[str], None], rounded=None) -> tuple[Plan, list[dict]]:
    """``quantize --select-plans K``: the best measured of the ``k`` best plans by
    prediction, measured on 4 calibration windows after the estimate's (its own when
    there are no others); ``rounded``: with those quantized weights (scores after GPTQ)."""
    windows = calib[analysis_windows:analysis_windows + 4]
    if len(windows) == 0:
        windows = calib[:4]
        log("note: no calibration windows beyond the estimate's; plans are measured on "
            "the estimate's own (raise --calib-windows)")
    plan, trials = select_measured(report, measure_on(model, report.units, windows,
                                                      rounded=rounded,
                                                      schemes=objective.get("menu", ())),
                                   k=k, **objective)
    rank = next(i for i, t in enumerate(trials) if t.get("kept"))
    log(f"selection: {len(trials)} plans measured on {len(windows)} calibration windows; "
        f"kept the one ranked {rank + 1} by prediction (measured KL "
        f"{trials[rank]['measured']:.4f}, the predicted best {trials[0]['measured']:.4f})")
    return plan, trials
