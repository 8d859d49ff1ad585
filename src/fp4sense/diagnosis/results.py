"""The sensitivity report: what an analysis found, as data with a JSON form
(sensitivity.json). The planner, the report renderer and the recipe modifier read it."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fp4sense import __version__
from fp4sense.structure.units import UnitMap
from fp4sense.validate import UserError

__all__ = ["KL_ROUNDING", "REPORT_VERSION", "Entry", "ReportError", "SensitivityReport"]

#: Version of the sensitivity.json layout (bump when a field changes meaning).
REPORT_VERSION = 1
#: Bump when a change of the computation makes cached entries stale.

#: measured KL of an almost harmless change can come out a hair below zero in float32
KL_ROUNDING = 1e-6


class ReportError(UserError, ValueError):
    """A sensitivity report that cannot be used here (other model, version, schemes)."""


@dataclass(frozen=True)
class Entry:
    """Damage of one perturbation: ``view`` / ``target`` quantized with ``scheme``."""

    view: str
    scheme: str
    target: str
    mode: str
    kl: float
    kl_se: float
    dppl: float | None = None
    dppl_se: float | None = None
    top1: float | None = None
    top1_se: float | None = None
    block_forwards: int = 0

    @property
    def key(self) -> str:
        return f"{self.mode}|{self.view}|{self.scheme}|{self.target}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SensitivityReport:
    """Everything an analysis found; the planner and the recipe modifier read it."""

    model: str
    model_fingerprint: str
    text: dict
    schemes: list[str]
    units: UnitMap
    entries: list[Entry]
    base_ppl: float
    activation_stats: dict[str, dict] = field(default_factory=dict)
    routing: dict[str, list[int]] = field(default_factory=dict)  # MoE unit -> tokens/expert
    skipped: list[dict] = field(default_factory=list)
    cost: dict = field(default_factory=dict)
    correlations: list[dict] = field(default_factory=list)
    version: int = REPORT_VERSION
    fp4sense_version: str = __version__

    # --- queries ----------------------------------------------------------------------
    def table(self, view: str, scheme: str, mode: str = "measured") -> dict[str, Entry]:
        """target -> entry for one view, scheme and mode."""
        return {e.target: e for e in self.entries
                if e.view == view and e.scheme == scheme and e.mode == mode}

    def unit_scores(self, scheme: str, mode: str = "measured") -> dict[str, float]:
        """unit name -> KL (measured) or estimate, from the grid view."""
        return {t: e.kl for t, e in self.table("grid", scheme, mode).items()}

    def views(self) -> list[tuple[str, str, str]]:
        return sorted({(e.view, e.scheme, e.mode) for e in self.entries})

    # --- files ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("units", "entries")}
        d["units"] = self.units.to_dict()
        d["entries"] = [e.to_dict() for e in self.entries]
        return {"version": self.version, **{k: v for k, v in d.items() if k != "version"}}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=True))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model_fingerprint: str | None = None
             ) -> SensitivityReport:
        """Read a report; refuse another layout version or (when given) another model."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportError(f"{path}: not a readable sensitivity report ({exc})") from None
        version = d.get("version") if isinstance(d, dict) else None
        if version != REPORT_VERSION:
            raise ReportError(f"{path}: report layout version {version!r}, this fp4sense "
                              f"reads version {REPORT_VERSION}; run `fp4sense analyze` again")
        missing = [k for k in ("model", "model_fingerprint", "schemes", "units", "entries")
                   if k not in d]
        if missing:
            raise ReportError(f"{path}: not a complete sensitivity report (no "
                              f"{', '.join(missing)}); run `fp4sense analyze` again")
        if model_fingerprint is not None and d["model_fingerprint"] != model_fingerprint:
            raise ReportError(
                f"{path} was made for model {d['model']!r} (fingerprint "
                f"{d['model_fingerprint']}), not this one ({model_fingerprint}); analyze "
                "this model or pass its own report")
        try:
            entries = [Entry(**e) for e in d.pop("entries")]
            units = UnitMap.from_dict(d.pop("units"))
            d.pop("version")
            report = cls(units=units, entries=entries, version=version, **d)
        except (KeyError, TypeError, ValueError) as exc:
            kind = type(exc).__name__
            raise ReportError(f"{path}: not a sensitivity report fp4sense can read ({kind}: "
                              f"{exc}); run `fp4sense analyze` again") from None
        for e in report.entries:
            if not isinstance(e.kl, (int, float)) or isinstance(e.kl, bool) or \
                    not math.isfinite(e.kl) or e.kl < -KL_ROUNDING:
                raise ReportError(f"{path}: entry {e.view} / {e.target} / {e.scheme} has KL "
                                  f"{e.kl!r}; KL is a finite number >= 0: the file is damaged "
                                  "or edited, run `fp4sense analyze` again")
        return report
