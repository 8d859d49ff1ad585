"""Block-wise QAD (``mode="block"``): the recorded block calls replay the model exactly,
each block learns to reproduce its unquantized output on several families, a run that
only hurts keeps the weights it started from, and an interrupted run resumes in the block
it stopped in to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from families import make_family_model
from fp4sense.quantization import blockwise
from fp4sense.quantization.distill import DistillError, DistillSettings, distill
from helpers import mixed_plan_setup, weights_of

FAMILIES = ["llama", "qwen2", "gemma2", "mistral"]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("blockwise")
    return {f: make_family_model(f, root / f) for f in FAMILIES}


def _settings(**kw) -> DistillSettings:
    return DistillSettings(**{"steps": 8, "lr": 1e-4, "windows": 3, "holdout": 1,
                              "check_every": 2, "save_every": 4, "rescale_every": 4,
                              "mode": "block", **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_block_calls_replay_the_model_exactly(family_models, family):
    """Each block run from the recorded call and the previous block's replayed output
    gives the output the whole model's forward gave it (masks, rotary embeddings,
    sliding windows and soft-capping all in the call)."""
    model, units, *_ = mixed_plan_setup(family_models[family])
    blocks = model.get_submodule(units.blocks_path)
    windows = torch.randint(0, 2000, (2, 40), generator=torch.Generator().manual_seed(2))
    current = {"i": 0}
    with torch.no_grad(), blockwise.record_blocks(blocks, len(windows), current) as got:
        for i, w in enumerate(windows):
            current["i"] = i
            model(input_ids=w[None], use_cache=False)
    with torch.no_grad():
        for i in range(len(windows)):
            x = got.first_in[i]
            for b, block in enumerate(blocks):
                x = blockwise._run(block, got.calls[b][i], x)
                assert torch.equal(x.to(torch.bfloat16), got.out[b][i]), (family, b, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_wise_qad_lowers_each_blocks_error_and_the_kl(family_models, family):
    model, units, schemes, windows, bf16_unit = mixed_plan_setup(family_models[family])
    before = weights_of(model)
    lines: list[str] = []
    record = distill(model, units, schemes, windows, _settings(holdout=0, windows=4),
                     progress=False, log=lines.append)
    assert record["mode"] == "block" and record["kept_training"]
    assert len(record["blocks"]) == units.n_blocks
    for b in record["blocks"]:  # (ends on the better of its last and best state)
        assert b["loss_after"] < b["loss_before"], (family, b)
    assert record["loss_after"] < record["loss_before"]
    assert len(record["history"]["loss"]) == 8 * units.n_blocks
    assert any("block 1" in line for line in lines)
    after = weights_of(model)
    assert sorted(after) == sorted(before)  # no parametrization left behind
    untouched = {f"{m}.weight" for m in units.by_name()[bf16_unit].modules}
    for key, value in before.items():
        if key in untouched or "norm" in key or "embed" in key:
            assert torch.equal(after[key], value), key
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_a_block_wise_run_that_only_hurts_keeps_the_starting_weights(family_models):
    """A learning rate far too high: each block rolls back and its held-out window keeps
    its starting state, so the model ends exactly as it began."""
    model, units, schemes, windows, _ = mixed_plan_setup(family_models["llama"])
    before = weights_of(model)
    record = distill(model, units, schemes, windows, _settings(lr=3.0), progress=False)
    assert record["rollbacks"] and all(b["holdout"]["step"] == 0 for b in record["blocks"])
    assert record["holdout"]["after"] <= record["holdout"]["before"]
    assert all(torch.equal(v, before[k]) for k, v in weights_of(model).items())


def test_interrupted_block_wise_qad_resumes_in_its_block(family_models, tmp_path,
                                                         monkeypatch):
    path = family_models["llama"]
    settings = _settings(lr=1e-3, lr_4bit=2.0)
    model, units, schemes, windows, _ = mixed_plan_setup(path)
    distill(model, units, schemes, windows, settings, progress=False)
    straight = weights_of(model)

    real, calls = blockwise._block_loss, {"n": 0, "block1": 0}
    blocks = model.get_submodule(units.blocks_path)

    def interrupting(block, item, target):
        calls["n"] += 1
        if block is blocks[1] and torch.is_grad_enabled():  # a training step of block 1
            calls["block1"] += 1
            if calls["block1"] == 6:
                raise KeyboardInterrupt
        return real(block, item, target)

    model, units, schemes, windows, _ = mixed_plan_setup(path)
    blocks = model.get_submodule(units.blocks_path)
    monkeypatch.setattr(blockwise, "_block_loss", interrupting)
    with pytest.raises(KeyboardInterrupt):
        distill(model, units, schemes, windows, settings, state_dir=tmp_path, key="k",
                progress=False)
    monkeypatch.setattr(blockwise, "_block_loss", real)
    assert (tmp_path / "block-000").is_dir() and (tmp_path / "block-001").is_dir()

    model, units, schemes, windows, _ = mixed_plan_setup(path)
    lines: list[str] = []
    distill(model, units, schemes, windows, settings, state_dir=tmp_path, key="k",
            progress=False, log=lines.append)
    assert any("block 0: resumed at step 8" in line for line in lines)  # finished
    assert any("block 1: resumed at step 4" in line for line in lines)  # its last save
    resumed = weights_of(model)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_an_unknown_mode_is_one_clear_error():
    with pytest.raises(DistillError, match="end-to-end, block"):
        DistillSettings(steps=4, mode="blocks").check()


@pytest.mark.slow
def test_quantize_with_block_wise_qad_after_gptq(tiny_llama, text_file, tmp_path):
    """`fp4sense quantize --gptq --distill N --distill-mode block` trains block by block
    after GPTQ under its scales and writes the usual checkpoint; plan.json, distill.json,
    the recipe and the model card say how it trained."""
    import json
    import subprocess

    import yaml

    from conftest import FP4SENSE, SMALL
    from fp4sense.checkpoint.checks import check_checkpoint

    out = tmp_path / "block"
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5.0", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--gptq",
                           "--distill", "6", "--distill-mode", "block", "--distill-windows",
                           "2", "--distill-holdout", "1", "--distill-lr", "1e-4", "--no-eval"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_checkpoint(out)
    record = json.loads((out / "distill.json").read_text())
    assert record["mode"] == "block" and record["start"] == "after GPTQ, under its scales"
    assert len(record["blocks"]) == 2 and record["holdout"]["windows"] == 1
    assert record["holdout"]["after"] <= record["holdout"]["before"]
    training = json.loads((out / "plan.json").read_text())["training"]
    assert training["mode"] == "block" and training["steps"] == 6
    stage = yaml.safe_load((out / "recipe.yaml").read_text())["quant_stage"]["quant_modifiers"]
    assert list(stage) == ["SensitivityGuidedModifier", "GPTQModifier",
                           "QuantizationAwareDistillationModifier"]
    assert stage["QuantizationAwareDistillationModifier"]["mode"] == "block"
    card = (out / "README.md").read_text()
    assert "block by block" in card and (out / "distill.png").is_file()
    assert not list(tmp_path.glob(".*"))  # no training state, no partial folder left
