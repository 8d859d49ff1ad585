"""Scores after GPTQ (``fp4sense quantize --gptq --gptq-scores``).

A plan scores each (unit, scheme) by the damage of the unit's round-to-nearest weights;
then GPTQ rounds the planned model, and it repairs some units far better than others
(``bench/gptq_scores.py``). Scored after GPTQ, each quantizing scheme of the menu first
rounds the whole model with GPTQ once (the host's oneshot, SensitivityGuidedModifier +
GPTQModifier as ``--gptq`` runs it, under a uniform plan: every unit that scheme; the
rounder of :mod:`fp4sense.runtime.hosts`), and its quantized weights are saved to
a safetensors file. The estimate then reads each unit's quantized weights from that file
instead of rounding them to nearest (:class:`RoundedWeights`, ``analyze(rounded=...)``).

A unit's GPTQ depends on the units before it (their outputs are its inputs), so its
weights in a uniform run approximate its weights in the plan's GPTQ, as its RTN score
approximates its damage in the plan.

The files wait beside the output folder until the checkpoint is published, named by the
model, the calibration windows and the scheme: an interrupted run resumes after the last
scheme it finished.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from fp4sense.diagnosis.cache import cache_key
from fp4sense.diagnosis.results import SensitivityReport
from fp4sense.planning.milp import solve
from fp4sense.runtime.hosts import ROUNDERS, host
from fp4sense.structure.lineage import public_name
from fp4sense.structure.units import find_units, model_fingerprint
from fp4sense.validate import set_aside

__all__ = ["RoundedWeights", "RoundedWeightsError", "round_beside", "round_menu",
           "rounding_dir", "uniform_plan"]

#: what the report's ``text["quantized_weights"]`` says when the scores are after GPTQ
SOURCE = "GPTQ (llm-compressor oneshot, every unit one scheme, the calibration windows)"


class RoundedWeightsError(RuntimeError):
    """A rounded-weights file lacks a weight the estimate needs."""


class RoundedWeights:
    """(linear, scheme) -> a host's quantized weight (dequantized), read on demand from one
    safetensors file per scheme."""

    source = SOURCE

    def __init__(self, files: Mapping[str, str | os.PathLike]):
        self.files = {s: Path(f) for s, f in files.items()}
        self._handles: dict[str, object] = {}

    @property
    def identity(self) -> str:
        """Names the files (which name the model, the windows and the scheme): the
        analysis cache keeps these scores apart from round-to-nearest ones."""
        h = hashlib.sha256("|".join(f"{s}={f.name}" for s, f in sorted(self.files.items()))
                           .encode())
        return h.hexdigest()[:16]

    def unit(self, unit, scheme: str, only: int | None, device) -> list | None:
        """The unit's weights as stored, on ``device`` (``only``: that one, None the
        others); None when ``scheme`` is not given (it is rounded to nearest then)."""
        if scheme not in self.files:
            return None
        return [self.weight(m, scheme).to(device) if only is None or i == only else None
                for i, m in enumerate(unit.modules)]

    def weight(self, module: str, scheme: str) -> torch.Tensor:
        if scheme not in self._handles:
            self._handles[scheme] = safe_open(str(self.files[scheme]), "pt", device="cpu")
        handle = self._handles[scheme]
        if module not in handle.keys():
            raise RoundedWeightsError(
                f"{self.files[scheme].name} holds no {scheme} weight for {module}: the "
                f"uniform {scheme} GPTQ run did not quantize it; delete the file and run "
                "again, or quantize without --gptq-scores")
        return handle.get_tensor(module)


def uniform_plan(units, scheme: str, model: str, fingerprint: str,
                 calibration: dict | None = None):
    """Every unit ``scheme`` (units it cannot quantize stay BF16), calibrated as
    ``calibration`` says (:attr:`fp4sense.planning.milp.Plan.calibration`)."""

    stub = SensitivityReport(model=model, model_fingerprint=fingerprint, text={},
                             schemes=[scheme], units=units, entries=[],
                             base_ppl=float("nan"))
    plan = solve(stub, budget_bits=16.0, menu=[scheme],
                 damage={scheme: {u.name: 0.0 for u in units.units}},
                 damage_source="uniform")
    plan.calibration = dict(calibration or {})
    return plan


def round_menu(source: str, calib: torch.Tensor, units, schemes: Sequence[str],
               folder: Path, *, model: str, fingerprint: str,
               calibration: dict | None = None,
               log: Callable[[str], None] = print) -> dict[str, Path]:
    """One GPTQ rounding of the whole model per scheme of ``schemes`` (the registered
    rounder, on ``calib``, calibrating as ``calibration`` says); scheme -> its safetensors
    file in ``folder``. A file a finished earlier run left there (same model, windows,
    calibration dtype and scheme) is used again."""

    folder.mkdir(parents=True, exist_ok=True)
    key = cache_key(fingerprint, calib,
                    compute_dtype=(calibration or {}).get("dtype", "bfloat16"))
    rounder = None
    files = {}
    for i, scheme in enumerate(schemes, 1):
        files[scheme] = path = folder / f"gptq-{scheme}-{key}.safetensors"
        if path.is_file() and _readable(path, log):
            log(f"scores after GPTQ: {scheme} rounded by an earlier run ({i}/{len(schemes)})")
            continue
        if rounder is None:
            rounder = host(ROUNDERS, what="--gptq-scores")
        plan_file = uniform_plan(units, scheme, model, fingerprint, calibration).save(
            folder / f"plan-uniform-{scheme}.json")
        log(f"scores after GPTQ: rounding every unit {scheme} with GPTQ "
            f"({i}/{len(schemes)})")
        partial = path.with_name(path.name + ".partial")
        count = rounder(source, calib, partial, plan=str(plan_file))
        if count == 0:
            raise RoundedWeightsError(f"the uniform {scheme} GPTQ run quantized no linear")
        os.replace(partial, path)  # whole or absent: a later run may trust it
    return files


def _readable(path: Path, log) -> bool:
    """Whether an earlier run's rounded weights read as a whole safetensors file; one that
    does not (a truncated copy, another file under its name) is named and set aside."""

    try:
        with safe_open(str(path), "pt", device="cpu") as handle:
            for name in handle.keys():
                handle.get_slice(name)
        return True
    except Exception as exc:  # noqa: BLE001 - safetensors' errors are not OSErrors
        set_aside(path, exc, "the rounded weights", "rounding again", log)
        return False


def rounding_dir(out: Path) -> Path:
    """Where ``quantize --gptq-scores`` keeps the rounded weights until ``out`` is
    published (beside it, not in it)."""
    return out.parent / f".{out.name}.gptq-scores"


def round_beside(model, source: str, calib: torch.Tensor, schemes: Sequence[str], out: Path,
                 calibration: dict | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Path]:
    """:func:`round_menu` for ``quantize``: the units and fingerprint of ``model`` (the
    estimate's), the files in :func:`rounding_dir`."""

    return round_menu(source, calib, find_units(model, calib[:1, :16]), schemes,
                      rounding_dir(out), model=public_name(source),
                      fingerprint=model_fingerprint(model), calibration=calibration,
                      log=log)
