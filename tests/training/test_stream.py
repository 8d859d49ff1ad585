"""The training analysis one block at a time: the streamed backward gives the whole
backward's gradients on every family, and a low-memory model (blocks read from its files)
gets the estimate, the forward and the gradient stakes of the model loaded whole, never
holding more than one block's weights."""

from __future__ import annotations

import pytest
import torch
from test_estimate import _ids, _model

from families import FAMILIES, make_family_model
from fp4sense.structure.units import find_units
from fp4sense.training.estimate import (
    estimate_training,
    forward_stakes,
    gradient_stakes,
    training_units,
)
from fp4sense.training.stream import streamed_backward


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["qwen3_moe"])
def test_the_streamed_backward_gives_the_whole_backwards_gradients(family):
    """Bit for bit (float32, the same operations on the same inputs; measured identical
    on all eight families): every parameter's gradient, the embeddings' included, and
    the loss."""
    model, ids = _model(family), _ids(3, 40)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    seen = []
    streamed = streamed_backward(model, find_units(model, ids[:1, :16]).blocks_path, ids,
                                 seen.append)
    assert streamed == float(loss.detach())
    assert seen == list(range(len(seen) - 1, -1, -1)) and len(seen) >= 2  # last first
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == whole.keys() and any("embed" in n for n in got)
    for name, grad in whole.items():
        assert torch.equal(got[name], grad), name
    assert not any("forward" in vars(m) for m in model.modules())  # blocks given back


def test_a_router_auxiliary_loss_is_refused_by_name():
    """MoE models that add the router's auxiliary loss need all blocks' router logits in
    one graph: refused in one line, not computed without it."""
    from fp4sense.validate import InputError

    model, ids = _model("qwen3_moe"), _ids(2, 24)
    model.config.output_router_logits = True
    with pytest.raises(InputError, match=r"output_router_logits.*without --low-memory"):
        streamed_backward(model, "model.layers", ids)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_low_memory_model_gets_the_whole_models_training_estimate(family, assets,
                                                                    tmp_path):
    """Loaded with ``low_memory`` (each block read from the model's files when it runs):
    the estimate, the forward stakes and the gradient stakes (its one AdamW step taken
    block by block, the stepped blocks on disk) equal the whole model's, and at most one
    block's weights are in memory at any time."""
    from fp4sense.inputs.models import load_model

    path = make_family_model(family, tmp_path / family, tokenizer_from=assets["model"])
    whole, _, _ = load_model(path)
    lean, _, _ = load_model(path, low_memory=True)
    store = lean.fp4sense_blocks
    most, load = {"blocks": 0}, store._load

    def counted(i):
        load(i)
        most["blocks"] = max(most["blocks"], len(store.loaded))
    store._load = counted
    ids = _ids(4, 48)
    results = []
    for model in (whole, lean):
        units = find_units(model, ids[:1, :16])
        trained = training_units(units, model)
        stakes = gradient_stakes(model, ids, trained, "nvfp4", lr=1e-3, steps=4, seeds=2)
        forward = forward_stakes(model, ids, trained, "nvfp4")
        est = estimate_training(model, ids, units, "nvfp4", seeds=2, stakes=stakes,
                                forward=forward)
        results.append((stakes, forward, [e.to_dict() for e in est]))
    assert most["blocks"] == 1
    (s1, f1, e1), (s2, f2, e2) = results
    assert s1["progress"] > 0  # the step taken block by block moves the held loss
    assert s2 == pytest.approx(s1, rel=1e-5) and f2 == pytest.approx(f1, rel=1e-5)
    for a, b in zip(e1, e2, strict=True):
        assert a["name"] == b["name"]
        for gemm, figures in a["gemms"].items():
            assert b["gemms"][gemm] == pytest.approx(figures, rel=1e-5), (a["name"], gemm)
    assert sum(p.numel() for p in store.blocks.parameters()) == 0  # none held after
    assert not store.overrides and all(p.grad is None for p in lean.parameters())
    with torch.no_grad():  # the model's own weights again, read from its files
        assert float(lean(input_ids=ids, labels=ids).loss) == pytest.approx(
            float(whole(input_ids=ids, labels=ids).loss), rel=1e-6)
