"""The training policy is the exact optimum under its budget (checked against every
choice on a small model), NVIDIA's rule is the paper's (first 2 and last 8 of 62 blocks at
16%), and each export says the policy in its tool's terms: Transformer Engine's
precision-debug YAML (anchored regexes, no layer in two sections), Megatron's precision
config and first/last arguments, torchtitan's FQN lists, and torchao's filter, run by
torchao's own quantize_."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fp4sense.numerics.training import GEMMS
from fp4sense.training.estimate import GemmError, UnitEstimate
from fp4sense.training.exports import (
    megatron_config,
    te_debug_yaml,
    torchtitan_fqns,
    write_exports,
)
from fp4sense.training.policy import PARTS, nvidia_rule, policy_linears, solve_policy
from fp4sense.validate import InputError

KINDS = (("self_attn.q_proj+k_proj+v_proj", ("q_proj", "k_proj", "v_proj"), 3 * 64 * 64),
         ("self_attn.o_proj", ("o_proj",), 64 * 64), ("mlp.gate_proj+up_proj",
                                                       ("gate_proj", "up_proj"), 2 * 64 * 128),
         ("mlp.down_proj", ("down_proj",), 64 * 128))


def _units(blocks: int, seed: int = 0, scale: float = 1.0) -> list[UnitEstimate]:
    import random

    rng = random.Random(seed)
    out = []
    for b in range(blocks):
        for kind, leaves, numel in KINDS:
            e = UnitEstimate(f"{b}:{kind}", b, kind, tuple(
                f"model.layers.{b}.{kind.split('.')[0]}.{leaf}" for leaf in leaves), 2 * numel)
            e.gemms = {g: GemmError(0.1, damage=scale * rng.random() * (1 + b)) for g in GEMMS}
            out.append(e)
    return out


@pytest.mark.parametrize("share", [0.1, 0.3, 0.6])
def test_the_policy_is_the_exact_optimum_under_its_budget(share):
    """One block: its 12 GEMMs x 3 precisions, every one of the 531,441 policies."""
    import numpy as np

    fp4, fp8 = _units(1, 0), _units(1, 1, scale=0.1)
    policy = solve_policy(fp4, fp8, "nvfp4", tokens=4096, part="b200", bf16_share=share)
    budget = policy["budget"]["step_time_s"]
    assert policy["cost_s"] <= budget * (1 + 1e-9)
    rates = PARTS["b200"][0]
    items = [(e, g) for e in fp4 for g in GEMMS]
    cost = np.array([[e.flops_per_token * 4096 / (rates[k] * 1e15) for k in
                      ("bf16", "fp4", "fp8")] for e, _ in items])
    damage = np.array([[0.0, e.gemms[g].damage, fp8[i // 3].gemms[g].damage]
                       for i, (e, g) in enumerate(items)])
    choice = np.indices((3,) * len(items)).reshape(len(items), -1)  # every policy
    rows = np.arange(len(items))[:, None]
    total_cost, total_damage = cost[rows, choice].sum(0), damage[rows, choice].sum(0)
    best = total_damage[total_cost <= budget * (1 + 1e-9)].min()
    assert policy["predicted_damage"] == pytest.approx(best, rel=1e-9)


def test_budget_ends_and_bad_budgets():
    fp4 = _units(3)
    all_bf16 = solve_policy(fp4, None, "nvfp4", 1024, bf16_share=1.0)
    assert all_bf16["predicted_damage"] == 0 and all_bf16["bf16_flops_share"] == 1.0
    all_fp4 = solve_policy(fp4, None, "nvfp4", 1024, bf16_share=0.0)
    assert {p for c in all_fp4["choices"] for p in c["gemms"].values()} == {"nvfp4"}
    half = solve_policy(fp4, None, "nvfp4", 1024, bf16_share=0.5)
    assert 0 < half["bf16_flops_share"] <= 0.5 + 1e-9
    with pytest.raises(InputError, match="below the least this model allows"):
        solve_policy(fp4, None, "nvfp4", 1024, step_time_s=1e-12)
    with pytest.raises(InputError, match="unknown Blackwell part"):
        solve_policy(fp4, None, "nvfp4", 1024, part="h100")
    with pytest.raises(InputError, match="an FP4 one"):
        solve_policy(fp4, None, "mxfp8", 1024)


def test_nvidias_rule_is_the_papers():
    """12B (62 blocks, 16% of the linears in BF16): the first 2 and the last 8 blocks."""
    rule = nvidia_rule(_units(62), "nvfp4", 1024, "b200", 0.0, 0.16)
    assert rule["bf16_blocks"] == [0, 1, *range(54, 62)]
    assert nvidia_rule(_units(30), "nvfp4", 1024, "b200", 0.0, 0.15)["bf16_blocks"] == \
        [26, 27, 28, 29]


def _megatron_names(blocks: int, one_based: bool) -> list[str]:
    leaves = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
              "mlp.linear_fc2")
    return [f"decoder.layers.{b + one_based}.{leaf}" for b in range(blocks) for leaf in leaves]


def test_te_precision_debug_yaml_matches_each_layer_once_and_anchored():
    fp4 = _units(20)
    policy = solve_policy(fp4, _units(20, 1, 0.1), "nvfp4", 4096, bf16_share=0.2)
    config, notes = te_debug_yaml(policy)
    config = yaml.safe_load(yaml.safe_dump(config))
    names = [f"model.module.{n}" for n in _megatron_names(20, True)]  # TE: 1-based numbers
    hits = {n: [] for n in names}
    for section, body in config.items():
        assert set(body) == {"enabled", "layers", "transformer_engine"}, section
        assert set(body["layers"]) == {"layer_name_regex_pattern"}
        (feature, settings), = body["transformer_engine"].items()
        assert feature in ("DisableQuantizationLayer", "DisableQuantizationGEMM")
        if feature == "DisableQuantizationGEMM":
            assert set(settings["gemms"]) < set(GEMMS)
        pattern = re.compile(body["layers"]["layer_name_regex_pattern"])
        for n in names:
            if pattern.search(n):  # TE matches unanchored, with re.search
                hits[n].append(section)
    assert all(len(v) <= 1 for v in hits.values())  # TE raises on a layer in two sections
    high = {c["unit"] for c in policy["choices"] if any(p != "nvfp4"
                                                        for p in c["gemms"].values())}
    assert sum(1 for v in hits.values() if v) == len(high)
    block1 = [n for n, v in hits.items() if v and ".layers.2." in n]  # block 1, 1-based
    assert not any(".layers.12." in n for n in block1)
    # TE's debug features only disable quantization: MXFP8 GEMMs are named in a note
    mxfp8 = any(p == "mxfp8" for c in policy["choices"] for p in c["gemms"].values())
    assert bool(notes) == mxfp8 and all("MXFP8" in line for line in notes)


def test_megatron_config_and_first_last_arguments():
    fp4 = _units(10)
    policy = solve_policy(fp4, None, "nvfp4", 4096, bf16_share=0.2)
    m = megatron_config(policy)
    names = _megatron_names(10, False)  # named_modules: ModuleList indices, from 0
    for matcher in m["te_precision_config"]["matchers"].values():
        assert matcher["type"] == "glob" and matcher["config"] in m["te_precision_config"][
            "configs"]
        assert [n for n in names if fnmatch.fnmatchcase(n, matcher["pattern"])] == [
            matcher["pattern"]]
    rule = dict(policy, choices=[dict(c, gemms={g: ("bf16" if c["block"] in policy[
        "nvidia_rule"]["bf16_blocks"] else "nvfp4") for g in GEMMS}) for c in
        policy["choices"]])
    args = megatron_config(rule)["first_last_layers"]
    assert args == {"expressible": True, "args": [
        "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "0",
        "--num-layers-at-end-in-bf16", "2"]}
    mixed = dict(rule, choices=[dict(c, gemms={**c["gemms"], "wgrad": "bf16"})
                                if c["unit"] == "4:mlp.down_proj" else c
                                for c in rule["choices"]])
    assert megatron_config(mixed)["first_last_layers"]["expressible"] is False
    assert policy_linears(rule) == policy_linears(policy, rule=True)


def test_torchtitan_fqns_are_substring_safe():
    policy = solve_policy(_units(12), None, "nvfp4", 4096, bf16_share=0.1)
    t = torchtitan_fqns(policy)
    titan = [f"layers.{b}.{leaf}" for b in range(12) for leaf in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
        "feed_forward.w2", "feed_forward.w3")] + ["output"]
    left_out = {n for n in titan if any(f in n for f in t["filter_fqns"])}
    converted = {n for n in titan if any(f in n for f in t["fqns"])}
    assert left_out == set(t["filter_fqns"]) and converted == set(t["fqns"])
    assert left_out.isdisjoint(converted) and left_out | converted == set(titan)


def test_torchao_filter_runs_in_torchaos_quantize(tmp_path):
    """torchao's own quantize_ with the exported filter: the kept linears stay plain."""
    import torch

    from fp4sense.structure.units import find_units
    from fp4sense.training.estimate import estimate_training

    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=3, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=32))
    ids = torch.randint(0, 512, (2, 32))
    est = estimate_training(model, ids, find_units(model, ids[:1, :16]), "nvfp4", 1)
    policy = solve_policy(est, None, "nvfp4", 4096, bf16_share=0.3)
    write_exports(policy, tmp_path)
    model.save_pretrained(tmp_path / "m")
    kept = set(json.loads((tmp_path / "torchao.json").read_text())["keep_high_precision"])
    assert kept and "lm_head" in kept
    script = (
        "import sys, json, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from torchao.quantization import quantize_, Int8WeightOnlyConfig\n"
        "from fp4sense.training.exports import torchao_filter\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "quantize_(m, Int8WeightOnlyConfig(), filter_fn=torchao_filter(sys.argv[2]))\n"
        "print(json.dumps(sorted(n for n, x in m.named_modules()\n"
        "    if isinstance(x, torch.nn.Linear) and type(x.weight) is torch.nn.Parameter)))\n")
    oracles = Path(sys.prefix) / "oracles"
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m"),
                           str(tmp_path / "torchao.json")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(oracles)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert plain == kept  # exactly the kept linears escaped quantize_


def test_units_the_recipe_cannot_train_stay_bf16_and_bound_the_share():
    """A linear whose width the recipe's blocks do not divide (TE refuses it) is named,
    kept in BF16 in the policy and under NVIDIA's rule, and a share below what it forces
    is one line giving the smallest feasible share."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fp4sense.structure.units import find_units
    from fp4sense.training.estimate import estimate_training, not_eligible, training_units

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=200,
                                         num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=32))
    ids = torch.randint(0, 512, (2, 32))
    units = find_units(model, ids[:1, :16])
    skipped = not_eligible(training_units(units, model), "nvfp4")
    assert set(skipped) == {"0:mlp.gate_proj+up_proj", "0:mlp.down_proj",
                            "1:mlp.gate_proj+up_proj", "1:mlp.down_proj"}
    assert "width 200 is not a multiple of nvfp4's block of 16" in skipped["0:mlp.down_proj"]
    est = estimate_training(model, ids, units, "nvfp4", 1)
    assert {e.name for e in est}.isdisjoint(skipped)
    fixed = []
    for u in units.units:
        if u.name in skipped:
            e = UnitEstimate(u.name, u.block, u.kind, u.modules, 2 * sum(
                i * o for i, o in zip(u.inputs, u.out_features, strict=True)))
            e.gemms = {g: GemmError(0.0) for g in GEMMS}
            fixed.append(e)
    least = sum(e.flops_per_token for e in fixed) / sum(
        e.flops_per_token for e in (*est, *fixed))
    with pytest.raises(InputError, match=f"smallest feasible --bf16-share is {least:.4f}"):
        solve_policy(est, None, "nvfp4", 4096, bf16_share=least / 2, fixed=fixed)
    policy = solve_policy(est, None, "nvfp4", 4096, bf16_share=min(1.0, least + 0.1),
                          fixed=fixed)
    mlp = [c for c in policy["choices"] if c["unit"] in skipped]
    assert len(mlp) == 4 and all(set(c["gemms"].values()) == {"bf16"} for c in mlp)
    assert all(set(policy_linears(policy, rule=True)[m].values()) == {"bf16"}
               for c in mlp for m in c["modules"])
