"""The planning stage: a sensitivity report and a budget -> one scheme per unit
(:class:`Plan`, saved as plan.json: ``plan``), solved exactly as a multiple-choice
knapsack (``milp``); ``select``: the menu and plan checks, and plans chosen by measurement."""

from fp4sense.planning.milp import DEFAULT_MENU, PLAN_VERSION, Plan, PlanError, plan_cost, solve

__all__ = ["DEFAULT_MENU", "PLAN_VERSION", "Plan", "PlanError", "plan_cost", "solve"]
