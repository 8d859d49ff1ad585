"""fp4sense: FP4 (NVFP4 / MXFP4) sensitivity diagnosis and mixed-precision planning.

The core imports neither llm-compressor nor vLLM; the adapters live in ``plugins/``.
The packages follow the pipeline: ``inputs`` -> ``diagnosis`` -> ``planning`` ->
``quantization`` -> ``checkpoint`` -> ``evaluation`` -> ``reports`` / ``publishing``,
with ``numerics`` beneath them all and ``cli`` / ``api`` as the front doors
(docs/architecture.md); ``validate`` holds the flag checks and ``UserError``, ``defaults``
the defaults the front doors share, ``options`` every option of analyze, quantize and
eval (keyword, flag, default, help, validation) defined once.
"""

__version__ = "0.6.0"

__all__ = ["__version__"]
