"""The evaluation stage: the vLLM comparison in the serve environment (``vllm_check``,
``fp4sense verify-vllm``). The damage metrics per protocol are
:mod:`fp4sense.numerics.metrics`; ``fp4sense eval`` is :mod:`fp4sense.jobs.evaluate`."""
