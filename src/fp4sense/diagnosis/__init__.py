"""The diagnosis stage: measured and estimated FP4 sensitivity of a model's units.

``run.analyze_model`` is the analyze command (load, analyze, write the report);
``views.analyze`` runs an analysis and returns a :class:`report.SensitivityReport`
(saved as sensitivity.json); ``engine.Analysis`` does the work (block-output replay,
the Fisher estimate; ``blockio``: a decoder block's call, kept and replayed), ``cache``
keeps finished entries (resumable), ``offload`` keeps one decoder block in memory at a
time, ``footprint`` says what the caches will hold, ``results`` holds the report and
its entries, ``stats`` the statistics over windows, ``units`` splits a model into units
and ``experts`` finds MoE experts, routers and weights nothing explains. A new
view is one :func:`views.register_view` (its targets and how a measured run replays it).
"""


from fp4sense.diagnosis.cache import cache_key
from fp4sense.diagnosis.results import (
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
