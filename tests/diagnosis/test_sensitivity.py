"""Units, measured and estimated sensitivity, the report file, the cache, `fp4sense analyze`."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from conftest import FP4SENSE
from fp4sense.diagnosis import (
    Entry,
    ReportError,
    SensitivityReport,
    analyze,
    correlations,
)
from fp4sense.diagnosis.cache import EntryCache
from fp4sense.diagnosis.engine import Analysis
from fp4sense.structure.units import UnitError, find_units
from helpers import ToyLM, random_windows


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _tiny_model(config_cls, **kw):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base.update(kw)
    return AutoModelForCausalLM.from_config(config_cls(**base)).eval()


# --- units ---------------------------------------------------------------------------
def test_llama_units_and_fused_groups(tiny):
    units = find_units(tiny)
    assert units.blocks_path == "model.layers" and units.n_blocks == 2
    assert units.kinds == ["self_attn.q_proj+k_proj+v_proj", "self_attn.o_proj",
                           "mlp.gate_proj+up_proj", "mlp.down_proj"]
    assert len(units.units) == 8 and len(units.linears()) == 14
    qkv = units.by_name()["1:self_attn.q_proj+k_proj+v_proj"]
    assert qkv.modules == tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    assert qkv.out_features == (128, 64, 64) and qkv.in_features == 128
    assert units.outside == ["lm_head"]


@pytest.mark.parametrize("family", ["Qwen2", "Mistral", "Gemma", "Qwen3"])
def test_other_families_split_by_structure(family):
    import transformers

    config_cls = getattr(transformers, f"{family}Config")
    extra = {"head_dim": 16} if family in ("Gemma", "Qwen3") else {}
    units = find_units(_tiny_model(config_cls, **extra))
    assert units.n_blocks == 3
    fused = sorted(u.kind for u in units.units if u.fused and u.block == 0)
    assert fused == ["mlp.gate_proj+up_proj", "self_attn.q_proj+k_proj+v_proj"], fused
    assert len(units.units) == 12


def test_a_model_of_no_known_family_is_split_by_structure():
    """Fused groups come from shared inputs, not from names."""
    model = ToyLM().eval()
    units = find_units(model)
    assert units.blocks_path == "trunk" and units.n_blocks == 3
    assert units.kinds == ["to_q+to_k+to_v", "to_out", "ffn.w1+w3", "ffn.w2"]
    assert units.outside == ["head"]
    report = analyze(model, torch.randint(0, 256, (2, 16)), schemes=["NVFP4"],
                     views=["component", "grid"], modes=["measured", "estimated"],
                     cache_dir=None, progress=False, log=lambda m: None)
    assert len(report.table("grid", "NVFP4")) == 12
    assert set(report.table("component", "NVFP4")) == {
        "to_q+to_k+to_v", "to_q", "to_k", "to_v", "to_out", "ffn.w1+w3", "ffn.w1", "ffn.w3",
        "ffn.w2"}


def test_unknown_architecture_says_what_was_looked_for():
    class NotADecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(UnitError, match="nn.ModuleList"):
        find_units(NotADecoder())


def test_units_a_format_cannot_take_are_left_out_and_named():
    from transformers import LlamaConfig

    model = _tiny_model(LlamaConfig, hidden_size=80, intermediate_size=200, head_dim=20)
    report = analyze(model, torch.randint(0, 256, (2, 16)), schemes=["NVFP4", "MXFP4"],
                     views=["component"], cache_dir=None, progress=False, log=lambda m: None)
    reasons = {(s["unit"], s["scheme"]): s["reason"] for s in report.skipped}
    # 80 inputs: NVFP4 (16) fits, MXFP4 (32) does not; down_proj's 200 fits neither
    assert "not divisible by MXFP4's block size 32" in reasons[("0:self_attn.o_proj", "MXFP4")]
    assert ("0:self_attn.o_proj", "NVFP4") not in reasons
    assert ("2:mlp.down_proj", "NVFP4") in reasons
    nv = report.table("component", "NVFP4")
    assert "mlp.down_proj" not in nv and "self_attn.o_proj" in nv


# --- measured: the replay shortcut changes nothing ------------------------------------
def test_replayed_blocks_give_the_same_numbers_as_full_runs(tiny):
    units = find_units(tiny)
    run = Analysis(tiny, random_windows(), units, EntryCache(None), progress=False)
    unit = units.by_name()["1:mlp.gate_proj+up_proj"]
    pert = {m: (unit, "NVFP4") for m in unit.modules}
    fast = run.measure(pert)  # blocks < 1 replayed
    full = run.measure(pert, start=0)
    assert fast["block_forwards"] == 3 * 1 and full["block_forwards"] == 3 * 2
    for key in ("kl", "dppl", "top1"):
        assert fast[key] == pytest.approx(full[key], rel=1e-6, abs=1e-9), key
    assert fast["kl"] > 0


def test_windows_beyond_the_stored_log_probs_measure_the_same(tiny, monkeypatch):
    """Base log-probs are stored up to a memory budget (1 GiB: 10 SmolLM2 windows of 512
    tokens, 4 of Llama-3's); the windows past it are recomputed from the replayed blocks
    inside a measured run. That replay nests in the measured run's own: it used to
    restore the class's forward on exit, and the measured run then failed."""
    import fp4sense.diagnosis.engine as engine

    units = find_units(tiny)
    unit = units.by_name()["1:mlp.gate_proj+up_proj"]
    pert = {m: (unit, "NVFP4") for m in unit.modules}
    stored = Analysis(tiny, random_windows(), units, EntryCache(None), progress=False)
    want = stored.measure(pert)
    one_window = 64 * tiny.config.vocab_size * 4  # float32 log-probs of 64 tokens
    monkeypatch.setattr(engine, "BASE_LOGPROB_BYTES", one_window)
    run = Analysis(tiny, random_windows(), units, EntryCache(None), progress=False)
    run.base_pass()
    assert [lp is None for lp in run.base_lp] == [False, True, True]
    got = run.measure(pert)
    for key in ("kl", "kl_se", "dppl", "top1"):
        assert got[key] == want[key], key
    assert not any("forward" in vars(b) for b in tiny.model.layers)


def test_protect_from_the_quantized_outputs_equals_a_full_run(tiny):
    units = find_units(tiny)
    run = Analysis(tiny, random_windows(), units, EntryCache(None), progress=False)
    everything = {m: (u, "MXFP4") for u in units.units for m in u.modules}
    protect_1 = {m: v for m, v in everything.items() if v[0].block != 1}
    source, whole = run.quantized_outputs("MXFP4", everything)
    fast = run.measure(protect_1, start=1, source=source)
    full = run.measure(protect_1, start=0)
    assert fast["kl"] == pytest.approx(full["kl"], rel=1e-6)
    assert whole["kl"] > 0


def test_weights_are_restored_after_each_perturbation(tiny):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    analyze(tiny, random_windows(2, 32), schemes=["NVFP4", "INT8"], views=["block"],
            cache_dir=None, progress=False, log=lambda m: None)
    after = tiny.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in tiny.modules())
    assert not any("forward" in vars(b) for b in tiny.model.layers)


# --- estimated ------------------------------------------------------------------------
def test_estimates_cover_every_unit_and_scheme(tiny):
    report = analyze(tiny, random_windows(2, 32), schemes=["NVFP4", "MXFP4A16", "INT8"],
                     views=["component", "block", "grid"], modes=["estimated"],
                     cache_dir=None, progress=False, log=lambda m: None)
    for scheme in ("NVFP4", "MXFP4A16", "INT8"):
        grid = report.table("grid", scheme, "estimated")
        assert len(grid) == 8 and all(e.kl > 0 and math.isfinite(e.kl) for e in grid.values())
        # views are sums of their units
        iso = report.table("block_isolate", scheme, "estimated")
        assert iso["0"].kl == pytest.approx(sum(e.kl for t, e in grid.items()
                                                if t.startswith("0:")), rel=1e-9)
    # 8-bit damage is far below 4-bit damage
    assert report.table("model", "INT8", "estimated")["all"].kl < \
        0.2 * report.table("model", "NVFP4", "estimated")["all"].kl


@pytest.mark.slow
def test_estimate_ranks_smollm2_units_like_measurement(assets):
    """On the real model the one-pass estimate orders units as the isolation runs do."""
    from fp4sense.api import analysis_windows, load_model

    model, tok, _ = load_model(None)
    windows = analysis_windows(tok, None, 2, 128)
    report = analyze(model, windows, schemes=["NVFP4"], views=["grid"],
                     modes=["measured", "estimated"], grid_blocks=[0, 11, 29],
                     cache_dir=None, progress=False, log=lambda m: None)
    (corr,) = [c for c in report.correlations if c["view"] == "grid"]
    assert corr["n"] == 12 and corr["spearman"] > 0.6, corr


def test_correlations_rank_measured_against_estimated(tiny):
    """Spearman's rho per view and scheme where both modes exist (ties averaged);
    undefined (nan) for a constant column; views with fewer than 3 targets left out."""
    units = find_units(tiny)
    names = [u.name for u in units.units][:4]

    def report(measured, estimated):
        entries = [Entry("grid", "NVFP4", t, "measured", m, 0.0) for t, m in
                   zip(names, measured, strict=True)]
        entries += [Entry("grid", "NVFP4", t, "estimated", e, 0.0) for t, e in
                    zip(names, estimated, strict=True)]
        return SensitivityReport(model="tiny", model_fingerprint="f" * 16, text={},
                                 schemes=["NVFP4"], units=units, entries=entries,
                                 base_ppl=1.0)

    def rho(measured, estimated):
        (corr,) = correlations(report(measured, estimated))
        assert (corr["view"], corr["scheme"], corr["n"]) == ("grid", "NVFP4", 4)
        return corr["spearman"]

    assert rho([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rho([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rho([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)
    assert math.isnan(rho([1, 1, 1, 1], [1, 2, 3, 4]))
    only_two = report([1, 2, 3, 4], [1, 2, 3, 4])
    only_two.entries = [e for e in only_two.entries if e.target in names[:2]]
    assert correlations(only_two) == []


# --- report file and cache ------------------------------------------------------------
def test_report_round_trip_and_refusals(tiny, tmp_path):
    report = analyze(tiny, random_windows(2, 32), schemes=["NVFP4"], views=["component"],
                     cache_dir=None, progress=False, log=lambda m: None)
    path = report.save(tmp_path / "sensitivity.json")
    again = SensitivityReport.load(path, model_fingerprint=report.model_fingerprint)
    assert again.entries == report.entries and again.units == report.units
    with pytest.raises(ReportError, match="not this one"):
        SensitivityReport.load(path, model_fingerprint="0123456789abcdef")
    d = json.loads(path.read_text())
    d["version"] = 99
    (tmp_path / "old.json").write_text(json.dumps(d))
    with pytest.raises(ReportError, match="version 99"):
        SensitivityReport.load(tmp_path / "old.json")


def test_interrupted_analysis_resumes_where_it_stopped(tiny, tmp_path, monkeypatch):
    windows = random_windows(2, 32)
    kw = dict(schemes=["NVFP4"], views=["block"], cache_dir=tmp_path, progress=False,
              log=lambda m: None)
    calls = {"n": 0}
    real = Analysis.measure

    def dies_after_three(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Analysis, "measure", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        analyze(tiny, windows, **kw)
    monkeypatch.setattr(Analysis, "measure", real)
    resumed = analyze(tiny, windows, **kw)
    # model (1 + capture), isolate 0 and 1 ran before the interruption
    assert resumed.cost["cached_entries"] == 3
    fresh = analyze(tiny, windows, **{**kw, "cache_dir": None})
    assert [e.kl for e in resumed.entries] == pytest.approx([e.kl for e in fresh.entries])
    # other text: nothing reused
    other = analyze(tiny, random_windows(2, 32, seed=1), **kw)
    assert other.cost["cached_entries"] == 0


# --- the command ----------------------------------------------------------------------
def _analyze_cli(*args, cwd=None):
    return subprocess.run([FP4SENSE, "analyze", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


@pytest.mark.slow
def test_cli_writes_report_plots_and_json(tiny_llama, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The state of our union is strong. " * 400)
    out = tmp_path / "analysis"
    proc = _analyze_cli(tiny_llama, "--schemes", "nvfp4,mxfp4", "--views",
                        "component,block,grid", "--mode", "both", "--analysis-windows", "2",
                        "--tokens", "64", "--text", text, "--out", out, "--no-cache")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("sensitivity.json", "report.md", "components.png", "blocks.png", "grid.png"):
        assert (out / name).is_file(), name
    md = (out / "report.md").read_text()
    assert "## Findings" in md and "Spearman" in md and "Activation outliers" in md
    report = SensitivityReport.load(out / "sensitivity.json")
    assert {e.mode for e in report.entries} == {"measured", "estimated"}
    assert report.cost["measured_block_forwards"] < report.cost["naive_block_forwards"]


def test_cli_bad_input_is_one_clear_line(tiny_llama, tmp_path):
    proc = _analyze_cli(tiny_llama, "--schemes", "nvfp3", "--out", tmp_path / "o")
    assert proc.returncode == 1
    assert "unknown scheme 'nvfp3'" in proc.stderr and "MXFP4A16" in proc.stderr
    assert "Traceback" not in proc.stderr

    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    proc = _analyze_cli(tiny_llama, "--text", short, "--analysis-windows", "2", "--tokens", "64",
                        "--out", tmp_path / "o2")
    assert proc.returncode == 1 and "need 128" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

    proc = _analyze_cli(tiny_llama, "--views", "layers", "--out", tmp_path / "o3")
    assert proc.returncode == 1 and "unknown view 'layers'" in proc.stderr


# --- offloaded blocks -------------------------------------------------------------------
def test_offloaded_analysis_equals_in_memory_and_holds_one_block(tiny, tmp_path):
    """With offload_dir only the running block's weights are in memory; the numbers are
    the in-memory ones, and the model gets its weights back."""

    windows = random_windows(2, 32)
    kw = dict(schemes=["NVFP4", "FP8_DYNAMIC"], views=["component", "block", "grid"],
              modes=["measured", "estimated"], cache_dir=None, progress=False,
              log=lambda m: None)
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    in_memory = analyze(tiny, windows, **kw)

    resident = []
    real_measure = Analysis.measure

    def watching(self, *args, **kwargs):
        out = real_measure(self, *args, **kwargs)
        # between runs no block holds weights
        resident.append(sum(p.numel() for p in self.blocks.parameters()))
        return out

    Analysis.measure = watching
    try:
        offloaded = analyze(tiny, windows, offload_dir=tmp_path / "blocks", **kw)
    finally:
        Analysis.measure = real_measure
    assert resident and max(resident) == 0
    assert (tmp_path / "blocks" / "block_1.safetensors").is_file()
    a = {e.key: e for e in in_memory.entries}
    b = {e.key: e for e in offloaded.entries}
    assert a.keys() == b.keys()
    for key in a:
        assert b[key].kl == pytest.approx(a[key].kl, rel=1e-5, abs=1e-9), key
    after = tiny.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_new_view_is_one_registration(tiny):
    """A view registered with its targets is computed when --views names its option, in
    both modes, without touching the engine."""
    from fp4sense.diagnosis.views import REPORT_VIEWS, register_view, view_options

    @register_view("first_block", "first")
    def first_block(units, blocks):
        return [("0", [(u, u.modules) for u in units.of_block(0)])]

    try:
        assert "first" in view_options()
        report = analyze(tiny, random_windows(2, 32), schemes=["NVFP4"], views=["first"],
                         modes=["measured", "estimated"], cache_dir=None, progress=False,
                         log=lambda m: None)
        got = {(e.view, e.target, e.mode) for e in report.entries if e.view != "grid"}
        assert got == {("first_block", "0", "measured"), ("first_block", "0", "estimated")}
        # the same perturbation as the built-in view isolating block 0
        iso = analyze(tiny, random_windows(2, 32), schemes=["NVFP4"], views=["block"],
                      modes=["measured"], cache_dir=None, progress=False, log=lambda m: None)
        assert report.table("first_block", "NVFP4")["0"].kl == \
            iso.table("block_isolate", "NVFP4")["0"].kl
    finally:
        REPORT_VIEWS.pop("first_block")
    assert "first" not in view_options()
