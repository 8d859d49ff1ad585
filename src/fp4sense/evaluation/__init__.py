"""The evaluation stage: damage metrics per protocol (``metrics``), a checkpoint against
its base model (``evaluate``, ``fp4sense eval``) and the vLLM comparison in the serve
environment (``vllm_check``, ``fp4sense verify-vllm``)."""

from fp4sense.evaluation.evaluate import evaluate_checkpoint

__all__ = ["evaluate_checkpoint"]
