"""The diagnosis stage: measured and estimated FP4 sensitivity of a model's units.

``views.analyze`` runs an analysis in stages (``stages.ViewsRun``: measure, estimate,
stats, report) and returns a :class:`results.SensitivityReport` (saved as
sensitivity.json); ``engine.Analysis`` does the work (block-output replay,
the Fisher estimate, streamed block by block in ``estimate``; ``blockio``: a decoder
block's call, kept and replayed), ``cache`` keeps finished entries (resumable),
``footprint`` says what the caches will hold, ``results`` holds the report and its
entries, ``stats`` the statistics over windows, ``clips`` the ``*_ACLIP`` schemes'
input tensor scales, chosen after the base pass. The units, experts and offloaded blocks
are :mod:`fp4sense.structure`'s; the analyze command is :mod:`fp4sense.jobs.analyze`. A
new view is one :func:`views.register_view` (its targets and how a measured run replays
it).
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
