"""SensitivityGuidedModifier: a QuantizationModifier whose config groups come from a plan.

At initialization it takes a saved plan (``plan: plan.json``, as ``fp4sense quantize``
writes and its recipe.yaml names), or reads (or computes) a sensitivity report and solves
the budgeted plan with :func:`fp4sense.planning.milp.solve`, and quantizes with the plan's
config groups
(``group_0 … group_N``, fused groups whole, lm_head and embeddings untouched); units
given a rotated scheme (``NVFP4_H16``, ...) are rotated when calibration starts, as
llm-compressor's QuIPModifier rotates (the checkpoint's ``transform_config``). From
then on it is llm-compressor's own QuantizationModifier: same calibration, same
checkpoint. Usable from Python and from YAML recipes once this package is imported::

    quant_stage:
      quant_modifiers:
        SensitivityGuidedModifier:
          budget_bits: 4.75
          menu: [NVFP4, FP8_DYNAMIC, BF16]
          sensitivity: sensitivity.json

or, applying a plan solved before (``fp4sense quantize`` does this)::

    quant_stage:
      quant_modifiers:
        SensitivityGuidedModifier:
          plan: plan.json
"""

from __future__ import annotations

from pathlib import Path

import torch
from compressed_tensors import TRANSFORM_CONFIG_NAME
from compressed_tensors.transform import apply_transform_config
from llmcompressor.core import Event, State
from llmcompressor.modifiers.quantization import QuantizationModifier
from pydantic import PrivateAttr

from fp4sense import defaults
from fp4sense.diagnosis import SensitivityReport, analyze
from fp4sense.inputs.models import STORED_DTYPES, quantization_dtypes
from fp4sense.inputs.moe import stored_expert_names
from fp4sense.numerics.rotation import transform_config
from fp4sense.numerics.schemes import get_scheme
from fp4sense.planning.milp import DEFAULT_MENU, Plan, PlanError, solve
from fp4sense.planning.select import effective_menu
from fp4sense.structure.units import model_fingerprint
from fp4sense_llmcompressor.storage import store_in

__all__ = ["SensitivityGuidedModifier"]


class SensitivityGuidedModifier(QuantizationModifier):
    """Mixed-precision quantization planned from FP4 sensitivities under a budget.

    :param budget_bits: average stored bits per weight over the decoder linears (e.g.
        4.75); give exactly one of budget_bits, budget_bytes, kl_target.
    :param budget_bytes: total bytes of the decoder linears' stored tensors.
    :param kl_target: the fewest bits whose predicted KL stays under this value.
    :param menu: schemes a unit may get (fp4sense's menu names; BF16 = left alone).
    :param scale_search: add each FP4 menu scheme's searched-scale twin, taken unit by
        unit where it scores lower (``fp4sense quantize``'s default; the one rule is
        :func:`fp4sense.planning.select.effective_menu`).
    :param sensitivity: path of a saved sensitivity.json (``fp4sense analyze``); when
        unset, an estimated grid is computed now from the calibration data.
    :param sensitivity_mode: which grid of the report to use (measured / estimated;
        default: measured where it covers every unit).
    :param analysis_windows: calibration samples the on-the-fly estimate uses.
    :param pins: unit name or module regex -> scheme, forced whatever the scores say.
    :param plan: path of a saved plan.json to apply as it is (no budget, no report, no
        solving); its modules must be the model's, with the shapes it recorded.
    :param plan_path: where to write the solved plan.json (optional).
    :param stored_dtype: the dtype the checkpoint stores unquantized tensors (and scales
        that follow the weight's dtype) in, whatever dtype the model calibrated in (see
        :mod:`fp4sense_llmcompressor.storage`); default: a saved plan's
        ``calibration.stored_dtype``, else the model's own (llm-compressor's behaviour).
    """

    budget_bits: float | None = None
    budget_bytes: int | None = None
    kl_target: float | None = None
    menu: list[str] = list(DEFAULT_MENU)
    scale_search: bool = True
    sensitivity: str | None = None
    sensitivity_mode: str | None = None
    analysis_windows: int = defaults.ANALYSIS_WINDOWS
    pins: dict[str, str] = {}
    plan: str | None = None
    plan_path: str | None = None
    stored_dtype: str | None = None
    # the plan decides the schemes; NVFP4 inputs and the estimate need calibration data
    requires_calibration_data: bool = True

    _plan: Plan | None = PrivateAttr(None)

    @property
    def resolved_menu(self) -> list[str]:
        """The menu the plan draws from (before a saved report's unscored twins leave)."""
        return effective_menu(self.menu, self.scale_search)[0]

    @property
    def applied_plan(self) -> Plan | None:
        """The plan applied at initialization (loaded or solved)."""
        return self._plan

    def on_initialize(self, state: State, **kwargs) -> bool:
        """Load or solve the plan, install its config groups, then initialize as usual."""
        if self.plan:
            self._plan = _saved_plan(self.plan, state.model, self)
            outside = _outside(state.model, self._plan)
            _check_calibration_dtype(self.plan, self._plan, state.model)
        else:
            report = self._sensitivity(state)
            menu, _ = effective_menu(self.menu, self.scale_search, report.schemes)
            self._plan = solve(report, budget_bits=self.budget_bits,
                               budget_bytes=self.budget_bytes, kl_target=self.kl_target,
                               menu=menu, pins=self.pins, mode=self.sensitivity_mode)
            outside = report.units.outside
        if self.plan_path:
            self._plan.save(self.plan_path)
        # experts the model's files store under other names (Mixtral's w1/w2/w3):
        # targets name both, so llm-compressor and vLLM match the same groups
        self.config_groups = self._plan.config_groups(stored_expert_names(
            state.model, getattr(state.model.config, "_name_or_path", "")))
        self.scheme = None
        self.ignore = sorted(set(self.ignore) | set(outside))
        self._resolved_config = None  # resolved once at construction, before the plan
        return super().on_initialize(state, **kwargs)

    def on_calibration_start(self, state: State, event: Event, **kwargs):
        """Rotate the units the plan gives a rotated scheme (compressed-tensors'
        ``apply_transform_config``, as llm-compressor's QuIPModifier does, with the
        plan's per-unit targets), then calibrate as QuantizationModifier does."""
        config = transform_config(self._plan.targets()) if self._plan is not None else None
        if config is not None:
            if getattr(state.model, TRANSFORM_CONFIG_NAME, None) is not None:
                raise PlanError("SensitivityGuidedModifier: the plan rotates units itself "
                                "and the model has transforms already (another transform "
                                "modifier in the recipe); drop that modifier")
            apply_transform_config(state.model, config)
        return super().on_calibration_start(state, event, **kwargs)

    def on_finalize(self, state: State, **kwargs) -> bool:
        """Finish as llm-compressor does, then store in the base's dtype what the
        checkpoint keeps unquantized (a later QAD trains in float32 and puts each tensor
        back in its own dtype)."""
        done = super().on_finalize(state, **kwargs)
        stored = self.stored_dtype or (self._plan.calibration.get("stored_dtype")
                                       if self._plan is not None else None)
        if stored:
            store_in(state.model, stored)
        return done

    def _sensitivity(self, state: State) -> SensitivityReport:
        model = state.model
        if self.sensitivity:
            return SensitivityReport.load(Path(self.sensitivity),
                                          model_fingerprint=model_fingerprint(model))
        windows = _calibration_windows(state, self.analysis_windows)
        quantized = [s for s in self.resolved_menu if get_scheme(s).quantizes]
        return analyze(model, windows, schemes=quantized, views=["grid"],
                       modes=["estimated"], cache_dir=None, log=lambda msg: None)


def _saved_plan(path: str, model: torch.nn.Module, fields: SensitivityGuidedModifier
                ) -> Plan:
    """A saved plan, checked against the model it is applied to: every module it names
    is a linear of this model with the input width the plan recorded."""
    given = [k for k in ("budget_bits", "budget_bytes", "kl_target", "sensitivity")
             if getattr(fields, k) is not None]
    if given:
        raise PlanError(f"SensitivityGuidedModifier: `plan` applies a plan solved before; "
                        f"drop {', '.join(given)} (they would solve another one)")
    if not Path(path).is_file():
        where = "" if Path(path).is_absolute() else f" from the current folder ({Path.cwd()})"
        raise PlanError(f"SensitivityGuidedModifier: plan {path!r} not found{where}; a "
                        "recipe's paths are read from where oneshot runs, not from the "
                        "recipe's folder: run it from the folder holding recipe.yaml and "
                        "plan.json, or give the plan's full path in the recipe")
    plan = Plan.load(path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for choice in plan.choices:
        for module in choice.modules:
            if module not in linears:
                raise PlanError(f"{path} was made for another model ({plan.model!r}): it "
                                f"names {module}, which this model does not have as a "
                                "linear; plan this model")
        held = sum(linears[m].weight.numel() for m in choice.modules)
        if held != choice.numel:
            raise PlanError(f"{path} was made for another model ({plan.model!r}): unit "
                            f"{choice.unit} holds {choice.numel:,} weights there and "
                            f"{held:,} here; plan this model")
    return plan


def _check_calibration_dtype(path: str, plan: Plan, model: torch.nn.Module) -> None:
    """A plan calibrated in one dtype applied to a model loaded in another reproduces
    its checkpoint only approximately: say so, and how to load the model."""
    from loguru import logger

    wanted = plan.calibration.get("dtype")
    have = quantization_dtypes(model)[0]
    if wanted in STORED_DTYPES and STORED_DTYPES[wanted] != have:
        logger.warning(f"{path} was calibrated in {wanted} and this model is loaded in "
                       f"{str(have).removeprefix('torch.')}: the checkpoint will differ "
                       f"slightly from the original; load the model with "
                       f"dtype=torch.{wanted} (or oneshot(..., precision=\"{wanted}\")) "
                       "to reproduce it")


def _outside(model: torch.nn.Module, plan: Plan) -> list[str]:
    """Linears the plan does not cover (lm_head and the like): left alone."""
    planned = {m for c in plan.choices for m in c.modules}
    return sorted(n for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n not in planned)


def _calibration_windows(state: State, n: int,
                         needs: str = "SensitivityGuidedModifier without `sensitivity` "
                                      "estimates it from the calibration data") -> torch.Tensor:
    """The first ``n`` calibration samples as an (n, T) tensor (cut to the shortest);
    without any, an error that says who ``needs`` them."""
    loader = getattr(getattr(state, "data", None), "calib", None)
    if loader is None:
        raise ValueError(f"{needs}: pass a dataset to oneshot")
    rows: list[torch.Tensor] = []
    for batch in loader:
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        for row in torch.as_tensor(ids).reshape(-1, torch.as_tensor(ids).shape[-1]):
            rows.append(row)
            if len(rows) == n:
                break
        if len(rows) == n:
            break
    length = min(len(r) for r in rows)
    return torch.stack([r[:length] for r in rows]).to(torch.long)
