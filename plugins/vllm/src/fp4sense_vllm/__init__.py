"""fp4sense adapter for vLLM (``vllm.general_plugins`` entry point ``fp4sense``).

vLLM calls :func:`register` in every process it starts. The CPU emulation kernels for
FP4 checkpoints are not part of this release yet; today the hook only records that it
ran (so tests can see vLLM found the plugin) and stays out of the way everywhere.
"""

from __future__ import annotations

import logging

__all__ = ["register", "registered"]

logger = logging.getLogger("fp4sense.vllm")
_REGISTERED = False


def register() -> None:
    """vLLM general-plugin hook (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    logger.debug("fp4sense vLLM plugin loaded (no kernels registered in this release)")


def registered() -> bool:
    """True once vLLM (or a caller) has run :func:`register` in this process."""
    return _REGISTERED
