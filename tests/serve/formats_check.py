"""Run by the serve environment's python: fp4sense.numerics.formats vs compressed-tensors 0.17.

Prints one JSON line: {"compressed_tensors": version, "cases": n, "mismatches": [...]}.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ct_reference
from ct_reference import as_bytes, reference, same_bits, special_weights  # noqa: E402
from fp4sense.numerics import formats as F  # noqa: E402
from fp4sense.numerics import fp4  # noqa: E402


def main() -> None:
    cases, bad = 0, []
    g = torch.Generator().manual_seed(0)
    for fmt in ("nvfp4", "mxfp4"):
        block = F.get_format(fmt).block_size
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            weights = [("random", (torch.randn(48, 128, generator=g) * 0.05).to(dtype))]
            weights += special_weights(dtype, block)
            for name, w in weights:
                expected, fake, decompressed = reference(w, fmt)
                ours = fp4.compress(w, fmt)
                ok = sorted(ours) == sorted(expected) and all(
                    same_bits(as_bytes(ours[k]), as_bytes(expected[k])) for k in expected)
                ok = ok and same_bits(fp4.quantize_dequantize(w, fmt), fake)
                ok = ok and same_bits(fp4.decompress(expected, fmt, torch.bfloat16), decompressed)
                cases += 1
                if not ok:
                    bad.append(f"{fmt}/{dtype}/{name}")
    print(json.dumps({"compressed_tensors": importlib.metadata.version("compressed-tensors"),
                      "cases": cases, "mismatches": bad}))


if __name__ == "__main__":
    main()
