"""The quantize stage: ``pipeline.quantize_model`` (the flat front door) parses its
keywords into checked argument groups (``request``) and ``run`` runs the stages: estimate,
plan once, apply the plan with the host quantizer the core finds through an entry point
(``hosts``; llm-compressor's oneshot through ``plugins/llmcompressor``), evaluate, and
publish. QAD: ``distill`` (training), ``distill_settings`` (its settings, the one
definition every front door uses), ``qad_loop``, ``straight_through``, ``blockwise``;
``rounded``: GPTQ's weights for the scores after GPTQ (``--gptq-scores``)."""
