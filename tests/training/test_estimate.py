"""The estimated FP4 training sensitivity measures what each GEMM alone does: a unit's
wgrad and fprop errors from the all-at-once pass equal those of a model with only that
GEMM of only that unit quantized; stochastic rounding's noise averages away over seeds
(the bias stays below the error); fprop's damage is the Fisher form of its output error,
scaled per kind to that kind's measured forward cost;
the gradient GEMMs' damage scales with the progress at stake; the trials start from one
place and count the text drawn in their SE; the monitor flags divergence;
FP4TrainingMonitor runs in a transformers Trainer."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fp4sense.numerics.training import get_recipe
from fp4sense.numerics.training_linear import apply_training_policy
from fp4sense.structure.units import find_units
from fp4sense.training.estimate import (
    NSR_LIMIT,
    estimate_training,
    forward_stakes,
    gradient_stakes,
    training_units,
)
from fp4sense.training.trials import (
    Arm,
    Monitor,
    TrialResult,
    held_aside_losses,
    paired_differences,
    run_trials,
)

FAMILY_SET = ["llama", "qwen2", "gemma2", "mistral", "qwen3_moe"]


def _model(family: str = "llama", seed: int = 0):
    import transformers

    from families import COMMON, FAMILIES, MOE_FAMILIES

    model_cls, config_cls, overrides, _ = {**FAMILIES, **MOE_FAMILIES}[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    return getattr(transformers, model_cls)(config)


def _ids(n=4, t=48, seed=0):
    return torch.randint(0, 2000, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILY_SET)
def test_each_gemm_error_is_the_error_of_that_gemm_alone(family):
    model, ids = _model(family), _ids()
    units = find_units(model, ids[:1, :16])
    recipe = get_recipe("nvfp4").but(stochastic_rounding=False)  # deterministic
    est = {e.name: e for e in estimate_training(model, ids, units, recipe, seeds=1)}
    assert all(p.grad is None for p in model.parameters())  # left as it was
    assert all(type(m).__name__ != "EmulatedLinear" for m in model.modules())
    trained = training_units(units, model)
    assert set(est) == {u.name for u in trained} and len(trained) >= 4
    if family == "qwen3_moe":  # routed experts held as 3-D parameters: not emulated, named
        assert any(name.endswith("mlp.experts") for name in units.unaccounted)
    unit = trained[len(trained) // 2]
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def grads_and_outputs(policy):
        model.load_state_dict(state)
        apply_training_policy(model, policy)
        outs = {}

        def keep(m, o):
            outs[m] = o.detach()
            o.register_hook(lambda g: outs.__setitem__(("dy", m), g.detach()))
        hooks = [model.get_submodule(m).register_forward_hook(
            lambda mod, i, o, m=m: keep(m, o)) for m in unit.modules]
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        for h in hooks:
            h.remove()
        return {m: model.get_submodule(m).weight.grad.clone() for m in unit.modules}, outs

    exact_g, exact_y = grads_and_outputs({})
    wgrad_g, _ = grads_and_outputs({m: {"wgrad": recipe} for m in unit.modules})
    _, fprop_y = grads_and_outputs({m: {"fprop": recipe} for m in unit.modules})

    def rel(q, r):
        num = sum(float((q[m] - r[m]).pow(2).sum()) for m in unit.modules)
        return (num / sum(float(r[m].pow(2).sum()) for m in unit.modules)) ** 0.5

    bias = {m: model.get_submodule(m).bias for m in unit.modules}
    bias = {m: None if b is None else b.detach() for m, b in bias.items()}
    dy = {m: exact_y.pop(("dy", m)) for m in unit.modules}
    fprop_y = {m: fprop_y[m] for m in unit.modules}
    # fprop's damage: ½ Σ (g ⊙ ΔY)² per predicted token, g = tokens × dY of the mean loss
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    fisher = 0.5 * tokens * sum(float((dy[m] * (fprop_y[m] - exact_y[m])).pow(2).sum())
                                for m in unit.modules)
    exact_y = {m: y - (bias[m] if bias[m] is not None else 0) for m, y in exact_y.items()}
    fprop_y = {m: y - (bias[m] if bias[m] is not None else 0) for m, y in fprop_y.items()}
    e = est[unit.name]
    assert e.gemms["wgrad"].rel_error == pytest.approx(rel(wgrad_g, exact_g), rel=1e-3)
    assert e.gemms["fprop"].rel_error == pytest.approx(rel(fprop_y, exact_y), rel=1e-3)
    assert 0 < e.gemms["dgrad"].rel_error < 0.5
    assert e.gemms["fprop"].damage == pytest.approx(fisher, rel=1e-3) and fisher > 0


def test_stochastic_rounding_noise_averages_away_over_seeds():
    model, ids = _model(), _ids()
    units = find_units(model, ids[:1, :16])
    sr = estimate_training(model, ids, units, "nvfp4", seeds=4)
    rn = estimate_training(model, ids, units, get_recipe("nvfp4").but(
        stochastic_rounding=False), seeds=2)
    for a, b in zip(sr, rn, strict=True):
        assert a.gemms["wgrad"].bias < a.gemms["wgrad"].rel_error  # noise, told apart
        assert b.gemms["wgrad"].bias == pytest.approx(b.gemms["wgrad"].rel_error, rel=1e-6)
        assert 0.9 < a.gemms["wgrad"].cosine <= 1 and a.nsr < NSR_LIMIT
    damage = [u.gemms[g].damage for u in sr for g in u.gemms]
    assert all(d >= 0 for d in damage) and sr[0].gemms["dgrad"].damage == 0  # nothing before


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_gradient_gemms_damage_is_their_measured_cost_shared_by_error(family):
    model, ids = _model(family), _ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = {n: type(m) for n, m in model.named_modules()}
    units = find_units(model, ids[:1, :16])
    trained = training_units(units, model)
    stakes = gradient_stakes(model, ids, trained, "nvfp4", lr=1e-3, steps=4, seeds=2)
    assert set(stakes) == {"progress", "dgrad", "wgrad"}
    assert stakes["progress"] > 0 and min(stakes.values()) >= 0  # a step helps held text
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # its step
    with torch.no_grad():
        start = float(model(input_ids=ids[2:], labels=ids[2:]).loss)
    model(input_ids=ids[:2], labels=ids[:2]).loss.backward()
    opt.step()
    with torch.no_grad():
        gained = start - float(model(input_ids=ids[2:], labels=ids[2:]).loss)
    assert stakes["progress"] == pytest.approx(4 * gained, rel=1e-3)
    model.load_state_dict(before)
    model.zero_grad(set_to_none=True)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert {n: type(m) for n, m in model.named_modules()} == kinds  # its own modules
    assert all(p.grad is None for p in model.parameters())
    recipe = get_recipe("nvfp4").but(stochastic_rounding=False)
    shares = estimate_training(model, ids, units, recipe, seeds=1)
    staked = estimate_training(model, ids, units, recipe, seeds=1, stakes=stakes)
    for g in ("dgrad", "wgrad"):
        total = sum(e.gemms[g].damage for e in shares)
        assert sum(e.gemms[g].damage for e in staked) == pytest.approx(stakes[g], abs=1e-12)
        for a, b in zip(shares, staked, strict=True):
            assert b.gemms[g].damage == pytest.approx(stakes[g] * a.gemms[g].damage / total,
                                                      rel=1e-9, abs=1e-15)
            assert b.gemms["fprop"].damage == a.gemms["fprop"].damage  # a level: no stake


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_each_kinds_fprop_damage_is_its_measured_forward_cost_shared_by_fisher(family):
    model, ids = _model(family), _ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = {n: type(m) for n, m in model.named_modules()}
    units = find_units(model, ids[:1, :16])
    trained = training_units(units, model)
    forward = forward_stakes(model, ids, trained, "nvfp4")
    assert list(forward) == list(dict.fromkeys(u.kind for u in trained))
    assert {n: type(m) for n, m in model.named_modules()} == modules  # its own modules
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model.training  # its mode back; the costs are measured in eval mode
    model.eval()
    with torch.no_grad():  # each kind's fprop alone in NVFP4, every block, the rest exact
        exact = float(model(input_ids=ids, labels=ids).loss)
        for kind, cost in forward.items():
            apply_training_policy(model, {m: {"fprop": "nvfp4"} for u in trained
                                          if u.kind == kind for m in u.modules})
            lost = float(model(input_ids=ids, labels=ids).loss) - exact
            assert cost == pytest.approx(max(0.0, lost), abs=1e-6)
            apply_training_policy(model, {})
    model.train()
    assert any(cost > 0 for cost in forward.values())
    recipe = get_recipe("nvfp4").but(stochastic_rounding=False)
    fisher = estimate_training(model, ids, units, recipe, seeds=1)
    scaled = estimate_training(model, ids, units, recipe, seeds=1, forward=forward)
    for kind, cost in forward.items():
        a = [e for e in fisher if e.kind == kind]
        b = [e for e in scaled if e.kind == kind]
        total = sum(e.gemms["fprop"].damage for e in a)
        assert sum(e.gemms["fprop"].damage for e in b) == pytest.approx(cost, abs=1e-12)
        for x, y in zip(a, b, strict=True):
            assert y.gemms["fprop"].damage == pytest.approx(
                cost * x.gemms["fprop"].damage / total, rel=1e-9, abs=1e-15)
            assert y.gemms["wgrad"].damage == x.gemms["wgrad"].damage  # fprop's alone


def test_trials_start_from_one_place_and_pair_their_seeds():
    model, ids = _model(), _ids(10, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    units = training_units(find_units(model, ids[:1, :16]), model)
    fp4 = {m: "nvfp4" for u in units for m in u.modules}
    r = run_trials(model, ids[:8], ids[8:], [Arm("bf16", {}), Arm("again", {}),
                                             Arm("fp4", fp4)], steps=2, seeds=2, lr=1e-3)
    assert r["bf16"].per_seed == r["again"].per_seed  # same start, data order and seeds
    assert r["fp4"].per_seed != r["bf16"].per_seed
    diff = paired_differences(r)
    assert (diff["again"].delta, diff["again"].se, diff["again"].se_text) == (0.0, 0.0, 0.0)
    assert diff["again"].per_window == [0.0, 0.0]  # two held-aside windows
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # the windows' losses average to the loss over all held-aside windows
    for seed_loss, windows in zip(r["fp4"].per_seed, r["fp4"].per_window, strict=True):
        assert len(windows) == 2 and sum(windows) / 2 == pytest.approx(seed_loss, abs=1e-6)
    with torch.no_grad():
        whole = float(model(input_ids=ids[8:], labels=ids[8:]).loss)
        each = [float(model(input_ids=w[None], labels=w[None]).loss) for w in ids[8:]]
    assert held_aside_losses(model, ids[8:], batch=1) == pytest.approx(each, rel=1e-6)
    assert sum(held_aside_losses(model, ids[8:])) / 2 == pytest.approx(whole, rel=1e-6)


def _result(per_window):
    per_seed = [sum(w) / len(w) for w in per_window]
    return TrialResult(sum(per_seed) / len(per_seed), 0.0, 0.0, 0.0, per_seed, [], Monitor(),
                       per_window)


def test_paired_differences_count_the_text_drawn_as_well_as_the_seeds():
    base = _result([[3.0, 4.0, 5.0], [3.2, 4.1, 5.3]])
    arm = _result([[3.1, 4.3, 5.2], [3.2, 4.4, 5.6]])  # differences .1 .3 .2 / 0 .3 .3
    d = paired_differences({"bf16": base, "arm": arm})["arm"]
    assert d.per_window == pytest.approx([0.05, 0.3, 0.25])
    assert d.delta == pytest.approx(0.2)
    assert d.se_seeds == pytest.approx(0.0)  # both seeds' window means differ by 0.2
    assert d.se_text == pytest.approx(statistics.stdev([0.05, 0.3, 0.25]) / 3 ** 0.5)
    assert d.se == pytest.approx(math.hypot(d.se_seeds, d.se_text))
    cached = {n: TrialResult.from_dict({**r.to_dict(), "per_window": []})  # an older cache
              for n, r in (("bf16", base), ("arm", arm))}
    old = paired_differences(cached)["arm"]
    assert old.se_text is None and old.se == old.se_seeds and old.per_window == []


def test_the_monitor_names_spikes_and_divergence():
    m = Monitor()
    for i, loss in enumerate([4.0, 3.9, 3.8, 7.0, 30.0, float("nan")]):
        m.step(i, loss)
    assert m.events[0].startswith("step 3: loss spike")
    assert any(e.startswith("step 4: diverged") for e in m.events)
    assert any(e.startswith("step 5: diverged") for e in m.events)
    m.nsr = {"0:mlp.down_proj": [0.2, 0.7, 0.9], "1:mlp.down_proj": [0.1, 0.2, 0.3]}
    assert m.stop_helping(every=10) == {"0:mlp.down_proj": 10}


@pytest.mark.slow
def test_the_trainer_callback_logs_the_monitor(tmp_path):
    from transformers import Trainer, TrainingArguments

    from fp4sense.api import FP4TrainingMonitor

    model, ids = _model(), _ids(8, 32)
    data = [{"input_ids": row, "labels": row} for row in ids]
    lines = []
    monitor = FP4TrainingMonitor(ids[:2], every=2, log=lines.append)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[monitor]).train()
    report = monitor.report()
    assert report["steps"] == [2, 4]
    assert all(len(v) == 2 for v in report["nsr"].values()) and len(report["nsr"]) == 8
