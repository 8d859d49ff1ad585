"""The quantize stage: estimate, plan once, and apply the plan with the host quantizer
the core finds through an entry point (``hosts``; llm-compressor's oneshot through
``plugins/llmcompressor``), then evaluate and publish (``pipeline.quantize_model``).
QAD: ``distill`` (training), ``distill_settings`` (its settings, the one definition
every front door uses), ``qad_loop``, ``straight_through``, ``blockwise``; ``rounded``:
GPTQ's weights for the scores after GPTQ (``--gptq-scores``)."""
