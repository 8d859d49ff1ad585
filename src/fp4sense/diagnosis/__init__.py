"""The diagnosis stage: measured and estimated FP4 sensitivity of a model's units.

``views.analyze`` runs an analysis and returns a :class:`report.SensitivityReport`
(saved as sensitivity.json); ``engine.Analysis`` does the work (block-output replay,
the Fisher estimate), ``cache`` keeps finished entries (resumable), ``offload`` keeps one
decoder block in memory at a time, ``stats`` holds the statistics over windows. A new
view is one :func:`views.register_view` (its targets and how a measured run replays it).
"""
