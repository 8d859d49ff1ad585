"""Mixture-of-Experts models: experts found as units (never skipped), routers left alone
with the reason, expert fake quantization bit for bit what llm-compressor writes, input
statistics from all tokens, routing coverage in the report, and `fp4sense quantize`
writing a checkpoint whose experts are all quantized."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from conftest import FP4SENSE, SMALL
from families import MOE_FAMILIES, make_family_model


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, assets) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {f: make_family_model(f, root / f, tokenizer_from=assets["model"])
            for f in MOE_FAMILIES}


def _load(path):
    from fp4sense.inputs.models import load_model

    return load_model(path)[0]


#: the checkpoints the vLLM tests serve: name -> (model, `fp4sense quantize` arguments)
SERVED = {
    "mixtral": ("mixtral", ["--budget", "8.0", "--menu", "NVFP4,FP8_DYNAMIC,BF16", "--pin",
                            "0:mlp.experts=NVFP4", "--pin", "1:mlp.experts=FP8_DYNAMIC",
                            *SMALL]),
    "qwen3_moe": ("qwen3_moe", ["--budget", "8.0", "--menu", "NVFP4,BF16", "--no-eval",
                                *SMALL[:6]]),
    "qwen2_moe": ("qwen2_moe", ["--budget", "8.0", "--menu", "NVFP4,BF16", "--no-eval",
                                *SMALL[:6]]),
    "mixed": ("qwen3_moe", ["--budget", "8.0", "--menu", "MXFP4,FP8_DYNAMIC,BF16", "--pin",
                            "0:mlp.experts=MXFP4", "--pin", "1:mlp.experts=FP8_DYNAMIC",
                            "--no-scale-search", "--no-eval", *SMALL[:6]]),
}


@pytest.fixture(scope="module")
def served(moe_models, text_file, tmp_path_factory, serve_python) -> dict:
    """Every SERVED checkpoint written by `fp4sense quantize`, then the ones written served
    by one `fp4sense verify-vllm A B ...` (one vLLM process, an engine per checkpoint):
    name -> (folder, quantize's process, vLLM's verdict or None)."""
    root = tmp_path_factory.mktemp("served")
    made = {}
    for name, (model, args) in SERVED.items():
        out = root / name
        made[name] = (out, subprocess.run(
            [FP4SENSE, "quantize", str(moe_models[model]), "--text", str(text_file), "--out",
             str(out), *args], capture_output=True, text=True, timeout=900))
    written = [n for n, (_, proc) in made.items() if proc.returncode == 0]
    done = subprocess.run([FP4SENSE, "verify-vllm", *(str(made[n][0]) for n in written),
                           "--eval-windows", "1", "--tokens", "128", "--serve-python",
                           str(serve_python), "--json"], capture_output=True, text=True,
                          timeout=1800)
    found = json.loads(done.stdout) if done.stdout.strip() else []
    found = found if isinstance(found, list) else [found]
    verdicts = {n: v for n, v in zip(written, found, strict=False)}
    for n, v in verdicts.items():  # the list is in the order of the folders given
        assert v["checkpoint"] == str(made[n][0]), (n, v["checkpoint"])
    return {n: (out, proc, verdicts.get(n, done.stderr[-2000:]))
            for n, (out, proc) in made.items()}


def _written(served, name):
    out, proc, verdict = served[name]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, verdict


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_experts_are_one_unit_per_block_and_nothing_is_skipped(family, moe_models):
    from fp4sense.structure.experts import ROUTER, SHARED_GATE
    from fp4sense.structure.units import find_units

    model = _load(moe_models[family])
    units = find_units(model)
    experts = [u for u in units.units if u.experts]
    assert [u.block for u in experts] == [0, 1]
    for u in experts:
        assert u.kind == "mlp.experts" and u.experts == 8
        assert len(u.modules) == 24  # gate, up, down of each expert
        # each expert's gate/up share an NVFP4 global scale, its down its own
        assert len(u.parts) == 16
        for part in u.parts:
            names = {u.modules[i].rsplit(".", 2)[1] for i in part}
            assert len(names) == 1, part  # never across experts
            assert sorted(m.rsplit(".", 1)[1] for m in (u.modules[i] for i in part)) in (
                ["gate_proj", "up_proj"], ["down_proj"])
        assert u.numel == sum(model.get_submodule(m).weight.numel() for m in u.modules)
    routers = {n for n, why in units.left_alone.items() if why == ROUTER}
    assert routers == {f"model.layers.{b}.mlp.gate" for b in (0, 1)}
    gates = {n for n, why in units.left_alone.items() if why == SHARED_GATE}
    assert gates == ({f"model.layers.{b}.mlp.shared_expert_gate" for b in (0, 1)}
                     if family == "qwen2_moe" else set())
    if family == "qwen2_moe":  # the shared expert: units of its own
        assert "0:mlp.shared_expert.gate_proj+up_proj" in units.by_name()
        assert "0:mlp.shared_expert.down_proj" in units.by_name()
    assert units.unaccounted == {} and units.experts_per_token == 2
    # every 2-D weight is a unit's, left alone with a reason, outside the blocks or an
    # embedding: nothing skipped without a word
    covered = {m for u in units.units for m in u.modules} | set(units.left_alone) | set(
        units.outside) | {"model.embed_tokens"}
    held = {n for n, m in model.named_modules()
            if any(p.dim() == 2 for p in m._parameters.values() if p is not None)}
    assert held <= covered


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_linearized_experts_follow_the_model_to_its_device(family, moe_models):
    """llm-compressor's linearization wraps each new expert module in compressed-tensors'
    offloading, which onloads it to the device the model was on then (the CPU): moved to
    a GPU, the experts still ran on the CPU and the block failed adding them to the shared
    expert (found by the first GPU run of a MoE). The loaded model holds no such wrapper,
    and runs on another device whole: here torch's ``meta`` device, which fails the same
    way on this CPU machine."""
    _runs_whole_on_meta(_load(moe_models[family]))


def _runs_whole_on_meta(model) -> None:
    """No compressed-tensors offloading wrapper is left, and the model runs whole on
    torch's ``meta`` device (a wrapper would onload its inputs to the CPU, as it did on a
    GPU)."""
    from compressed_tensors.offload.cache import OffloadCache

    assert not [n for n, m in model.named_modules() if isinstance(m._parameters, OffloadCache)]
    assert not [n for n, m in model.named_modules() if hasattr(m, "_original_forward_func")]
    model.to("meta")
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    # routing selects tokens with nonzero(): on meta, assume every element is selected
    with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
        logits = model(input_ids=ids).logits
    assert logits.device.type == "meta" and logits.shape[:2] == (1, 8)


def test_a_moe_checkpoint_loads_whole_on_another_device(moe_models, tmp_path):
    """`fp4sense eval` of a MoE checkpoint on a GPU failed: compressed-tensors left the
    loaded model's modules wrapped in offloading to the CPU, so its logits came back on
    the CPU (found by gpu_check's MoE part on an H200)."""
    from fp4sense.checkpoint.loading import load_checkpoint

    out = tmp_path / "q"
    done = subprocess.run([FP4SENSE, "quantize", str(moe_models["qwen2_moe"]), "--budget", "8.0",
                           "--menu", "NVFP4,BF16", "--no-eval", *SMALL[:6], "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    model, _, _ = load_checkpoint(out)
    _runs_whole_on_meta(model)


def test_an_unexplained_weight_is_named(moe_models):
    from fp4sense.structure.units import find_units

    model = _load(moe_models["qwen3_moe"])
    holder = torch.nn.Module()
    holder.table = torch.nn.Parameter(torch.randn(8, 256, 128))
    model.model.layers[1].mlp.lookup = holder
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.lookup .*layout"):
        from fp4sense.inputs.moe import linearize_experts

        linearize_experts(model)
    holder.table = torch.nn.Parameter(torch.randn(2048, 128))  # 2-D, 2% of the model
    units = find_units(model)
    assert list(units.unaccounted) == ["model.layers.1.mlp.lookup"]
    assert units.unaccounted["model.layers.1.mlp.lookup"] > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "FP8_DYNAMIC"])
def test_expert_weights_equal_the_checkpoint_llm_compressor_writes(scheme, moe_models,
                                                                   tmp_path):
    from fp4sense.checkpoint.loading import load_checkpoint
    from fp4sense.structure.units import find_units, quantize_unit
    from helpers import oneshot_checkpoint

    source = moe_models["qwen3_moe"]
    from llmcompressor.modifiers.quantization import QuantizationModifier

    recipe = QuantizationModifier(targets=["Linear"], scheme=scheme,
                                  ignore=["lm_head", r"re:.*mlp\.gate$"])
    served, _, _ = load_checkpoint(oneshot_checkpoint(source, scheme, tmp_path / scheme,
                                            recipe=recipe))
    base = _load(source)
    checked = 0
    for unit in (u for u in find_units(base).units if u.experts):
        ours = quantize_unit(scheme, unit, [base.get_submodule(m).weight for m in unit.modules])
        for name, w in zip(unit.modules, ours, strict=True):
            assert torch.equal(w, served.get_submodule(name).weight), (scheme, name)
            checked += 1
    assert checked == 48


def test_expert_statistics_come_from_all_tokens_and_routing_is_counted(moe_models):
    from fp4sense.diagnosis.cache import EntryCache
    from fp4sense.diagnosis.engine import Analysis
    from fp4sense.structure.units import find_units

    model = _load(moe_models["qwen3_moe"])
    router = model.model.layers[0].mlp.gate

    def never_expert_7(module, args, output):  # a router that never picks expert 7
        logits, weights, index = output
        return logits, weights, torch.where(index == 7, (index + 1) % 7, index)

    router.register_forward_hook(never_expert_7)
    windows = torch.randint(1, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), progress=False)
    run.base_pass()
    assert set(run.routing) == {"0:mlp.experts", "1:mlp.experts"}
    for counts in run.routing.values():
        assert sum(counts) == 2 * 32 * 2  # every token goes to 2 experts
    assert run.routing["0:mlp.experts"][7] == 0
    unit = units.by_name()["0:mlp.experts"]
    # expert 7 got no token, yet every expert's inputs were seen on all tokens
    gate_max = {run.stats[m]["absmax"] for m in unit.modules if m.endswith("gate_proj")}
    assert len(gate_max) == 1 and gate_max.pop() > 0
    for m in unit.modules:
        assert 0 < run.stats[m]["absmax"] < float("inf"), m


@pytest.mark.slow
def test_analyze_reports_experts_coverage_and_left_alone(moe_models, text_file, tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([FP4SENSE, "analyze", str(moe_models["qwen2_moe"]), "--text",
                           str(text_file), "--schemes", "NVFP4", "--mode", "estimated",
                           "--views", "component,experts", "--analysis-windows", "2",
                           "--tokens", "64", "--out", str(out), "--no-cache", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert set(summary["routing"]) == {"0:mlp.experts", "1:mlp.experts"}
    assert "model.layers.0.mlp.shared_expert_gate" in summary["left_alone"]
    report = json.loads((out / "sensitivity.json").read_text())
    targets = {e["target"] for e in report["entries"] if e["view"] == "component"}
    assert {"mlp.experts", "mlp.experts.*.gate_proj", "mlp.experts.*.down_proj"} <= targets
    experts = {e["target"] for e in report["entries"] if e["view"] == "expert"}
    assert experts == {f"{b}:mlp.experts.{e}" for b in (0, 1) for e in range(8)}
    md = (out / "report.md").read_text()
    assert "### Experts" in md and "tokens routed" in md and "routing.png" in md
    assert "shared-expert gate" in md


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_quantize_writes_every_expert_quantized(family, moe_models, text_file, tmp_path):
    from safetensors import safe_open

    from fp4sense.checkpoint.loading import load_checkpoint

    out = tmp_path / family
    done = subprocess.run([FP4SENSE, "quantize", str(moe_models[family]), "--text",
                           str(text_file), "--budget", "5.0", "--out", str(out), *SMALL],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        stored = set(fh.keys())
    experts = [c for c in plan["choices"] if c["unit"].endswith("mlp.experts")]
    assert len(experts) == 2
    for choice in experts:
        # the one scheme of a fused-MoE layer: every expert linear in one config group
        groups = {g for m in choice["modules"]
                  for g, group in config["config_groups"].items()
                  if any(re.match(t[3:], m) for t in group["targets"])}
        assert len(groups) == 1, choice["unit"]
        for m in choice["modules"]:
            assert f"{m}.weight_scale" in stored, m  # quantized, never left in 16 bits
    assert not any(k.endswith("mlp.gate.weight_scale") for k in stored)  # routers alone
    model, _, _ = load_checkpoint(out)  # loads, every tensor accounted for
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    # one expert's scale missing: eval names the tensor, in one line
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    done = subprocess.run([FP4SENSE, "eval", str(out), "--eval-windows", "1", "--tokens", "32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].endswith(
        "model.layers.1.mlp.experts.3.down_proj has no weight_scale tensor")


def test_stored_expert_names_pair_with_the_linears(moe_models, tmp_path):
    """Mixtral stores each expert as w1/w2/w3 under block_sparse_moe; the linears are
    mlp.experts.N.gate_proj/up_proj/down_proj: paired from the files, and unpairable
    names are one error naming the experts."""
    from safetensors.torch import save_file

    from fp4sense.inputs.moe import ExpertLayoutError, stored_expert_names

    mixtral = _load(moe_models["mixtral"])
    assert stored_expert_names(mixtral, str(moe_models["mixtral"])) == {
        "mlp.experts": ("block_sparse_moe.experts", ("w1", "w2", "w3"))}
    qwen = _load(moe_models["qwen3_moe"])
    assert stored_expert_names(qwen, str(moe_models["qwen3_moe"])) == {}  # same names
    save_file({f"model.layers.0.{lst}.experts.0.{p}.weight": torch.zeros(1)
               for lst in ("block_sparse_moe", "moe_b") for p in ("w1", "w2", "w3")},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ExpertLayoutError, match=r"model\.layers\.0\.mlp\.experts .*"
                       r"cannot pair.*block_sparse_moe\.experts.*moe_b\.experts"):
        stored_expert_names(mixtral, str(tmp_path))
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(1)},
              str(tmp_path / "model.safetensors"))  # 3-D in the files: written as named
    assert stored_expert_names(mixtral, str(tmp_path)) == {}


@pytest.mark.slow
def test_mixtral_quantizes_and_runs_in_vllm(served):
    """Experts stored under other names (Mixtral): the config groups name the linears and
    the stored names, so llm-compressor quantizes every expert, fp4sense's eval loads the
    checkpoint (the family's renamings applied) and vLLM serves it."""
    from safetensors import safe_open

    out, verdict = _written(served, "mixtral")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        stored = {k.rsplit(".", 1)[0] for k in fh.keys() if ".experts." in k}
    assert len(stored) == 2 * 8 * 3
    for module in stored:  # every expert quantized, and in exactly one config group
        assert sum(any(re.match(t[3:], module) for t in g["targets"])
                   for g in config["config_groups"].values()) == 1, module
    # vLLM names Mixtral's experts as the original files do
    assert any(re.match(t[3:], "model.layers.0.block_sparse_moe.experts.0.w1")
               for g in config["config_groups"].values() for t in g["targets"])
    assert json.loads((out / "fp4sense-quantize.json").read_text())["eval"]["kl"] > 0
    assert isinstance(verdict, dict) and verdict["passed"], verdict


def test_a_plan_never_splits_a_fused_moe_layer(moe_models):
    from compressed_tensors.utils import match_name

    from fp4sense.diagnosis import analyze
    from fp4sense.planning.milp import solve

    model = _load(moe_models["qwen3_moe"])
    windows = torch.randint(1, 49152, (2, 32), generator=torch.Generator().manual_seed(0))
    report = analyze(model, windows, schemes=["NVFP4", "FP8_DYNAMIC"], views=["grid"],
                     modes=["estimated"], cache_dir=None, log=lambda msg: None)
    # a pin naming one projection of one expert takes the whole layer with it
    plan = solve(report, budget_bits=6.0, menu=["NVFP4", "FP8_DYNAMIC", "BF16"],
                 pins={r"model\.layers\.0\.mlp\.experts\.3\.down_proj": "FP8_DYNAMIC"},
                 mode="estimated")
    chosen = {c.unit: c for c in plan.choices}
    assert chosen["0:mlp.experts"].scheme == "FP8_DYNAMIC"
    groups = plan.config_groups()
    for unit in ("0:mlp.experts", "1:mlp.experts"):
        c = chosen[unit]
        assert len(c.modules) == 24
        hits = {g for m in c.modules for g, s in groups.items()
                if any(match_name(m, t) for t in s.targets)}
        assert len(hits) <= 1  # one scheme (none: left in 16 bits) for all its experts
        if c.scheme != "BF16":
            assert len(hits) == 1
    # the bits count every expert; a token computes with 2 of 8 of them
    assert chosen["0:mlp.experts"].active == 0.25
    assert chosen["0:self_attn.o_proj"].active == 1.0
    shares = [(c.bits, c.numel * c.active) for c in plan.choices]
    assert plan.active_bits == pytest.approx(sum(b * w for b, w in shares)
                                             / sum(w for _, w in shares))


def test_experts_a_format_cannot_take_are_named(tmp_path, assets):
    import transformers

    from families import COMMON
    from fp4sense.structure.units import find_units

    name, cfg, overrides, _ = MOE_FAMILIES["qwen3_moe"]
    config = getattr(transformers, cfg)(**{**COMMON, **overrides,
                                           "moe_intermediate_size": 40})
    getattr(transformers, name)(config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    transformers.AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(tmp_path / "m")
    unit = find_units(_load(tmp_path / "m")).by_name()["0:mlp.experts"]
    assert unit.why_infeasible("FP8_DYNAMIC") is None
    for scheme, block in (("NVFP4", 16), ("MXFP4", 32)):
        why = unit.why_infeasible(scheme)
        assert why == (f"input dimension 40 is not divisible by {scheme}'s block size "
                       f"{block}"), why


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_an_nvfp4_moe_checkpoint_runs_in_vllm(family, served):
    """vLLM's CPU platform gets fp4sense's NVFP4 fused-MoE experts (the plugin); a plan
    mixing NVFP4 and 16-bit units across attention, experts and shared experts serves."""
    out, verdict = _written(served, family)
    schemes = {c["scheme"] for c in json.loads((out / "plan.json").read_text())["choices"]
               if c["unit"].endswith("mlp.experts")}
    assert schemes & {"NVFP4", "NVFP4_SEARCH"}  # NVFP4 experts (searched scales by default)
    assert isinstance(verdict, dict) and verdict["passed"], verdict


@pytest.mark.slow
def test_fp8_and_mxfp4_experts_run_in_vllm(served):
    """vLLM 0.32's CPU kernels for FP8 and MXFP4 experts need AMX (and its compressed-
    tensors MXFP4 method picks Marlin, a GPU kernel): the plugin's CPU experts serve a
    plan with MXFP4 experts in one block and FP8_DYNAMIC experts in the other, and
    vLLM's log-probabilities agree with the transformers evaluation."""
    out, verdict = _written(served, "mixed")
    chosen = {c["unit"]: c["scheme"]
              for c in json.loads((out / "plan.json").read_text())["choices"]}
    assert chosen["0:mlp.experts"] == "MXFP4" and chosen["1:mlp.experts"] == "FP8_DYNAMIC"
    assert isinstance(verdict, dict), verdict
    assert verdict["passed"] and verdict["mean_abs_diff"] < 0.1, verdict
