"""The command runs, beneath the front doors (``api``, ``cli``) and above the stages they
call: ``analyze`` (load, analyze, write the report), ``quantize`` (``quantize_model``, the
flat front door: its keywords parsed into checked argument groups, ``quantize_request``,
and the staged run, ``quantize_run``: estimate, plan once, the host quantizer, evaluate,
model card, publish), ``evaluate`` (``fp4sense eval``), and the FP4 training commands:
``analyze_training`` (estimate, trials, policy, exports; cached and resumable) and
``train_trial`` (a policy's four arms trained from one start). No stage imports a job."""
