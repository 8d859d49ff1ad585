"""Measured and estimated FP4 sensitivity -> :class:`SensitivityReport`.

The public face of the diagnosis stage (:mod:`fp4sense.diagnosis`): ``analyze`` runs the
views, ``SensitivityReport`` is what it returns and saves as sensitivity.json. The work
lives in ``fp4sense.diagnosis`` (views, engine, cache, offload, statistics).
"""

from fp4sense.diagnosis.cache import cache_key
from fp4sense.diagnosis.report import (
    KL_ROUNDING,
    REPORT_VERSION,
    Entry,
    ReportError,
    SensitivityReport,
)
from fp4sense.diagnosis.stats import correlations
from fp4sense.diagnosis.views import (
    MODES,
    REPORT_VIEWS,
    VIEWS,
    analyze,
    check_request,
    register_view,
)

__all__ = ["KL_ROUNDING", "MODES", "REPORT_VERSION", "REPORT_VIEWS", "VIEWS", "Entry",
           "ReportError", "SensitivityReport", "analyze", "cache_key", "check_request",
           "correlations", "register_view"]
