"""fp4sense adapter for vLLM (``vllm.general_plugins`` entry point ``fp4sense``).

vLLM calls :func:`register` in every process it starts. On vLLM's CPU platform it makes
compressed-tensors NVFP4, NVFP4A16, MXFP4 and MXFP4A16 checkpoints load and run with
software emulation (see :mod:`fp4sense_vllm.kernels`), and block-Hadamard input
transforms (rotated schemes) with a CPU kernel for vLLM's ``hadacore_transform`` op; on
CUDA / ROCm / XPU it changes nothing and logs one line, so native kernels are used.

Facts vLLM's own source decides, which users should know:

* vLLM builds every compressed-tensors MXFP4 layer as W4A4 (dynamic MXFP4 activations),
  also when the checkpoint says MXFP4A16 (weight-only).
* NVFP4 fused layers (q/k/v, gate/up) use the largest weight global scale of the parts;
  checkpoints from llm-compressor share one, so nothing is lost.
"""

from __future__ import annotations

import logging

import torch

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
    _register_cpu_hadacore()


_HADACORE_LIBRARY = None


def _register_cpu_hadacore() -> None:
    """vLLM applies a checkpoint's ``hadamard`` input transforms with
    ``torch.ops._C.hadacore_transform``, a CUDA kernel its CPU build lacks: define the op
    for the CPU (a normalized Walsh-Hadamard transform over the last dimension, computed
    as compressed-tensors' transform computes it at calibration,
    :func:`fp4sense.numerics.rotation.rotate_input`), with a fake for tracing."""
    global _HADACORE_LIBRARY
    if _HADACORE_LIBRARY is not None or hasattr(torch.ops._C, "hadacore_transform"):
        return
    from fp4sense.numerics.rotation import rotate_input

    library = torch.library.Library("_C", "FRAGMENT")
    library.define("hadacore_transform(Tensor(a!) x, bool inplace) -> Tensor")

    def hadacore_transform(x: torch.Tensor, inplace: bool) -> torch.Tensor:
        y = rotate_input(x, x.shape[-1])
        return x.copy_(y) if inplace else y

    library.impl("hadacore_transform", hadacore_transform, "CPU")
    library._register_fake("hadacore_transform", lambda x, inplace: (
        x if inplace else torch.empty_like(x)))
    _HADACORE_LIBRARY = library
    logger.info("fp4sense: Hadamard input transforms on CPU use a dense float64 kernel")


def _register_cpu_moe() -> None:
    """Fused MoE on the CPU. vLLM picks experts per backend from each oracle's
    ``backend_to_kernel_cls``; the backends whose weights it leaves as stored get a CPU
    class beside vLLM's own (same computation, torch): NVFP4's EMULATION backend (vLLM's
    class is Triton) and FP8's TRITON backend (vLLM's CPU FP8 experts need AMX)."""
    from vllm.model_executor.layers.fused_moe.oracle import fp8, nvfp4

    from fp4sense_vllm.moe import (
        CpuFp8Experts,
        CpuNvFp4A16EmulationExperts,
        CpuNvFp4EmulationExperts,
    )

    _add_experts(nvfp4, nvfp4.NvFp4MoeBackend.EMULATION,
                 [CpuNvFp4EmulationExperts, CpuNvFp4A16EmulationExperts], replace=True)
    _add_experts(fp8, fp8.Fp8MoeBackend.TRITON, [CpuFp8Experts], replace=False)
    _cpu_mxfp4_moe_method()


def _cpu_mxfp4_moe_method() -> None:
    """vLLM's compressed-tensors MXFP4 MoE method chooses Marlin (GPU) on every device
    but Blackwell and XPU, without an oracle to extend; on the CPU its three methods
    that choose and prepare the experts run our W4A4 experts on the stored tensors
    (the rest of the class, and every other platform, unchanged)."""
    from vllm.model_executor.layers.fused_moe.config import mxfp4_moe_quant_config
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
        compressed_tensors_moe_w4a4_mxfp4 as method,
    )

    from fp4sense_vllm.moe import CpuMxFp4Experts

    cls = method.CompressedTensorsW4A4Mxfp4MoEMethod
    if getattr(cls, "_fp4sense_wrapped", False):
        return
    original_init = cls.__init__

    def __init__(self, moe):
        original_init(self, moe)
        self.mxfp4_backend = mxfp4.Mxfp4MoeBackend.EMULATION
        self.experts_cls = CpuMxFp4Experts
        logger.info("fp4sense: MXFP4 MoE on CPU uses CpuMxFp4Experts (emulation, W4A4)")

    def get_fused_moe_quant_config(self, layer):
        return mxfp4_moe_quant_config(w1_scale=layer.w13_weight_scale,
                                      w2_scale=layer.w2_weight_scale)

    def process_weights_after_loading(self, layer) -> None:
        for name in ("w13", "w2"):  # the stored tensors, as vLLM's method names them
            setattr(layer, f"{name}_weight", torch.nn.Parameter(
                getattr(layer, f"{name}_weight_packed").data, requires_grad=False))
            delattr(layer, f"{name}_weight_packed")
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = mxfp4.make_mxfp4_moe_kernel(
            moe_quant_config=self.moe_quant_config, moe_config=self.moe,
            experts_cls=self.experts_cls, mxfp4_backend=self.mxfp4_backend,
            routing_tables=layer._expert_routing_tables())
        self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    cls.__init__ = __init__
    cls.get_fused_moe_quant_config = get_fused_moe_quant_config
    cls.process_weights_after_loading = process_weights_after_loading
    cls._fp4sense_wrapped = True


def _add_experts(oracle, backend, classes: list, replace: bool) -> None:
    """Wrap ``oracle.backend_to_kernel_cls`` so that ``backend`` offers ``classes``
    (instead of vLLM's, or after them: each class says itself which device it runs on)."""
    original = oracle.backend_to_kernel_cls
    if getattr(original, "_fp4sense_wrapped", False):
        return

    def backend_to_kernel_cls(chosen, *args, **kwargs):
        if chosen == backend:
            return list(classes) if replace else [
                *original(chosen, *args, **kwargs), *classes]
        return original(chosen, *args, **kwargs)

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
