"""A compressed-tensors checkpoint folder: the one checker shared by eval, push and
verify-vllm, and the effective bits measured from its headers (``checks``); loading it
into transformers with the weights baked once (``loading``)."""

from fp4sense.checkpoint.checks import (
    TOKENIZER_CONFIG,
    VOCABULARIES,
    CheckpointError,
    check_checkpoint,
    checkpoint_tokenizer,
    effective_bits,
    tensor_index,
)

__all__ = ["TOKENIZER_CONFIG", "VOCABULARIES", "CheckpointError", "check_checkpoint",
           "checkpoint_tokenizer", "effective_bits", "tensor_index"]
