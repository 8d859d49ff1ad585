"""Shared fixtures: the bundled assets, a tiny random Llama, a checkpoint that `fp4sense
quantize` wrote from it, the serve environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SERVE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
FP4SENSE = str(Path(sys.executable).parent / "fp4sense")
# a quick `fp4sense quantize` of the tiny model
SMALL = ["--calib-windows", "4", "--analysis-windows", "2", "--tokens", "64", "--eval-windows", "2"]


@pytest.fixture(scope="session")
def assets() -> dict[str, Path]:
    """The bundled SmolLM2 folder and the protocol text splits (fetched if missing)."""
    from fp4sense.inputs.assets import ensure_assets

    return ensure_assets(log=lambda msg: None)


@pytest.fixture(scope="session")
def smollm2_state(assets) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(assets["model"] / "model.safetensors")


def make_tiny_llama(path: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """A randomly initialised 2-block Llama saved at ``path`` (fast stand-in for shapes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, assets) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(" ".join(f"Sentence number {i} of the calibration text, about the "
                             f"union and its people." for i in range(300)))
    return path


@pytest.fixture(scope="session")
def quantized(tiny_llama, text_file, tmp_path_factory) -> Path:
    """A mixed-precision checkpoint (with its model card) written by `fp4sense quantize`."""
    out = tmp_path_factory.mktemp("q") / "tiny-mixed"
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5.5", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def serve_python() -> Path:
    if not SERVE_PYTHON.exists():
        pytest.fail(f"serve environment missing ({SERVE_PYTHON}); run `make setup`")
    return SERVE_PYTHON


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(REPO / "tests"))


def rerun_recipe(folder: Path, base: Path, text_file: Path, again: Path) -> None:
    """Run ``folder``'s recipe.yaml with llm-compressor's oneshot on ``base`` (from the
    checkpoint folder: the recipe names its files relative to it) and write the result
    to ``again``, as a user reproducing a checkpoint would (4 windows of 64 tokens)."""
    import json
    import os

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.api import analysis_windows

    tok = AutoTokenizer.from_pretrained(base)
    calib = analysis_windows(tok, text_file, 4, 64)
    data = Dataset.from_dict({"input_ids": calib.tolist(),
                              "attention_mask": torch.ones_like(calib).tolist()})
    # in the dtype the checkpoint was calibrated in, as recipe.yaml's header says
    dtype = json.loads((folder / "plan.json").read_text()).get("calibration", {}).get(
        "dtype", "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        oneshot(model=model, recipe="recipe.yaml", dataset=data, num_calibration_samples=4,
                max_seq_length=64, processor=tok)
    finally:
        os.chdir(cwd)
    model.save_pretrained(again, save_compressed=True)
