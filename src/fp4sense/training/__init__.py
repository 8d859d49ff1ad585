"""FP4 training: which layers, and which of their GEMMs (fprop, dgrad, wgrad), can train
in NVFP4 / MXFP4. The estimate from a few forward/backward passes (``estimate``; one
block at a time for a low-memory model, ``stream``), short
training trials that measure it and the arms that validate a policy (``trials``), the
block, component and GEMM views with their rank correlation (``views``), the policy under
a BF16-share or step-time budget (``policy``), its exports for Transformer Engine,
Megatron-LM, torchao and torchtitan (``exports``), the stability monitor in a
transformers Trainer (``callback``), and the cache of a run's pieces (``store``).

Above the numerics it uses (:mod:`fp4sense.numerics.training`,
:mod:`fp4sense.numerics.training_linear`) and the model's structure; beneath the reports
and the jobs that run it.
"""
