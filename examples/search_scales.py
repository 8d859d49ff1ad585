"""Quantize a model to NVFP4A16 with searched block scales, using the Python API.

    .venv/bin/python examples/search_scales.py [MODEL] [--out DIR] [--windows N]

MODEL defaults to the bundled SmolLM2; calibration text to the protocol's calibration
split. The checkpoint is a standard compressed-tensors nvfp4-pack-quantized folder:
plain transformers (and vLLM) load it with no fp4sense import.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

import fp4sense_llmcompressor  # noqa: F401  (registers NVFP4A16_SEARCH and its observer)
from fp4sense.inputs.assets import default_model_path, ensure_model
from fp4sense.inputs.texts import protocol_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--out", type=Path, default=Path("demo-output/nvfp4a16-search"))
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--scheme", default="NVFP4A16_SEARCH")
    args = parser.parse_args()

    model_path = args.model or (ensure_model() and default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    windows = protocol_windows(tokenizer, "calibration", args.windows)
    dataset = Dataset.from_dict({"input_ids": windows.tolist(),
                                 "attention_mask": torch.ones_like(windows).tolist()})
    oneshot(
        model=model,
        dataset=dataset,
        recipe=QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"]),
        num_calibration_samples=len(windows),
        max_seq_length=windows.shape[1],
        pipeline="sequential",  # weight-only: still feed the calibration inputs to the observer
    )
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
