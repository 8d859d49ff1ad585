"""The command runs, beneath the front doors (``api``, ``cli``) and above the stages they
call: ``analyze`` (load, analyze, write the report), ``quantize`` (``quantize_model``, the
flat front door: its keywords parsed into checked argument groups, ``quantize_request``,
and the staged run, ``quantize_run``: estimate, plan once, the host quantizer, evaluate,
model card, publish) and ``evaluate`` (``fp4sense eval``). No stage imports a job."""
