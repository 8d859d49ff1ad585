"""Scale: devices and dtypes, the streamed (block-by-block) estimate, offloaded blocks,
memory said before a run, and many ranks under torchrun (gloo on this CPU machine)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import FP4SENSE
from families import FAMILIES, make_family_model
from fp4sense.diagnosis import analyze
from fp4sense.diagnosis.cache import EntryCache
from fp4sense.diagnosis.engine import Analysis
from fp4sense.diagnosis.units import find_units
from fp4sense.runtime import devices


def _model(path: Path, family: str = "llama", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    make_family_model(family, path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _windows(n=3, t=64, seed=0):
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))


# --- the streamed estimate --------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_estimate_equals_the_in_memory_one(family, tmp_path):
    """Block by block (saved inputs, recomputed forwards, the gradient passed down) gives
    the in-memory backward's scores. Tolerance: equal in float32 up to 1e-6 relative (the
    same operations in the same order; measured: bit-identical on all seven families)."""
    model = _model(tmp_path / family, family)
    windows = _windows()
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
    from fp4sense.evaluation.metrics import window_metrics

    model = _model(tmp_path / family, family)
    windows = _windows()
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

    model = _model(tmp_path / "m", "gemma2")
    windows = _windows(4)
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
    model = _model(tmp_path / "m", "qwen3")
    windows = _windows()
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
    model = _model(tmp_path / "m")
    windows = _windows()
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

    model = _model(tmp_path / "m", "mistral")
    windows = _windows()
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

    model = _model(tmp_path / "m", "qwen2")
    schemes = ["NVFP4", "NVFP4_SEARCH", "FP8_DYNAMIC"]
    calls: dict[tuple, int] = {}
    quantize_unit = engine.quantize_unit

    def counting(scheme, unit, *args, **kwargs):
        key = (unit.name, scheme, kwargs.get("only"))  # one linear at a time
        calls[key] = calls.get(key, 0) + 1
        return quantize_unit(scheme, unit, *args, **kwargs)

    monkeypatch.setattr(engine, "quantize_unit", counting)
    analyze(model, _windows(4), schemes=schemes, views=["grid"], modes=["estimated"],
            offload_dir=tmp_path / "off" if low_memory else None, progress=False,
            log=lambda m: None)
    assert calls and set(calls.values()) == {1}
    assert {s for _, s, _ in calls} == set(schemes)


def test_window_scores_do_not_depend_on_which_windows_run_together(tmp_path):
    """A window's estimate is the same alone or among others (what lets ranks split
    them): its sampling generator is seeded by the window's index."""
    model = _model(tmp_path / "m")
    windows = _windows(4)
    units = find_units(model, windows[:1, :16])
    run = Analysis(model, windows, units, EntryCache(None), False)
    every = run.estimate(["NVFP4"])
    odd = run.estimate(["NVFP4"], windows=[1, 3])
    for key, values in every.items():
        assert odd[key] == [values[1], values[3]]


def test_streamed_memory_is_said_and_refused_when_it_will_not_fit(tmp_path, monkeypatch):
    model = _model(tmp_path / "m")
    lines: list[str] = []
    monkeypatch.setenv("FP4SENSE_MEMORY_LIMIT", "1000")
    with pytest.raises(ValueError, match=r"^analysis caches \(streamed estimate 0\.00 GiB, "
                       r"quantized weights 0\.00 GiB; 3 windows x 2 blocks\) needs 0\.00 GiB "
                       r"but 0\.00 GiB are available; lower --windows or --tokens"):
        analyze(model, _windows(), schemes=["NVFP4"], views=["grid"], modes=["estimated"],
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
    from fp4sense.diagnosis.units import model_fingerprint
    from fp4sense.inputs.models import load_model

    path = make_family_model(family, tmp_path / family, tokenizer_from=assets["model"])
    whole, _, _ = load_model(path)
    lean, _, _ = load_model(path, low_memory=True)
    blocks = lean.fp4sense_blocks.blocks
    assert sum(p.numel() for b in blocks for p in b.parameters()) == 0  # none held
    assert model_fingerprint(lean) == model_fingerprint(whole)
    kw = dict(schemes=["NVFP4"], views=["component", "block", "grid"], grid_blocks=[0],
              modes=["measured", "estimated"], progress=False, log=lambda m: None)
    windows = _windows(2, 48)
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


# --- devices and dtypes -----------------------------------------------------------------
def test_dtype_reaches_every_linear_in_both_modes(tmp_path):
    """bfloat16 asked, bfloat16 computed: every linear's weight and input in both modes
    (and the device of each is the analysis device)."""
    model = _model(tmp_path / "m", "llama", torch.bfloat16)
    seen: set = set()

    def check(module, args):
        seen.add((args[0].dtype, module.weight.dtype, args[0].device.type,
                  module.weight.device.type))

    handles = [m.register_forward_pre_hook(check) for m in model.modules()
               if isinstance(m, torch.nn.Linear)]
    try:
        report = analyze(model, _windows(2, 32), schemes=["NVFP4"], views=["component"],
                         modes=["measured", "estimated"], progress=False, log=lambda m: None,
                         device="cpu")
    finally:
        for h in handles:
            h.remove()
    assert seen == {(torch.bfloat16, torch.bfloat16, "cpu", "cpu")}
    assert {e.mode for e in report.entries} == {"measured", "estimated"}


def test_auto_is_the_cpu_in_float32_without_a_gpu_and_the_default_is_the_protocol(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # any machine
    for asked in ("auto", "cpu", None):
        p = devices.resolve(asked)
        assert (p.device, p.dtype) == (torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("asked, message", [
    ("cuda", r"--device cuda: this machine has no CUDA GPU .* use --device cpu \(or auto\)"),
    ("cuda:7", r"--device cuda:7: this machine has no CUDA GPU"),
    ("tpu", r"--device tpu: unknown device; choose auto, cpu, cuda or cuda:N"),
    ("cpu:1", r"--device cpu:1: unknown device"),
])
def test_a_device_this_machine_lacks_is_one_line(asked, message):
    with pytest.raises(devices.DeviceError, match=message):
        devices.resolve(asked)


def test_a_gpu_index_beyond_the_machine_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(devices.DeviceError, match=r"--device cuda:7: this machine has 1 CUDA "
                       r"GPU\(s\) \(cuda:0–cuda:0\); choose one of them"):
        devices.resolve("cuda:7")
    assert devices.resolve("auto").dtype == torch.bfloat16  # a GPU: bf16 by default
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert devices.resolve("cuda").device == torch.device("cuda", 0)


def test_bf16_on_a_cpu_without_native_bf16_says_it_is_slow(monkeypatch):
    notes: list[str] = []
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert devices.resolve("cpu", "bfloat16", log=notes.append).dtype == torch.bfloat16
    assert len(notes) == 1 and "runs several times slower than float32" in notes[0]


def test_cli_refuses_a_missing_gpu_in_one_line(tiny_llama, tmp_path):
    for command in (["analyze", str(tiny_llama), "--out", str(tmp_path / "a")],
                    ["eval", str(tmp_path / "none")]):
        out = subprocess.run([FP4SENSE, *command, "--device", "cuda:1"], capture_output=True,
                             text=True)
        if command[0] == "eval":  # the checkpoint is checked first: a missing one is named
            assert out.returncode == 1
            continue
        assert out.returncode == 1, out.stderr
        assert out.stderr.strip().splitlines() == [
            "fp4sense: error: --device cuda:1: this machine has no CUDA GPU that torch "
            f"{torch.__version__} can use; use --device cpu (or auto)"]
    bad = subprocess.run([FP4SENSE, "analyze", "--device", "gpu0"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--device: 'gpu0': choose auto, cpu, cuda or cuda:N" \
        in bad.stderr


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


# --- ranks ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(script: Path, timeout_s: int) -> list[subprocess.Popen]:
    """``script`` started as ranks 0 and 1 of one gloo group (stderr piped)."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "FP4SENSE_RANK_TIMEOUT": str(timeout_s)}
    return [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r),
                                                                 "LOCAL_RANK": str(r)},
                             stderr=subprocess.PIPE, text=True) for r in (0, 1)]


def _analyze(tiny_llama, text_file, out: Path, ranks: int, env: dict, extra=()):
    args = ["analyze", str(tiny_llama), "--text", str(text_file), "--windows", "4",
            "--tokens", "64", "--mode", "both", "--views", "component,block,grid",
            "--schemes", "NVFP4,MXFP4", "--out", str(out), "--no-plots", *extra]
    if ranks == 1:
        cmd = [FP4SENSE, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={_free_port()}", "-m", "fp4sense", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "sensitivity.json").read_text())


def _same_results(a: dict, b: dict) -> None:
    for key in ("entries", "base_ppl", "activation_stats", "correlations", "units",
                "model_fingerprint"):
        assert a[key] == b[key], key


def test_two_ranks_equal_one_rank_and_share_the_cache(tiny_llama, text_file, tmp_path):
    """torchrun with 2 ranks (gloo) gives the 1-rank report entry for entry; both ranks
    append to one cache without tearing a line, and a later 1-rank run resumes from it."""
    env = {**os.environ, "FP4SENSE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    one = _analyze(tiny_llama, text_file, tmp_path / "one", 1, env, ["--no-cache"])
    two = _analyze(tiny_llama, text_file, tmp_path / "two", 2, env)
    _same_results(one, two)
    lines = [json.loads(line) for f in (tmp_path / "cache" / "analysis").glob("*.jsonl")
             for line in f.read_text().splitlines()]
    keys = [item["key"] for item in lines]
    assert len(keys) == len(set(keys))  # each entry written once, by the rank that ran it
    measured = sum(1 for e in two["entries"] if e["mode"] == "measured")
    assert sum(k.startswith("measured|") for k in keys) == measured
    again = _analyze(tiny_llama, text_file, tmp_path / "again", 1, env)
    _same_results(one, again)
    assert again["cost"]["cached_entries"] == measured + 1  # + the estimate
    assert not list((tmp_path / "two").glob("*rank*"))  # rank 0 alone wrote the output


def test_a_rank_that_dies_stops_the_others_in_one_line(tmp_path):
    """A peer gone before the results meet: the waiting rank stops with one line naming
    what happened (not a hang, not a traceback)."""
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch
        from fp4sense.runtime import distributed
        distributed.init_from_env(torch.device("cpu"))
        if distributed.rank() == 1:
            os._exit(3)
        try:
            distributed.gather({"rank": 0})
        except distributed.RankError as exc:
            print(f"fp4sense: error: {exc}", file=sys.stderr)
            distributed.leave(1)  # how the CLI ends after it
        sys.exit(0)
    """))
    procs = _two_ranks(script, timeout_s=20)
    err0 = procs[0].communicate(timeout=60)[1]
    procs[1].wait(timeout=60)
    assert procs[1].returncode == 3
    assert procs[0].returncode == 1, err0
    lines = [line for line in err0.strip().splitlines() if line.startswith("fp4sense:")]
    assert len(lines) == 1 and "another rank stopped before the results met" in lines[0]


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_leaves_the_survivor_s_one_line(tiny_llama, assets,
                                                                     tmp_path):
    """``torchrun ... -m fp4sense analyze`` with rank 1 killed (SIGKILL) mid-measurement:
    torchrun stops rank 0 (SIGTERM), whose one line says why before torchrun's report;
    no traceback of fp4sense's, and no output folder."""
    import signal
    import time

    env = {**os.environ, "FP4SENSE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    err = tmp_path / "stderr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={_free_port()}", "-m", "fp4sense", "analyze", str(tiny_llama),
           "--text", str(assets["calibration"]), "--windows", "16", "--tokens", "512",
           "--no-plots", "--out", str(tmp_path / "a")]
    with err.open("w") as stream:
        launcher = subprocess.Popen(cmd, stderr=stream, stdout=subprocess.DEVNULL, env=env)
        try:
            deadline = time.monotonic() + 300
            while "measuring" not in err.read_text() and launcher.poll() is None:
                assert time.monotonic() < deadline, err.read_text()[-2000:]
                time.sleep(0.2)
            ranks = {}
            for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], text=True,
                                      capture_output=True).stdout.split():
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                ranks.update({int(e[5:]): int(pid) for e in environ if e.startswith(b"RANK=")})
            os.kill(ranks[1], signal.SIGKILL)
            launcher.wait(timeout=120)
        finally:
            launcher.kill()
    text = err.read_text()
    assert launcher.returncode != 0
    ours = [line for line in text.splitlines() if line.startswith("fp4sense:")]
    assert len(ours) == 1, text[-3000:]
    assert ("torchrun stops every rank when one fails" in ours[0]
            or "another rank stopped" in ours[0]), ours[0]
    assert text.index(ours[0]) < text.index("ChildFailedError")  # before torchrun's report
    assert not any("site-packages/fp4sense" in line or "src/fp4sense" in line
                   for line in text.splitlines() if line.lstrip().startswith("File "))
    assert not (tmp_path / "a").exists()


def _quantize(tiny_llama, text_file, out: Path, ranks: int, env: dict, *extra: str) -> str:
    from conftest import SMALL

    args = ["quantize", str(tiny_llama), "--budget", "5.5", "--out", str(out), "--text",
            str(text_file), *SMALL, "--no-eval", "--no-scale-search", *extra]
    cmd = [FP4SENSE, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
        f"--master-port={_free_port()}", "-m", "fp4sense", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_quantize_under_two_ranks_writes_the_one_rank_checkpoint(tiny_llama, text_file,
                                                                 tmp_path):
    """``torchrun --nproc-per-node 2 -m fp4sense quantize`` (gloo): the ranks share the
    estimate, rank 0 plans, then goes on alone (oneshot, folder); the other rank ends
    quietly. Same plan and the 1-rank checkpoint bit for bit (W4A4 NVFP4 units: input
    global scales from every calibration window). Without searched scales: their
    importance sums follow llm-compressor's unseeded calibration order, so they may
    differ in the last bit between any two runs."""
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _quantize(tiny_llama, text_file, tmp_path / "one", 1, env)
    said = _quantize(tiny_llama, text_file, tmp_path / "two", 2, env)
    assert [ln for ln in said.splitlines() if ln.startswith("checkpoint")] == [
        f"checkpoint        {tmp_path / 'two'}"]  # rank 0 alone speaks
    plans = [json.loads((tmp_path / n / "plan.json").read_text()) for n in ("one", "two")]
    assert [(c["unit"], c["scheme"]) for c in plans[0]["choices"]] == \
        [(c["unit"], c["scheme"]) for c in plans[1]["choices"]]
    assert "NVFP4" in {c["scheme"] for c in plans[0]["choices"]}  # W4A4 is exercised
    one, two = (load_file(tmp_path / n / "model.safetensors") for n in ("one", "two"))
    assert one.keys() == two.keys() and any(k.endswith("input_global_scale") for k in one)
    def bits(t: torch.Tensor) -> torch.Tensor:  # FP8 / packed FP4 compared as bytes
        return t.view(torch.uint8) if t.dtype.itemsize == 1 else t

    for key in one:
        assert torch.equal(bits(one[key]), bits(two[key])), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # nothing else


@pytest.mark.slow
def test_gptq_scores_under_two_ranks_and_low_memory_score_what_one_rank_scores(
        tiny_llama, text_file, tmp_path):
    """``quantize --gptq --gptq-scores`` under torchrun with --low-memory: rank 0 rounds
    with GPTQ, both ranks' estimate reads its files (streamed block by block): the scores
    and the plan of one rank with the whole model in memory, entry for entry."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = ("--gptq", "--gptq-scores", "--menu", "NVFP4A16,FP8_DYNAMIC,BF16")
    _quantize(tiny_llama, text_file, tmp_path / "one", 1, env, *extra)
    _quantize(tiny_llama, text_file, tmp_path / "two", 2, env, *extra, "--low-memory")
    one, two = (json.loads((tmp_path / n / "sensitivity.json").read_text())
                for n in ("one", "two"))
    assert one["text"]["quantized_weights"].startswith("GPTQ")
    assert one["entries"] == two["entries"] and one["entries"]
    plans = [json.loads((tmp_path / n / "plan.json").read_text()) for n in ("one", "two")]
    assert plans[0]["choices"] == plans[1]["choices"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # rounding gone


def test_rank_0_failing_on_its_own_stops_the_others_in_one_line(tmp_path):
    """Work only rank 0 does (planning, the work folder): its error reaches the waiting
    rank at once as one line naming what rank 0 was doing."""
    script = tmp_path / "plan.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        from fp4sense.runtime import distributed
        distributed.init_from_env(torch.device("cpu"))
        def plan():
            raise ValueError("the budget is below the menu")
        try:
            distributed.on_main(plan, "planning")
        except Exception as exc:
            print(f"fp4sense: error: {exc}", file=sys.stderr)
            distributed.leave(1)
            sys.exit(1)
    """))
    procs = _two_ranks(script, timeout_s=30)
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert errs[0].strip() == "fp4sense: error: the budget is below the menu"
    assert errs[1].strip() == ("fp4sense: error: rank 1: rank 0 stopped while planning "
                               "(ValueError: the budget is below the menu)")


def test_quantize_low_memory_plans_what_the_whole_model_plans(quantized, tiny_llama, text_file,
                                                              tmp_path):
    """``quantize --low-memory`` estimates block by block from the model's files: the
    same sensitivity and the same plan as the model loaded whole (the session fixture)."""
    from conftest import SMALL

    out = tmp_path / "lean"
    done = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5.5", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--low-memory",
                           "--no-eval", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    whole = json.loads((quantized / "plan.json").read_text())
    lean = json.loads((out / "plan.json").read_text())
    assert [(c["unit"], c["scheme"], c["damage"]) for c in lean["choices"]] == \
        [(c["unit"], c["scheme"], c["damage"]) for c in whole["choices"]]
    a = json.loads((quantized / "sensitivity.json").read_text())["entries"]
    b = json.loads((out / "sensitivity.json").read_text())["entries"]
    assert a == b


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
