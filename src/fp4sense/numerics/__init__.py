"""Numerics beneath every stage: the E2M1 element (``e2m1``), the FP4 formats as
registered classes with their scale rules (``formats``), compress / decompress /
fake-quantize of tensors (``fp4``), the scheme menu (``schemes``), a unit under a scheme
in memory (``fakequant``), error-minimizing block scales (``scale_search``) and the
block-Hadamard rotations of the rotated schemes (``rotation``), and the damage metrics
per protocol: KL, perplexity, top-1 agreement (``metrics``).

A new scheme goes in ``schemes``; a new FP4 format is a subclass of
``formats.FP4Format`` with ``@register_format``. Everything here is plain torch and
compressed-tensors, tested bit for bit against compressed-tensors and vLLM.
"""
