"""Numerics beneath every stage: the E2M1 element (``e2m1``), the FP4 formats as
registered classes with their scale rules (``formats``), compress / decompress /
fake-quantize of tensors (``fp4``), the scheme menu (``schemes``), a unit under a scheme
in memory (``fakequant``), error-minimizing block scales (``scale_search``) and the
block-Hadamard rotations of the rotated schemes (``rotation``), the W4A4 input's
tensor scale chosen by output error (``input_clip``), the damage metrics
per protocol: KL, perplexity, top-1 agreement (``metrics``), and FP4 *training*: the
recipes that quantize each GEMM operand of a training step (``training``) and the
emulated linear whose fprop, dgrad and wgrad use them, put on a model by a per-layer,
per-GEMM policy (``training_linear``).

A new scheme goes in ``schemes``; a new FP4 format is a subclass of
``formats.FP4Format`` with ``@register_format``. Everything here is plain torch and
compressed-tensors, tested bit for bit against compressed-tensors and vLLM.
"""
