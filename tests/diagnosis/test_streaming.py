"""The analysis at scale on one machine: the streamed (block-by-block) estimate, offloaded
and low-memory blocks read once, memory said and refused before a run, caches shared by
runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import FP4SENSE
from families import FAMILIES, make_family_model
from fp4sense.diagnosis import analyze
from fp4sense.diagnosis.cache import EntryCache
from fp4sense.diagnosis.engine import Analysis
from fp4sense.structure.units import find_units
from helpers import family_model, random_windows


# --- the streamed estimate --------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_estimate_equals_the_in_memory_one(family, tmp_path):
    """Block by block (saved inputs, recomputed forwards, the gradient passed down) gives
    the in-memory backward's scores. Tolerance: equal in float32 up to 1e-6 relative (the
    same operations in the same order; measured: bit-identical on all seven families)."""
    model = family_model(tmp_path / family, family)
    windows = random_windows()
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), False)
    in_memory = run.estimate(["NVFP4", "MXFP4"], streamed=False)
    streamed = run.estimate(["NVFP4", "MXFP4"], streamed=True)
    assert in_memory.keys() == streamed.keys() and in_memory
    for key, values in in_memory.items():
        assert streamed[key] == pytest.approx(values, rel=1e-6, abs=0), key
    assert any(v > 0 for values in in_memory.values() for v in values)


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["qwen3_moe"])
def test_a_measured_run_block_by_block_equals_the_whole_model_forward(family, tmp_path):
    """A measured run takes the blocks one at a time, each for every window, with the
    arguments the base pass recorded for it (masks, rotary embeddings, sliding windows):
    window by window its KL is the one of the whole model run under the same
    perturbation. Measured: bit-identical (float32, the same operations)."""
    from fp4sense.numerics.metrics import window_metrics

    model = family_model(tmp_path / family, family)
    windows = random_windows()
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), False)
    run.base_pass()  # input maxima (NVFP4's activation scale)
    for first in (0, 1):  # from the first block on, and with block 0 replayed
        pert = {m: (u, "NVFP4") for u in units.units if u.block >= first
                and u.why_infeasible("NVFP4") is None for m in u.modules}
        kls = []
        with run.applied(pert), torch.no_grad():
            for i, window in enumerate(windows):
                logits = model(input_ids=window[None]).logits[0].float()
                kls.append(float(window_metrics(run.base_logprobs(i), logits, window)[
                    "kl"].double().mean()))
        result = run.measure(pert)
        assert result["block_forwards"] == len(windows) * (units.n_blocks - first)
        assert result["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-9, abs=0), first
        assert result["kl"] > 0


def test_offloaded_measured_run_reads_each_block_once_and_quantizes_it_once(tmp_path,
                                                                           monkeypatch):
    """Streamed, a measured run reads each block it runs once (not once per window) and
    quantizes each perturbed linear once (alone: its fused group's other linears only
    when they are perturbed too), with a weight cache of one block per scheme; its
    numbers are the in-memory ones."""
    from fp4sense.diagnosis import engine
    from fp4sense.diagnosis.footprint import weight_cache_bytes

    model = family_model(tmp_path / "m", "gemma2")
    windows = random_windows(4)
    units = find_units(model, windows[:1, :16])
    pert = {m: (u, "NVFP4") for u in units.units for m in u.modules}
    reference = Analysis(model, windows, units, EntryCache(None), False).measure(pert)
    run = Analysis(model, windows, units, EntryCache(None), False, tmp_path / "off")
    run.qweight_limit = weight_cache_bytes(units, 1, block_scoped=True)
    run.base_pass()
    loads, calls = [], []
    original_load, quantize_unit = run.store._load, engine.quantize_unit

    def counting_load(i):
        original_load(i)
        loads.append((i, len(run.store.loaded)))

    def counting(scheme, unit, *args, **kwargs):
        calls.append((unit.name, kwargs.get("only")))
        return quantize_unit(scheme, unit, *args, **kwargs)

    run.store._load = counting_load
    monkeypatch.setattr(engine, "quantize_unit", counting)
    try:
        streamed = run.measure(pert)
    finally:
        run.store._load = original_load
        run.store.close()
    assert loads == [(b, 1) for b in range(units.n_blocks)]  # each once, alone
    assert sorted(calls) == sorted((u.name, i) for u in units.units
                                   for i in range(len(u.modules)))  # each linear once
    assert streamed == reference


def test_offloaded_estimate_holds_one_block_and_matches(tmp_path):
    """With blocks offloaded, the estimate streams: at most one block's weights are ever
    loaded, and the scores equal the in-memory estimate's."""
    model = family_model(tmp_path / "m", "qwen3")
    windows = random_windows()
    units = find_units(model, windows[:1, :16])
    reference = Analysis(model, windows, units, EntryCache(None), False).estimate(["NVFP4"])
    run = Analysis(model, windows, units, EntryCache(None), False, tmp_path / "off")
    most = {"loaded": 0}
    original_load = run.store._load

    def counting_load(i):
        original_load(i)
        most["loaded"] = max(most["loaded"], len(run.store.loaded))

    run.store._load = counting_load
    try:
        offloaded = run.estimate(["NVFP4"])
        assert most["loaded"] == 1
    finally:
        run.store.close()
    assert offloaded == reference


def test_offloaded_originals_use_the_loaded_block_and_never_a_perturbed_one(tmp_path):
    """The unquantized weight of a linear whose block is in memory is that block's
    parameter (no second copy read from disk); one loaded with a perturbation, or
    overridden since, is read from the file."""
    model = family_model(tmp_path / "m")
    windows = random_windows()
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), False, tmp_path / "off")
    store, name = run.store, units.units[0].modules[0]
    param = model.get_submodule(name).weight
    try:
        stored = store.tensor(f"{name}.weight")
        store._load(0)
        assert run.original[name].data_ptr() == param.data_ptr()
        store.overrides[f"{name}.weight"] = torch.zeros_like(stored)
        assert torch.equal(run.original[name], stored)
        store._drop(0)
        store._load(0)  # now holding the perturbation
        store.overrides.clear()
        assert not param.any() and torch.equal(run.original[name], stored)
    finally:
        store.overrides.clear()
        store.close()
    assert torch.equal(param, stored)


def test_streamed_weight_cache_holds_one_block_per_scheme_and_never_requantizes(
        tmp_path, monkeypatch):
    """A streamed estimate keeps the fake-quantized weights of one block per scheme (flat
    in depth), below what the whole model would keep, and still quantizes each (unit,
    scheme) once: a block's weights serve all its windows, then make room."""
    from fp4sense.diagnosis import engine
    from fp4sense.diagnosis.footprint import weight_cache_bytes

    model = family_model(tmp_path / "m", "mistral")
    windows = random_windows()
    units = find_units(model, windows[:1, :16])
    schemes = ["NVFP4", "MXFP4"]
    reference = Analysis(model, windows, units, EntryCache(None), False).estimate(schemes)
    run = Analysis(model, windows, units, EntryCache(None), False, tmp_path / "off")
    run.qweight_limit = weight_cache_bytes(units, len(schemes), block_scoped=True)
    assert run.qweight_limit < weight_cache_bytes(units, len(schemes), block_scoped=False)
    calls: dict[tuple, int] = {}
    most = {"bytes": 0}
    quantize_unit = engine.quantize_unit

    def counting(scheme, unit, *args, **kwargs):
        key = (unit.name, scheme, kwargs.get("only"))  # one linear at a time
        calls[key] = calls.get(key, 0) + 1
        most["bytes"] = max(most["bytes"], run.qweight_bytes)
        return quantize_unit(scheme, unit, *args, **kwargs)

    monkeypatch.setattr(engine, "quantize_unit", counting)
    try:
        streamed = run.estimate(schemes)
    finally:
        run.store.close()
    assert streamed == reference
    assert 0 < most["bytes"] <= run.qweight_limit and run.qweight_bytes <= run.qweight_limit
    assert set(calls.values()) == {1}
    assert set(calls) == {(u.name, s, i) for u in units.units for s in schemes
                          if u.why_infeasible(s) is None for i in range(len(u.modules))}


@pytest.mark.parametrize("low_memory", [False, True])
def test_an_analysis_of_several_schemes_quantizes_each_linear_once(low_memory, tmp_path,
                                                                   monkeypatch):
    """Through ``analyze`` (which sizes the weight cache): an estimate of several schemes,
    a searched one among them, in memory or streamed, quantizes each (linear, scheme) once
    over all its windows (a cache of one scheme's worth re-searched at every window)."""
    from fp4sense.diagnosis import engine

    model = family_model(tmp_path / "m", "qwen2")
    schemes = ["NVFP4", "NVFP4_SEARCH", "FP8_DYNAMIC"]
    calls: dict[tuple, int] = {}
    quantize_unit = engine.quantize_unit

    def counting(scheme, unit, *args, **kwargs):
        key = (unit.name, scheme, kwargs.get("only"))  # one linear at a time
        calls[key] = calls.get(key, 0) + 1
        return quantize_unit(scheme, unit, *args, **kwargs)

    monkeypatch.setattr(engine, "quantize_unit", counting)
    analyze(model, random_windows(4), schemes=schemes, views=["grid"], modes=["estimated"],
            offload_dir=tmp_path / "off" if low_memory else None, progress=False,
            log=lambda m: None)
    assert calls and set(calls.values()) == {1}
    assert {s for _, s, _ in calls} == set(schemes)


def test_window_scores_do_not_depend_on_which_windows_run_together(tmp_path):
    """A window's estimate is the same alone or among others (what lets ranks split
    them): its sampling generator is seeded by the window's index."""
    model = family_model(tmp_path / "m")
    windows = random_windows(4)
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), False)
    every = run.estimate(["NVFP4"])
    odd = run.estimate(["NVFP4"], windows=[1, 3])
    for key, values in every.items():
        assert odd[key] == [values[1], values[3]]


def test_streamed_memory_is_said_and_refused_when_it_will_not_fit(tmp_path, monkeypatch):
    model = family_model(tmp_path / "m")
    lines: list[str] = []
    monkeypatch.setenv("FP4SENSE_MEMORY_LIMIT", "1000")
    with pytest.raises(ValueError, match=r"^analysis caches \(streamed estimate 0\.00 GiB, "
                       r"quantized weights 0\.00 GiB; 3 windows x 2 blocks\) needs 0\.00 GiB "
                       r"but 0\.00 GiB are available; lower --analysis-windows or --tokens"):
        analyze(model, random_windows(), schemes=["NVFP4"], views=["grid"], modes=["estimated"],
                offload_dir=tmp_path / "off", progress=False, log=lines.append)
    assert lines and lines[0].startswith("analysis caches (streamed estimate")
    assert all(p.numel() > 0 for p in model.parameters())  # the model got its weights back


_FRAGMENTS = textwrap.dedent('''
    import contextlib, sys, torch
    from fp4sense.runtime.memory import mapped_allocations
    with mapped_allocations():
        pass  # after it, allocations up to 32 MiB come from the heap (glibc's own ceiling)
    with mapped_allocations() if sys.argv[1] != "0" else contextlib.nullcontext():
        if sys.argv[1] == "2":  # nested: an inner use ending keeps the outer one's mapping
            with mapped_allocations():
                pass
        large = [torch.ones(1 << 20) for _ in range(128)]  # 4 MiB tensors
        del large[::2]  # half of them freed, between ones that stay
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                print(int(line.split()[1]) // 1024)
''')


@pytest.mark.skipif(not __import__("fp4sense.runtime.memory", fromlist=["_libc"])._libc(),
                    reason="glibc's allocator only")
def test_freed_large_tensors_leave_memory_when_allocations_are_mapped():
    """What a streamed block's temporaries do: 256 MiB of 4 MiB tensors freed between
    tensors that stay. glibc keeps them resident outside (its heap, as once freed
    tensors have raised its own threshold); inside ``mapped_allocations`` (block loads
    and weight quantization of a streamed analysis) they go, also after a nested use
    (a perturbation quantized while its block loads) has ended."""
    rss = {}
    for mapped in ("0", "1", "2"):
        out = subprocess.run([sys.executable, "-c", _FRAGMENTS, mapped], capture_output=True,
                             text=True, check=True)
        rss[mapped] = int(out.stdout.split()[-1])
    assert rss["0"] - rss["1"] >= 200 and rss["0"] - rss["2"] >= 200, rss  # MiB


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_low_memory_reads_blocks_from_the_model_files(family, assets, tmp_path):
    """``load_model(low_memory=True)`` loads the weights outside the blocks only; each
    block is read from the model's own safetensors files when it runs. Same fingerprint,
    same measured and estimated results as the model loaded whole."""
    from fp4sense.inputs.models import load_model
    from fp4sense.structure.units import model_fingerprint

    path = make_family_model(family, tmp_path / family, tokenizer_from=assets["model"])
    whole, _, _ = load_model(path)
    lean, _, _ = load_model(path, low_memory=True)
    blocks = lean.fp4sense_blocks.blocks
    assert sum(p.numel() for b in blocks for p in b.parameters()) == 0  # none held
    assert model_fingerprint(lean) == model_fingerprint(whole)
    kw = dict(schemes=["NVFP4"], views=["component", "block", "grid"], grid_blocks=[0],
              modes=["measured", "estimated"], progress=False, log=lambda m: None)
    windows = random_windows(2, 48)
    a, b = analyze(whole, windows, **kw), analyze(lean, windows, **kw)
    assert [(e.view, e.target, e.mode, e.kl) for e in a.entries] == \
        [(e.view, e.target, e.mode, e.kl) for e in b.entries]


def test_low_memory_names_a_model_whose_files_use_other_names(assets, tmp_path):
    """Weights stored under names other than the modules' (a conversion on load): one
    line naming the first, and the way out (--offload-dir)."""
    from safetensors.torch import load_file, save_file

    from fp4sense.inputs.models import load_model
    from fp4sense.validate import InputError

    path = make_family_model("llama", tmp_path / "m", tokenizer_from=assets["model"])
    state = load_file(path / "model.safetensors")
    # block 0 as transformers reads it; block 1 under names only a conversion would map
    renamed = {k.replace("model.layers.1.", "model.h.1."): v for k, v in state.items()}
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"cannot be read block by block from its "
                       r"safetensors files: model\.layers\.1\..* is not stored under that "
                       r"name .*; use --offload-dir DIR instead"):
        load_model(path, low_memory=True)



# --- offload folder ---------------------------------------------------------------------
def test_offload_dir_not_empty_or_a_file_is_refused_before_loading(tiny_llama, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for folder, message in ((full, "is not empty (notes.txt)"),
                            (afile, "is an existing file")):
        out = subprocess.run([FP4SENSE, "analyze", str(tiny_llama), "--out",
                              str(tmp_path / "o"), "--offload-dir", str(folder)],
                             capture_output=True, text=True)
        assert out.returncode == 1 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    assert (full / "notes.txt").read_text() == "mine" and afile.read_text() == "mine"


def test_two_runs_appending_to_one_cache_never_tear_a_line(tmp_path):
    """Two processes (two runs sharing a cache, or two ranks) append at once: every line
    is whole, every entry is there."""
    path = tmp_path / "shared.jsonl"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from fp4sense.diagnosis.cache import EntryCache
        cache = EntryCache(Path({str(path)!r}))
        for i in range(300):
            cache.put(f"{{sys.argv[1]}}|{{i}}", {{"kl": i / 7, "pad": "x" * 3000}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, name]) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = path.read_text().splitlines()
    assert len(lines) == 600
    keys = {json.loads(line)["key"] for line in lines}
    assert keys == {f"{n}|{i}" for n in "ab" for i in range(300)}
    assert len(EntryCache(path).items) == 600


def test_streamed_estimate_of_a_model_of_no_known_family():
    """A decoder that is not a transformers model (no config, no ``use_cache``, blocks
    called with the hidden state alone) streams too, with the in-memory scores."""
    from helpers import ToyLM

    model = ToyLM().eval()
    windows = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    run = Analysis(model, windows, find_units(model), EntryCache(None), False)
    assert run.estimate(["NVFP4"], streamed=True) == run.estimate(["NVFP4"], streamed=False)
