"""What ``fp4sense quantize`` was asked, parsed once at entry into frozen argument groups
that each check themselves (:class:`QuantizeRequest`): the objective (budget, menu, pins,
given scores, searched scales, plan selection), the windows, the rounding (GPTQ), QAD
(:class:`~fp4sense.quantization.distill_settings.DistillSettings`), the placement
(:class:`~fp4sense.runtime.devices.Placement`) and the output (folder, overwrite,
lineage, evaluation). :class:`fp4sense.jobs.quantize_run.QuantizeRun` runs it stage by
stage; :func:`fp4sense.jobs.quantize.quantize_model` is the flat front door."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fp4sense.inputs.assets import default_model_path
from fp4sense.numerics.schemes import get_scheme
from fp4sense.planning.milp import check_pins
from fp4sense.planning.select import check_menu, effective_menu
from fp4sense.quantization.distill import DistillError
from fp4sense.quantization.distill_settings import DistillSettings
from fp4sense.runtime.devices import Placement, resolve
from fp4sense.runtime.outputs import guard_output, local_inputs
from fp4sense.structure.lineage import hub_id_of

if TYPE_CHECKING:
    from fp4sense.diagnosis.results import SensitivityReport

__all__ = ["Objective", "Output", "QuantizeRequest", "Rounding", "Windows"]


@dataclass(frozen=True)
class Objective:
    """What the plan minimises under which constraint, over which schemes: exactly one of
    ``budget_bits`` / ``budget_bytes`` / ``kl_target``; ``menu`` already holds the
    searched-scale twins when ``scale_search``."""

    budget_bits: float | None
    budget_bytes: int | None
    kl_target: float | None
    menu: tuple[str, ...]
    pins: Mapping[str, str] | None
    sensitivity: str | os.PathLike | None
    sensitivity_mode: str | None
    scale_search: bool
    select_plans: int

    @classmethod
    def parse(cls, *, menu: Sequence[str], scale_search: bool, **rest) -> Objective:
        return cls(menu=tuple(effective_menu(menu, scale_search)[0]),
                   scale_search=scale_search, **rest)

    def check(self) -> None:
        """The pins' schemes now; the units they match once the model is loaded."""
        check_pins(self.pins, list(self.menu))

    def check_selection(self) -> None:
        if self.select_plans < 1:
            raise ValueError(f"select_plans must be at least 1, got {self.select_plans}")
        given = (self.budget_bits, self.budget_bytes, self.kl_target)
        if sum(x is not None for x in given) != 1:
            raise ValueError("give exactly one of --budget, --budget-bytes, --kl-target")

    def menu_for(self, report: SensitivityReport) -> tuple[list[str], list[str]]:
        """(the menu a plan from the given ``report`` uses, the searched-scale twins it
        leaves out because the report does not score them: with ``scale_search`` they
        were added here, not asked for)."""
        return effective_menu(self.menu, self.scale_search, report.schemes)

    @property
    def quantizing(self) -> list[str]:
        """The menu's schemes that quantize (what the estimate scores)."""
        return [s for s in self.menu if get_scheme(s).quantizes]

    def solver_arguments(self) -> dict:
        """The keywords :func:`fp4sense.planning.milp.solve` takes, less the menu."""
        return dict(budget_bits=self.budget_bits, budget_bytes=self.budget_bytes,
                    kl_target=self.kl_target, pins=self.pins, mode=self.sensitivity_mode)


@dataclass(frozen=True)
class Windows:
    """The text and how many windows of it each stage reads."""

    text: str | os.PathLike | None
    calib_windows: int
    analysis_windows: int
    window_tokens: int
    raw_windows: bool
    eval_windows: int


@dataclass(frozen=True)
class Rounding:
    """How the weights are rounded: GPTQ, and whether the estimate scores after it."""

    gptq: bool
    gptq_scores: bool

    def check(self, objective: Objective) -> None:
        if self.gptq_scores and not self.gptq:
            raise ValueError("--gptq-scores scores the units after GPTQ rounds them: add --gptq")
        if self.gptq_scores and objective.sensitivity is not None:
            raise ValueError(f"--gptq-scores estimates the scores after GPTQ itself; "
                             f"--sensitivity {objective.sensitivity} gives scores already: "
                             "drop one")


@dataclass(frozen=True)
class Output:
    """Where the checkpoint goes and what travels with it."""

    out: Path
    overwrite: bool
    base_model_id: str | None
    evaluate: bool

    def check(self, model, text) -> None:
        # the user's model and text are never the output, nor inside it, nor holding it
        guard_output(self.out, inputs=local_inputs(model or default_model_path(), text),
                     overwrite=self.overwrite)

    def check_lineage(self) -> None:
        if self.base_model_id is not None:
            hub_id_of("", self.base_model_id)  # a malformed id fails before anything runs

    @property
    def state_dir(self) -> Path:
        """Where an interrupted distillation's state waits (beside the output, not in it)."""
        return self.out.parent / f".{self.out.name}.distill-state"


@dataclass(frozen=True)
class QuantizeRequest:
    """One ``quantize`` call, parsed and checked (:meth:`parse`) before anything loads."""

    model: str | os.PathLike | None
    objective: Objective
    windows: Windows
    rounding: Rounding
    distill: DistillSettings | None
    placement: Placement
    output: Output
    low_memory: bool = False
    progress: bool = True
    log: Callable[[str], None] = field(default=print, compare=False)

    @classmethod
    def parse(cls, model, *, out_dir, budget_bits, budget_bytes, kl_target, menu, sensitivity,
              sensitivity_mode, pins, gptq, gptq_scores, scale_search, select_plans, distill,
              base_model_id, text, calib_windows, analysis_windows, window_tokens,
              raw_windows, evaluate, eval_windows, overwrite, device, dtype, low_memory,
              progress, log) -> QuantizeRequest:
        """The flat keywords of :func:`~fp4sense.jobs.quantize.quantize_model`
        into groups, each checked in the order a user meets them: the output folder, the
        menu and pins, the placement, the lineage, the objective, the rounding, QAD."""
        output = Output(Path(out_dir), overwrite, base_model_id, evaluate)
        output.check(model, text)
        objective = Objective.parse(
            budget_bits=budget_bits, budget_bytes=budget_bytes, kl_target=kl_target,
            menu=menu, pins=pins, sensitivity=sensitivity, sensitivity_mode=sensitivity_mode,
            scale_search=scale_search, select_plans=select_plans)
        check_menu(list(objective.menu))
        objective.check()
        placement = resolve(device, dtype, log=log)
        output.check_lineage()
        objective.check_selection()
        rounding = Rounding(gptq, gptq_scores)
        rounding.check(objective)
        if distill is not None:
            distill.check()
            if low_memory:
                raise DistillError("--distill trains inside llm-compressor's oneshot, which "
                                   "holds the whole model in memory (also with --distill-mode "
                                   "block); drop --low-memory")
        windows = Windows(text, calib_windows, analysis_windows, window_tokens, raw_windows,
                          eval_windows)
        return cls(model, objective, windows, rounding, distill, placement, output,
                   low_memory, progress, log)
