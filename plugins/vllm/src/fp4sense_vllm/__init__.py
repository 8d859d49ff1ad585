"""fp4sense adapter for vLLM (``vllm.general_plugins`` entry point ``fp4sense``).

vLLM calls :func:`register` in every process it starts. On vLLM's CPU platform it makes
compressed-tensors NVFP4, NVFP4A16, MXFP4 and MXFP4A16 checkpoints load and run with
software emulation (see :mod:`fp4sense_vllm.kernels`); on CUDA / ROCm / XPU it changes
nothing and logs one line, so native kernels are used.

Facts vLLM's own source decides, which users should know:

* vLLM builds every compressed-tensors MXFP4 layer as W4A4 (dynamic MXFP4 activations),
  also when the checkpoint says MXFP4A16 (weight-only).
* NVFP4 fused layers (q/k/v, gate/up) use the largest weight global scale of the parts;
  checkpoints from llm-compressor share one, so nothing is lost.
"""

from __future__ import annotations

import logging

__all__ = ["register", "registered"]

logger = logging.getLogger("fp4sense.vllm")
_REGISTERED = False


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _register_cpu_kernels() -> None:
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as nvfp4_scheme,
    )
    from vllm.platforms.interface import PlatformEnum

    from fp4sense_vllm.kernels import (
        CpuMxFp4EmulationKernel,
        CpuNvFp4EmulationKernel,
        CpuNvFp4W4A16Kernel,
    )

    # vLLM's registries have no CPU entry for FP4: add vLLM's own NVFP4 emulation (made
    # to dequantize weights once) and our MXFP4 one (vLLM's needs amd-quark) through
    # vLLM's registration function.
    register_linear_kernel(CpuNvFp4EmulationKernel, PlatformEnum.CPU, "nvfp4")
    register_linear_kernel(CpuMxFp4EmulationKernel, PlatformEnum.CPU, "mxfp4")

    # The one monkeypatch: for weight-only NVFP4, init_nvfp4_linear_kernel forces Marlin
    # (GPU-only) before it looks at the registry, and accepts only a fixed tuple of W4A16
    # kernels. So the NVFP4 scheme's reference to it is wrapped: on CPU, W4A16 gets our
    # dequantize-once kernel; everything else goes to vLLM's function unchanged.
    original = nvfp4_scheme.init_nvfp4_linear_kernel
    if getattr(original, "_fp4sense_wrapped", False):
        return

    def init_nvfp4_linear_kernel(use_a16: bool = False):
        if use_a16:
            from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

            logger.info("fp4sense: NVFP4A16 on CPU uses CpuNvFp4W4A16Kernel (emulation)")
            return CpuNvFp4W4A16Kernel(NvFp4LinearLayerConfig())
        return original(use_a16=use_a16)

    init_nvfp4_linear_kernel._fp4sense_wrapped = True  # type: ignore[attr-defined]
    nvfp4_scheme.init_nvfp4_linear_kernel = init_nvfp4_linear_kernel
    _register_cpu_moe()


def _register_cpu_moe() -> None:
    """NVFP4 fused MoE: vLLM's EMULATION backend names a Triton class; on the CPU the
    backend's kernel list gets ours (same computation, torch) instead."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as oracle

    from fp4sense_vllm.moe import CpuNvFp4A16EmulationExperts, CpuNvFp4EmulationExperts

    original = oracle.backend_to_kernel_cls
    if getattr(original, "_fp4sense_wrapped", False):
        return

    def backend_to_kernel_cls(backend, *args, **kwargs):
        if backend == oracle.NvFp4MoeBackend.EMULATION:
            return [CpuNvFp4EmulationExperts, CpuNvFp4A16EmulationExperts]
        return original(backend, *args, **kwargs)

    backend_to_kernel_cls._fp4sense_wrapped = True  # type: ignore[attr-defined]
    oracle.backend_to_kernel_cls = backend_to_kernel_cls


def register() -> None:
    """vLLM general-plugin hook (idempotent: vLLM calls it in every process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    if not _is_cpu_platform():
        logger.info("fp4sense vLLM plugin: not a CPU platform, native FP4 kernels are used")
        return
    _register_cpu_kernels()
    logger.info("fp4sense vLLM plugin: FP4 emulation kernels registered for the CPU platform")


def registered() -> bool:
    """True once vLLM (or a caller) has run :func:`register` in this process."""
    return _REGISTERED
