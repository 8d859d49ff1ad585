"""``fp4sense quantize`` as a staged run: :class:`QuantizeRun` takes a checked
:class:`~fp4sense.jobs.quantize_request.QuantizeRequest` and runs its stages in order —
:meth:`~QuantizeRun.load`, :meth:`~QuantizeRun.round_for_scores` (``--gptq-scores``),
:meth:`~QuantizeRun.meet` (torchrun ranks), :meth:`~QuantizeRun.estimate`,
:meth:`~QuantizeRun.plan`, :meth:`~QuantizeRun.apply` (the host's oneshot),
:meth:`~QuantizeRun.evaluate`, :meth:`~QuantizeRun.card` — inside
:meth:`~QuantizeRun.publishing`, which stages the folder beside the output and publishes
it in one rename. It returns a :class:`QuantizeResult`."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fp4sense.diagnosis import SensitivityReport, analyze
from fp4sense.inputs.models import QUANTIZE_INSTEAD, analysis_windows, load_model
from fp4sense.inputs.moe import stored_expert_names
from fp4sense.inputs.texts import model_context, window_prefix
from fp4sense.jobs.evaluate import evaluate_checkpoint
from fp4sense.jobs.quantize_request import QuantizeRequest
from fp4sense.numerics.metrics import implausible
from fp4sense.planning.milp import Plan, check_pins, plan_cost, solve
from fp4sense.planning.select import check_quantizes, select_on_calibration
from fp4sense.quantization.distill import record_training
from fp4sense.quantization.rounded import RoundedWeights, round_beside, rounding_dir
from fp4sense.reports.model_card import write_model_card
from fp4sense.reports.plots import plot_training
from fp4sense.runtime import distributed
from fp4sense.runtime.hosts import quantizer
from fp4sense.runtime.outputs import publish_folder, work_folder
from fp4sense.structure.lineage import hub_id_of, public_name, text_name, write_local_record
from fp4sense.structure.units import Unit, find_units, model_fingerprint

__all__ = ["QuantizeResult", "QuantizeRun", "oneshot_plan"]


@dataclass(frozen=True)
class QuantizeResult(Mapping):
    """What a quantize run made (read it as a mapping too: ``result["eval"]["kl"]``).

    ``plan``: the plan's schemes per unit, bits, predicted KL, damage source (and
    ``selection`` with ``select_plans``); ``eval``: the checkpoint's evaluation (None
    without); ``timings``: seconds per stage. Under torchrun the ranks other than 0 get
    only ``out`` and ``rank``."""

    out: str
    plan: dict | None = None
    eval: dict | None = None
    timings: dict | None = None
    rank: int | None = None

    def to_dict(self) -> dict:
        """JSON-serialisable; the shape ``fp4sense quantize --json`` prints."""
        if self.rank is not None:
            return {"out": self.out, "rank": self.rank}
        record = self._record()
        record["out"] = self.out
        return record

    def _record(self) -> dict:
        """What fp4sense-quantize.json in the checkpoint holds (no local path)."""
        record: dict = {"plan": self.plan}
        if self.eval is not None:
            record["eval"] = self.eval
        record["timings"] = self.timings
        return record

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


class QuantizeRun:
    """One quantize run's stages and what they hand on; :meth:`run` runs them all."""

    def __init__(self, request: QuantizeRequest):
        self.request = request
        self.log, self.progress = request.log, request.progress
        self.out = request.output.out
        self.timings: dict[str, float] = {}
        self.rounded: RoundedWeights | None = None
        self._t0 = time.perf_counter()

    def run(self) -> QuantizeResult:
        self.load()
        self.round_for_scores()
        self.meet()
        with self.publishing() as work:  # None on the ranks other than 0
            report = self.estimate()  # every rank: the ranks share the estimate's windows
            planned = distributed.on_main(lambda: self.plan(report, work), "planning")
            self.model = None  # the oneshot loads its own copy
            main, rank = distributed.is_main(), distributed.rank()
            distributed.disband()  # the shared work is done: rank 0 goes on alone
            if not main:
                return QuantizeResult(str(self.out), rank=rank)
            plan, selection = planned
            self.apply(plan, work)
            summary = {"schemes": plan.schemes(), "bits_theory": plan.bits,
                       "predicted_kl": plan.predicted_kl, "damage_source": plan.damage_source}
            if selection is not None:
                summary["selection"] = selection
            evaluation = self.evaluate(work)
            self.timings["total_s"] = time.perf_counter() - self._t0
            result = QuantizeResult(str(self.out), summary, evaluation,
                                    {k: round(v, 1) for k, v in self.timings.items()})
            self.card(plan, result, work)
        return result

    def _timed(self, name: str, started: float) -> None:
        self.timings[name] = time.perf_counter() - started

    # --- stages -------------------------------------------------------------------------
    def load(self) -> None:
        """The base model (in the placement's dtype), its units checked against the pins,
        its lineage, and the calibration windows."""
        r, w = self.request, self.request.windows
        self.model, self.tokenizer, self.notes = load_model(
            r.model, r.placement.dtype, r.placement.device, low_memory=r.low_memory,
            instead=QUANTIZE_INSTEAD)
        self.source = str(r.model) if r.model is not None else self.model.config._name_or_path
        stored_expert_names(self.model, self.source)  # MoE: unpairable expert names stop here
        if r.objective.pins and not r.low_memory:  # before the estimate (streamed: at the
            # plan, as one forward costs)
            check_pins(r.objective.pins, list(r.objective.menu), find_units(self.model))
        self.hub_id = hub_id_of(self.source, r.output.base_model_id)
        self.calib = analysis_windows(self.tokenizer, w.text, w.calib_windows, w.window_tokens,
                                      w.raw_windows, model_context(self.model.config),
                                      self.log)
        self.calibration = {
            "dtype": r.placement.dtype_name,
            "stored_dtype": str(self.model.fp4sense_stored_dtype).removeprefix("torch."),
            "window_prefix": window_prefix(self.tokenizer, w.raw_windows)}

    def round_for_scores(self) -> None:
        """``--gptq-scores``: rank 0 rounds the whole model with GPTQ once per quantizing
        scheme, before the ranks meet (llm-compressor's oneshot then runs as in one
        process; the others wait at the meeting)."""
        if self.request.rounding.gptq_scores and distributed.launch_rank() == 0:
            t = time.perf_counter()
            self.rounded = round_beside(self.model, self.source, self.calib,
                                        self.request.objective.quantizing, self.out,
                                        self.calibration, self.log)
            self._timed("gptq_scores_s", t)

    def meet(self) -> None:
        """Under torchrun the ranks meet here; rank 0 speaks for the run."""
        distributed.init_from_env(self.request.placement.device,
                                  distributed.QUANTIZE_TIMEOUT_S)
        if not distributed.is_main():
            self.log, self.progress = (lambda message: None), False
        if self.request.rounding.gptq_scores:  # every rank's estimate reads rank 0's files
            self.rounded = RoundedWeights(distributed.share(self.rounded))

    def estimate(self) -> SensitivityReport | None:
        """Every unit's score per quantizing scheme (None with ``--sensitivity``)."""
        r = self.request
        if r.objective.sensitivity is not None:
            return None
        t = time.perf_counter()
        report = analyze(self.model, self.calib[:r.windows.analysis_windows],
                         schemes=r.objective.quantizing, views=["grid"], modes=["estimated"],
                         cache_dir=None, text={"source": text_name(r.windows.text),
                                               "window_prefix": self.calibration["window_prefix"]},
                         progress=self.progress, log=self.log, rounded=self.rounded)
        self._timed("sensitivity_s", t)
        vocab = self.model.config.get_text_config().vocab_size
        if warning := implausible(report.base_ppl, vocab):
            self.log(warning)
        return report

    def plan(self, report: SensitivityReport | None, work: Path) -> tuple[Plan, list | None]:
        """Rank 0's part: the report (given or estimated) saved without local paths, the
        plan solved once (or selected among the best measured) and saved for the modifier,
        with how the host calibrates (:attr:`~fp4sense.planning.milp.Plan.calibration`)."""
        objective, menu = self.request.objective, list(self.request.objective.menu)
        if objective.sensitivity is not None:
            report = SensitivityReport.load(objective.sensitivity,
                                            model_fingerprint(self.model))
            report.units.units = with_bias(report.units.units, self.model)
            menu, unscored = objective.menu_for(report)
            if unscored:  # twins the saved report did not score
                self.log(f"note: {objective.sensitivity} does not score {', '.join(unscored)};"
                         " planning without them (analyze with them in --schemes to use "
                         "searched scales)")
        # shared files name the base and the text, not their paths here
        report.model = public_name(report.model, self.hub_id)
        report.text["source"] = public_name(report.text.get("source"))
        report.save(work / "sensitivity.json")
        lo, hi = plan_cost(report.units, menu)
        solver = {**objective.solver_arguments(), "menu": menu}
        selection = None
        if objective.select_plans > 1:  # the predicted optimum is the first measured
            plan, selection = select_on_calibration(
                self.model, report, self.calib, self.request.windows.analysis_windows,
                objective.select_plans, solver, self.log, self.rounded)
        else:
            plan = solve(report, **solver)
        if self.rounded is not None:
            plan.damage_source = f"after-GPTQ {plan.damage_source}"
        plan.calibration = dict(self.calibration)
        self.log(f"plan: {plan.schemes()}, {plan.bits:.3f} bits per weight (menu reaches "
                 f"{lo:.2f}–{hi:.2f}), predicted KL {plan.predicted_kl:.4f}")
        check_quantizes(plan, solver, lo, hi, sum(u.numel for u in report.units.units),
                        self.log)
        plan.save(work / "plan.json")  # solved once: the modifier applies this file
        return plan, selection

    def apply(self, plan: Plan, work: Path) -> None:
        """The host's oneshot applies plan.json (GPTQ, QAD where asked) and writes the
        checkpoint, its tokenizer and recipe.yaml."""
        r = self.request
        t = time.perf_counter()
        recipe = oneshot_plan(self.source, self.calib, work, plan="plan.json",
                              gptq=r.rounding.gptq, distill=r.distill,
                              state_dir=r.output.state_dir)
        self._timed("oneshot_s", t)
        if r.distill is not None:
            plot_training(record_training(plan, work, text_name(r.windows.text)),
                          work / "distill.png")
        self.tokenizer.save_pretrained(work)
        (work / "recipe.yaml").write_text(recipe)

    def evaluate(self, work: Path) -> dict | None:
        """The written checkpoint against the base on the evaluation split (unless off)."""
        r = self.request
        if not r.output.evaluate:
            return None
        t = time.perf_counter()
        evaluation = evaluate_checkpoint(
            work, base=self.source, eval_windows=r.windows.eval_windows,
            window_tokens=r.windows.window_tokens, raw_windows=r.windows.raw_windows,
            device=str(r.placement.device), dtype=r.placement.dtype, progress=self.progress,
            log=self.log)
        evaluation["checkpoint"] = self.out.resolve().name
        evaluation["base"] = public_name(self.source, self.hub_id)
        self._timed("eval_s", t)
        return evaluation

    def card(self, plan: Plan, result: QuantizeResult, work: Path) -> None:
        """The local record, the model card and fp4sense-quantize.json; the state kept
        for resuming (QAD's, GPTQ scores' roundings) is no longer needed."""
        write_local_record(work, base=self.source, text=self.request.windows.text)
        write_model_card(work, plan, result.eval, source=self.source, hub_id=self.hub_id,
                         notes=self.notes, gptq=self.request.rounding.gptq, name=self.out.name)
        if self.request.distill is not None:
            shutil.rmtree(self.request.output.state_dir, ignore_errors=True)
        if self.rounded is not None:
            shutil.rmtree(rounding_dir(self.out), ignore_errors=True)
        (work / "fp4sense-quantize.json").write_text(json.dumps(result._record(), indent=1))

    @contextmanager
    def publishing(self) -> Iterator[Path | None]:
        """The work folder beside the output (rank 0's; None on the others), published by
        one rename when the block ends, removed if it raises: an interrupted run never
        leaves a checkpoint that looks complete."""
        work = distributed.on_main(lambda: work_folder(self.out, self.log),
                                   "creating the work folder")
        try:
            yield work
            if work is not None:
                publish_folder(work, self.out)  # replaces out_dir in one rename
        except BaseException:
            if distributed.is_main():  # (after disband, only rank 0 is still here)
                shutil.rmtree(work, ignore_errors=True)
            raise


def with_bias(units: list[Unit], model) -> list[Unit]:
    """The units of a given report, each marked as the model says whether it adds a bias:
    a report saved before units recorded it (fp4sense 0.5) does not say, and a plan must
    not rotate Qwen2's biased q/k/v (vLLM's transforms serve no bias)."""
    modules = dict(model.named_modules())
    return [replace(u, bias=u.bias or any(getattr(modules.get(m), "bias", None) is not None
                                          for m in u.modules)) for u in units]


def oneshot_plan(source: str, calib, work: Path, *, plan: str, gptq: bool, distill=None,
                 state_dir: Path | None = None) -> str:
    """Apply the plan saved as ``work / plan`` with the registered quantizer (the
    llm-compressor plugin's oneshot; with ``distill``, FP4 training first); return the
    recipe YAML that reproduces it."""
    if distill is None:
        return quantizer()(source, calib, work, plan=plan, gptq=gptq)
    return quantizer()(source, calib, work, plan=plan, gptq=gptq, distill=asdict(distill),
                       state_dir=str(state_dir))
