"""fp4sense: FP4 (NVFP4 / MXFP4) sensitivity diagnosis and mixed-precision planning.

The core imports neither llm-compressor nor vLLM; the adapters live in ``plugins/``.
"""

__version__ = "0.4.0"

__all__ = ["__version__"]
