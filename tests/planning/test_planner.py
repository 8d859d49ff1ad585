"""The budgeted planner: exact optimum (checked by brute force), budgets, pins, refusals."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from fp4sense.diagnosis import Entry, SensitivityReport
from fp4sense.numerics.schemes import SchemeError
from fp4sense.planning.milp import Plan, PlanError, plan_cost, solve, unit_bits
from fp4sense.structure.units import find_units

MENU = ["NVFP4", "FP8_DYNAMIC", "BF16"]


@pytest.fixture(scope="module")
def units(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    return find_units(model)


def _report(units, seed=0, schemes=("NVFP4", "FP8_DYNAMIC", "MXFP4")) -> SensitivityReport:
    rng = np.random.default_rng(seed)
    entries = []
    for u in units.units:
        fp4 = float(rng.uniform(0.001, 0.1))
        damage = {"NVFP4": fp4, "MXFP4": 2 * fp4, "FP8_DYNAMIC": fp4 * rng.uniform(0.01, 0.2)}
        entries += [Entry("grid", s, u.name, "estimated", damage[s], 0.0) for s in schemes]
    return SensitivityReport(model="tiny", model_fingerprint="f" * 16, text={}, schemes=list(
        schemes), units=units, entries=entries, base_ppl=1.0)


def _brute_force(report, budget=None, kl_target=None, menu=MENU):
    units = report.units.units
    total = sum(u.numel for u in units)
    score = {s: report.unit_scores(s, "estimated") for s in menu if s != "BF16"}
    best = None
    for combo in itertools.product(menu, repeat=len(units)):
        bits = sum(unit_bits(u, s) * u.numel for u, s in zip(units, combo, strict=True)) / total
        dmg = sum(0.0 if s == "BF16" else score[s][u.name]
                  for u, s in zip(units, combo, strict=True))
        if budget is not None and bits <= budget + 1e-12:
            key = dmg
        elif kl_target is not None and dmg <= kl_target + 1e-12:
            key = bits
        else:
            continue
        if best is None or key < best[0] - 1e-12:
            best = (key, combo)
    return best


@pytest.mark.parametrize("budget", [4.51, 4.75, 5.0, 6.0, 8.0, 12.0])
def test_plan_is_the_exact_optimum(units, budget):
    report = _report(units)
    plan = solve(report, budget_bits=budget, menu=MENU)
    best_damage, _ = _brute_force(report, budget=budget)
    assert plan.predicted_kl == pytest.approx(best_damage, rel=1e-9, abs=1e-12)
    assert plan.bits <= budget + 1e-9
    assert solve(report, budget_bits=budget, menu=MENU).choices == plan.choices  # deterministic


def test_kl_target_gives_the_fewest_bits(units):
    report = _report(units, seed=3)
    uniform = solve(report, budget_bits=4.51, menu=MENU).predicted_kl
    target = uniform / 3
    plan = solve(report, kl_target=target, menu=MENU)
    best_bits, _ = _brute_force(report, kl_target=target)
    assert plan.predicted_kl <= target + 1e-12
    assert plan.bits == pytest.approx(best_bits, rel=1e-9)


def test_budget_in_bytes_counts_stored_bytes(units):
    report = _report(units)
    total = sum(u.numel for u in units.units)
    plan = solve(report, budget_bytes=int(5.0 * total / 8), menu=MENU)
    by_bits = solve(report, budget_bits=5.0, menu=MENU)
    assert plan.choices == by_bits.choices


def test_budget_below_the_menu_names_the_feasible_range(units):
    lo, hi = plan_cost(units, MENU)
    assert lo == pytest.approx(4.503, abs=0.001) and hi == 16
    with pytest.raises(PlanError, match=r"4\.503–16\.000 bits per weight"):
        solve(_report(units), budget_bits=4.0, menu=MENU)


def test_unknown_scheme_lists_the_menu(units):
    with pytest.raises(SchemeError, match="NVFP4A16"):
        solve(_report(units), budget_bits=5, menu=["NVFP4", "FP6"])


def test_report_without_a_menu_scheme_is_refused(units):
    with pytest.raises(PlanError, match="not INT8"):
        solve(_report(units), budget_bits=5, menu=["NVFP4", "INT8", "BF16"])


def test_pins_force_units_and_conflicts_are_named(units):
    report = _report(units)
    plan = solve(report, budget_bits=12, menu=MENU,
                 pins={r".*layers\.1\.mlp\.down_proj": "NVFP4", "0:self_attn.o_proj": "BF16"})
    got = {c.unit: c.scheme for c in plan.choices}
    assert got["1:mlp.down_proj"] == "NVFP4" and got["0:self_attn.o_proj"] == "BF16"
    with pytest.raises(PlanError, match="pinned to both"):
        solve(report, budget_bits=12, menu=MENU,
              pins={r".*layers\.1\.mlp\..*": "NVFP4", r".*down_proj": "BF16"})


def test_fused_groups_get_one_scheme_and_targets_match_exactly(units):
    plan = solve(_report(units), budget_bits=5.0, menu=MENU)
    groups = plan.config_groups()
    assert list(groups) == [f"group_{i}" for i in range(len(groups))]
    module_scheme = {m: c.scheme for c in plan.choices for m in c.modules}
    for name, group in groups.items():
        matched = {m for m in module_scheme for t in group.targets
                   if re.match(t[3:], m)}
        expected = {m for m, s in module_scheme.items()
                    if group.weights.num_bits == (4 if s == "NVFP4" else 8)}
        assert matched == expected, name
    # every module of a fused group under one scheme
    for c in plan.choices:
        assert len({module_scheme[m] for m in c.modules}) == 1


def test_plan_round_trip(units, tmp_path):
    plan = solve(_report(units), budget_bits=5.0, menu=MENU)
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.choices == plan.choices and again.bits == plan.bits


def test_pins_in_compressed_tensors_form_and_typos(units):
    report = _report(units)
    plan = solve(report, budget_bits=12, menu=MENU, pins={r"re:.*mlp\.down_proj$": "BF16"})
    assert all(c.scheme == "BF16" for c in plan.choices if c.unit.endswith("down_proj"))
    with pytest.raises(PlanError, match="matches no unit"):
        solve(report, budget_bits=12, menu=MENU, pins={r".*mlp\.dwn_proj": "BF16"})


@pytest.mark.parametrize("budget", [4.75, 6.0])
def test_best_plans_are_the_k_best_in_order_and_selection_keeps_the_lowest_measured(
        units, budget):
    """The additivity correction's candidates: the k best plans by predicted KL, exactly
    (brute force), all different; the kept plan is the one whose measured KL is lowest."""
    from fp4sense.planning.select import assignment, best_plans, select_measured

    report = _report(units, seed=3)
    units_ = report.units.units
    total = sum(u.numel for u in units_)
    score = {s: report.unit_scores(s, "estimated") for s in MENU if s != "BF16"}
    feasible = sorted(
        sum(0.0 if s == "BF16" else score[s][u.name] for u, s in zip(units_, c, strict=True))
        for c in itertools.product(MENU, repeat=len(units_))
        if sum(unit_bits(u, s) * u.numel for u, s in zip(units_, c, strict=True)) / total
        <= budget + 1e-12)
    plans = best_plans(report, 5, budget_bits=budget, menu=MENU)
    n = min(5, len(feasible))  # fewer when no more plans fit the budget
    assert len(plans) == n and (budget != 4.75 or n < 5)
    assert [p.predicted_kl for p in plans] == pytest.approx(feasible[:n], rel=1e-9, abs=1e-12)
    assert len({tuple(sorted(assignment(p).items())) for p in plans}) == n
    assert all(p.bits <= budget + 1e-9 for p in plans)
    values = [0.5, 0.2, 0.9, 0.1, 0.3][:n]
    measured = {tuple(sorted(assignment(p).items())): m
                for p, m in zip(plans, values, strict=True)}
    kept, trials = select_measured(report, lambda a: measured[tuple(sorted(a.items()))],
                                   k=5, budget_bits=budget, menu=MENU)
    assert assignment(kept) == assignment(plans[values.index(min(values))])
    assert [t["measured"] for t in trials] == values
    with pytest.raises(PlanError, match="at least 1"):
        best_plans(report, 0, budget_bits=budget, menu=MENU)


def test_judge_takes_input_scales_from_the_calibration_windows(tiny_llama):
    """The protocol's judge: KL on held-out windows, input scales and scale-search weights
    from calibration windows; the same as building the two analyses by hand, and
    measure_on (its KL alone, statistics from its own windows) unchanged."""
    from transformers import AutoModelForCausalLM

    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.planning.select import Judge, measure_on

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(0, model.config.vocab_size, (3, 32), generator=gen)
    held = torch.randint(0, model.config.vocab_size, (2, 32), generator=gen)
    units = find_units(model)
    assign = {u.name: "NVFP4_SEARCH" for u in units.units}
    by_name = units.by_name()
    pert = {m: (by_name[u], s) for u, s in assign.items() for m in by_name[u].modules}

    cal = Analysis(model, calib, units, EntryCache(None), progress=False)
    cal.base_pass()
    alone = Analysis(model, held, units, EntryCache(None), progress=False)
    own = alone.measure(pert)
    hand = Analysis(model, held, units, EntryCache(None), progress=False)
    hand.base_pass()
    hand.stats, hand.importance = cal.stats, cal.importance
    want = hand.measure(pert)
    judge = Judge(model, units, held, calibration=calib)
    got = judge.measure(assign)
    assert got["kl"] == want["kl"] and got["kl_se"] == want["kl_se"]
    assert got["top1"] == want["top1"]
    assert got["ppl"] == hand.base_ppl() + want["dppl"]
    assert got["kl"] != own["kl"]  # the calibration windows' scales are not the held-out's
    again = Judge(model, units, held, **judge.calibrated)
    assert again(assign) == got["kl"]
    assert measure_on(model, units, held)(assign) == own["kl"]
