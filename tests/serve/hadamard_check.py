"""Run by the serve environment's python: the fp4sense vLLM plugin's CPU kernel for
vLLM's ``_C::hadacore_transform`` against vLLM's own expectation of that op and against
the calibration's rotation (compressed-tensors' transform, fp4sense.numerics.rotation).

Prints one JSON line: {"cases": n, "mismatches": [...]}.
"""

from __future__ import annotations

import json
import math

import torch
from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

import fp4sense_vllm
from fp4sense.numerics.rotation import rotate_input


def main() -> None:
    fp4sense_vllm._register_cpu_hadacore()
    from vllm import _custom_ops as ops

    cases, bad = 0, []
    g = torch.Generator().manual_seed(0)
    for width in (16, 32, 128):
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 7):
                x = (torch.randn(rows, 4 * width, generator=g) * 3).to(dtype)
                blocks = x.unflatten(-1, (-1, width))  # as vLLM's HadamardTransform calls it
                got = ops.hadacore_transform(blocks, inplace=False).flatten(-2, -1)
                # vLLM's test of the CUDA kernel: x @ (H / sqrt(n)).T in float64, cast back
                h = deterministic_hadamard_matrix(width, torch.float64) / math.sqrt(width)
                expected = (blocks.to(torch.float64) @ h.T).to(dtype).flatten(-2, -1)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                close = torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)
                exact = torch.equal(got, rotate_input(x, width))
                inplace = blocks.clone()
                ops.hadacore_transform(inplace, inplace=True)
                cases += 1
                if not (close and exact and torch.equal(inplace.flatten(-2, -1), got)):
                    bad.append(f"{width}/{dtype}/{rows}")
    print(json.dumps({"cases": cases, "mismatches": bad}))


if __name__ == "__main__":
    main()
