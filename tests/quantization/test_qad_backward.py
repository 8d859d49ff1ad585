"""QAD with a training recipe's backward (``DistillSettings.backward``): the forward is
QAD's own, dgrad and wgrad run on operands quantized as the recipe says, the hooks leave
nothing behind, on several families."""

from __future__ import annotations

import pytest
import torch

from fp4sense.numerics.training import get_recipe
from fp4sense.numerics.training_linear import gemm_operands
from fp4sense.quantization.distill import (
    DistillError,
    DistillSettings,
    _trained,
    base_pass,
    distill,
)
from fp4sense.quantization.straight_through import Refresher, install
from helpers import family_model, mixed_plan_setup, weights_of


def _step(model, units, schemes, windows, backward):
    """One straight-through forward and backward under ``backward``: the logits, each
    trained linear's master-weight gradient, and one linear's seen input and dY."""
    settings = DistillSettings(steps=1, windows=2, holdout=0)
    base = base_pass(model, units, schemes, windows, settings)
    modules = dict(model.named_modules())
    trained = _trained(units, schemes)
    params, hooks = install(modules, trained, base.absmax, None, backward)
    Refresher(modules, trained, base.importance, dtype=torch.float32).refresh(search=False)
    name = trained[0][0].modules[0]
    seen = {}

    def keep(_module, args, out):
        seen["x"] = args[0].detach().reshape(-1, args[0].shape[-1])
        out.register_hook(lambda g: seen.__setitem__("dy", g.reshape(-1, g.shape[-1])))

    probe = modules[name].register_forward_hook(keep)
    try:
        logits = model(input_ids=windows[:1]).logits
        logits.float().square().mean().backward()
        names = [m for u, _ in trained for m in u.modules]  # install's order
        grads = {m: p.grad.clone() for m, p in zip(names, params, strict=True)}
        weight = modules[name].weight.detach()
    finally:
        probe.remove()
        for h in hooks:
            h.remove()
        for m in [m for u, _ in trained for m in u.modules]:
            torch.nn.utils.parametrize.remove_parametrizations(modules[m], "weight",
                                                     leave_parametrized=False)
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None
    return logits.detach(), grads, name, seen, weight


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_a_recipe_backward_keeps_the_forward_and_quantizes_dgrad_and_wgrad(family, tmp_path):
    """Under MXFP4 (no stochastic rounding: exact) the logits are QAD's own bit for bit, the
    master weight's gradient is the wgrad GEMM of the quantized operands, bit for bit, and
    the other gradients move (dgrad is quantized too)."""
    family_model(tmp_path / family, family)
    model, units, schemes, windows, _ = mixed_plan_setup(tmp_path / family)
    plain, plain_grads, _, _, _ = _step(model, units, schemes, windows, "bf16")
    logits, grads, name, seen, weight = _step(model, units, schemes, windows, "mxfp4")
    assert torch.equal(logits, plain)
    a, b = gemm_operands("wgrad", get_recipe("mxfp4"), seen["x"], weight, seen["dy"])
    assert torch.equal(grads[name], (a @ b.t())[:, : weight.shape[1]])
    assert not torch.equal(grads[name], plain_grads[name])
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing left


def test_qad_with_an_nvfp4_backward_trains_and_records_it(tiny_llama):
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    start = weights_of(model)
    settings = dict(steps=4, lr=3e-5, windows=4, holdout=0, check_every=2, save_every=2)
    record = distill(model, units, schemes, windows,
                     DistillSettings(**settings, backward="nvfp4"), progress=False)
    fp4 = weights_of(model)
    model.load_state_dict(start)
    distill(model, units, schemes, windows, DistillSettings(**settings), progress=False)
    assert record["settings"]["backward"] == "nvfp4"
    assert all(torch.isfinite(torch.tensor(v)) for v in record["history"]["loss"])
    moved = [k for k in fp4 if not torch.equal(fp4[k], start[k])]
    assert moved and any(not torch.equal(fp4[k], model.state_dict()[k]) for k in moved)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_hosts_own_forward_comes_back_after_the_training(tiny_llama):
    """compressed-tensors wraps a quantized linear's forward on the instance; the recipe
    backward wraps whatever is there and puts it back."""
    model, units, schemes, windows, _ = mixed_plan_setup(tiny_llama)
    name = _trained(units, schemes)[0][0].modules[0]
    module = model.get_submodule(name)
    host = module.forward  # the class's, bound: stands for a host's wrapper
    module.forward = host
    distill(model, units, schemes, windows,
            DistillSettings(steps=2, windows=2, holdout=0, check_every=1, save_every=1,
                            backward="mxfp4"), progress=False)
    assert module.__dict__["forward"] is host


def test_an_unknown_backward_recipe_is_one_clear_error():
    with pytest.raises(DistillError, match="bf16, nvfp4, mxfp4, mxfp8.*'fp4'"):
        DistillSettings(steps=5, backward="fp4").check()
