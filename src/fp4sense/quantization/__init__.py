"""The quantize stage's algorithms (the command's run is :mod:`fp4sense.jobs`; the host
quantizer is found through an entry point, :mod:`fp4sense.runtime.hosts`). QAD:
``distill`` (training), ``distill_settings`` (its settings, the one definition every
front door uses), ``qad_loop``, ``straight_through``, ``blockwise``; ``rounded``: GPTQ's
weights for the scores after GPTQ (``--gptq-scores``)."""
