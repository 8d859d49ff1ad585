"""Trust under attack and accident: no code runs from a file beside the output, one run
owns an output folder, nothing private lies in the folder a user uploads, a checkpoint
that lies is named (SIGTERM: tests/cli/test_cli.py, beside Ctrl-C)."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FP4SENSE, SMALL


class _Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_a_planted_training_state_runs_no_code(tmp_path):
    """A pickle planted as QAD's resume state beside --out is never unpickled: it is named,
    set aside, and the training starts clean; so is a truncated state."""
    from fp4sense.quantization.distill import DistillSettings
    from fp4sense.quantization.qad_loop import STATE_FILE, _load_state

    marker = tmp_path / "payload-ran"
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / STATE_FILE).write_bytes(pickle.dumps({"key": "k", "x": _Payload(marker)}))
    said = []
    assert _load_state(state_dir, "k", DistillSettings(steps=4), said.append) is None
    assert not marker.exists(), "the planted payload ran"
    assert not (state_dir / STATE_FILE).exists()
    assert (state_dir / (STATE_FILE + ".damaged")).is_file()
    assert len(said) == 1 and STATE_FILE in said[0] and "starts from the beginning" in said[0]

    # a state fp4sense wrote itself still resumes; cut short, it is set aside in one line
    st = DistillSettings(steps=4)
    whole = {"key": "k", "settings": __import__("dataclasses").asdict(st), "step": 3,
             "params": [torch.ones(4)], "hist": {"step": [1]}, "best": None,
             "opt": {"state": {}, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999)}]}}
    torch.save(whole, state_dir / STATE_FILE)
    assert _load_state(state_dir, "k", st, said.append)["step"] == 3
    data = (state_dir / STATE_FILE).read_bytes()
    (state_dir / STATE_FILE).write_bytes(data[: len(data) // 2])
    assert _load_state(state_dir, "k", st, said.append) is None and len(said) == 2


def test_a_damaged_gptq_scores_file_is_set_aside(tmp_path):
    from safetensors.torch import save_file

    from fp4sense.quantization.rounded import _readable

    path = tmp_path / "gptq-NVFP4-abc.safetensors"
    save_file({"model.layers.0.mlp.up_proj": torch.randn(64, 64)}, str(path))
    said = []
    assert _readable(path, said.append) and said == []
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert not _readable(path, said.append)
    assert not path.exists() and path.with_name(path.name + ".damaged").is_file()
    assert len(said) == 1 and "rounding again" in said[0]


def _holder(out: Path) -> subprocess.Popen:
    """Another process that has claimed ``out`` (as a running quantize has) and waits."""
    code = ("import sys, time; from pathlib import Path; "
            "from fp4sense.runtime.outputs import claim_output; "
            f"claim_output(Path({str(out)!r})); print('claimed', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    return proc


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_a_second_run_to_the_same_out_stops_at_once(tiny_llama, text_file, tmp_path,
                                                    overwrite):
    """While one run owns --out, a second quantize (with --overwrite too) or analyze to it
    stops before any work in one line naming the running one, and writes nothing."""
    out = tmp_path / "q"
    holder = _holder(out)
    try:
        for argv in (["quantize", str(tiny_llama), "--budget", "5", "--text", str(text_file),
                      *SMALL, "--out", str(out), *(["--overwrite"] if overwrite else [])],
                     ["analyze", str(tiny_llama), "--text", str(text_file), "--out", str(out)]):
            proc = subprocess.run([FP4SENSE, *argv], capture_output=True, text=True)
            assert proc.returncode == 1, proc.stderr[-2000:]
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "being written by another fp4sense run" in lines[0]
            assert f"pid {holder.pid}" in lines[0] and str(out) in lines[0]
            assert "loading" not in proc.stderr.lower()  # stopped before the model loads
            assert not out.exists()
            assert not list(tmp_path.glob(".q.partial-*"))
    finally:
        holder.kill()
        holder.wait()
    # the owner gone, the folder is free again (the lock dies with its process)
    code = ("from pathlib import Path; from fp4sense.runtime.outputs import claim_output; "
            f"claim_output(Path({str(out)!r}))")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_analyze_into_a_checkpoint_folder_is_refused(quantized, tiny_llama, text_file):
    before = (quantized / "sensitivity.json").read_bytes()
    proc = subprocess.run([FP4SENSE, "analyze", str(tiny_llama), "--text", str(text_file),
                           "--out", str(quantized)], capture_output=True, text=True)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "holds a checkpoint" in line and "choose another --out" in line
    assert (quantized / "sensitivity.json").read_bytes() == before


@pytest.mark.slow
def test_the_uploaded_folder_holds_nothing_private(quantized, tiny_llama, text_file):
    """What `hf upload` / `upload_folder` would send (huggingface_hub's own selection): no
    hidden file, no path of this machine; the local record lives in the fp4sense cache."""
    from huggingface_hub.utils import filter_repo_objects
    from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

    from fp4sense.structure.lineage import local_record

    names = [p.relative_to(quantized).as_posix() for p in sorted(quantized.glob("**/*"))
             if p.is_file()]
    sent = list(filter_repo_objects(names, ignore_patterns=DEFAULT_IGNORE_PATTERNS))
    assert sent and not [n for n in sent if any(part.startswith(".") for part in
                                                n.split("/"))], sent
    for name in sent:
        if name.endswith((".json", ".yaml", ".md")):
            text = (quantized / name).read_text()
            for local in (tiny_llama, text_file, quantized, Path.home()):
                assert str(local.resolve()) not in text, (name, local)
    assert local_record(quantized)["base"] == str(tiny_llama.resolve())


def test_push_names_a_path_in_any_text_file(tmp_path):
    """The upload check reads README.md and recipe.yaml for paths of this machine, not only
    JSON files."""
    from fp4sense.publishing.contents import local_paths as _local_paths
    from fp4sense.publishing.hub import HubFile

    real = tmp_path / "models" / "base"
    real.mkdir(parents=True)
    (tmp_path / "README.md").write_text(f"Made from `{real}` on my laptop.\n")
    (tmp_path / "recipe.yaml").write_text(f"plan: {real}/plan.json\nmodel: /no/such/path\n")
    (tmp_path / "config.json").write_text(json.dumps({"a": "/no/such/path"}))
    files = [HubFile(n, 1) for n in ("README.md", "recipe.yaml", "config.json")]
    notes = _local_paths(tmp_path, files)
    assert [n.split()[0] for n in notes] == ["README.md", "recipe.yaml"]
    assert str(real) in notes[0] and str(real) in notes[1]


@pytest.mark.parametrize("pin, said", [("x=FOO", "unknown scheme 'FOO'"),
                                       (".*down_proj=MXFP4", "MXFP4 is not in --menu"),
                                       (".*nothing_here=FP8_DYNAMIC", "matches no unit")],
                         ids=["unknown", "off-menu", "no-unit"])
def test_a_wrong_pin_is_named_before_the_estimate(tiny_llama, text_file, tmp_path, pin, said):
    """A pin to an unknown scheme, or to one the menu does not hold (the estimate would not
    score it), is one line naming --pin, before the model is even loaded; a pin that
    matches none of the model's units, once it is loaded, before the estimate."""
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5", "--menu",
                           "NVFP4,FP8_DYNAMIC,BF16", "--pin", pin, "--text", str(text_file),
                           *SMALL, "--out", str(tmp_path / "q")], capture_output=True,
                          text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("fp4sense: error: --pin ") and said in line, line
    assert "estimat" not in proc.stderr and not (tmp_path / "q").exists()


def _quantize_line(model, text_file, out: Path, *args) -> str:
    """The last stderr line of a quantize that must fail in one line, writing nothing."""
    proc = subprocess.run([FP4SENSE, "quantize", str(model), "--text", str(text_file), *SMALL,
                           "--out", str(out), *args], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert not out.exists()
    return proc.stderr.strip().splitlines()[-1]


def test_a_menu_that_quantizes_nothing_is_named_before_the_estimate(tiny_llama, text_file,
                                                                     tmp_path):
    line = _quantize_line(tiny_llama, text_file, tmp_path / "q", "--menu", "BF16",
                          "--budget", "5")
    assert line.startswith("fp4sense: error: --menu BF16 has no scheme that quantizes"), line
    assert "--schemes" not in line and "--views" not in line  # analyze's flags


def test_a_kl_target_no_quantized_plan_meets_names_the_flag(tiny_llama, text_file, tmp_path):
    line = _quantize_line(tiny_llama, text_file, tmp_path / "q", "--kl-target", "1e-30")
    assert line.startswith("fp4sense: error: --kl-target 1e-30 is met only by leaving every "
                           "unit in BF16"), line
    assert "give a larger --kl-target or a --budget" in line


def test_quantize_low_memory_on_fused_experts_names_a_way_quantize_has(tmp_path, text_file,
                                                                      assets):
    """Experts kept as 3-D parameters cannot be streamed block by block: quantize's line
    says to drop --low-memory (it has no --offload-dir, which analyze's line offers)."""
    from families import make_family_model

    model = make_family_model("qwen3_moe", tmp_path / "moe", tokenizer_from=assets["model"])
    line = _quantize_line(model, text_file, tmp_path / "q", "--budget", "5", "--low-memory")
    assert "3-D parameters" in line and "drop --low-memory" in line, line
    assert "--offload-dir" not in line


def test_a_negative_holdout_is_a_usage_error(tmp_path):
    proc = subprocess.run([FP4SENSE, "quantize", "--budget", "5", "--distill", "4",
                           "--distill-holdout", "-1", "--out", str(tmp_path / "q")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--distill-holdout" in proc.stderr


def test_a_named_serve_python_that_does_not_exist_is_refused(quantized):
    """--serve-python names the interpreter to use: a wrong one is one line, not a silent
    fallback to the project's own serve environment."""
    proc = subprocess.run([FP4SENSE, "verify-vllm", str(quantized), "--serve-python",
                           "/nonexistent/python"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "--serve-python /nonexistent/python: no such file" in line


def test_json_output_is_strict_json(capsys):
    """--json never prints NaN or Infinity (not JSON): non-finite numbers become null."""
    from fp4sense.cli.streams import emit_json

    emit_json({"max_abs_diff": math.inf, "kl": math.nan, "rows": [1.5, -math.inf]})
    assert json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c)) == {
        "max_abs_diff": None, "kl": None, "rows": [1.5, None]}


def test_training_order_is_drawn_as_the_steps_reach_it():
    """A huge --distill no longer builds the whole step order first; the order is the one
    the up-front list gave."""
    from fp4sense.quantization.qad_loop import _Order

    gen = torch.Generator().manual_seed(0)
    before = [int(i) for _ in range(4) for i in torch.randperm(5, generator=gen)]
    order = _Order(torch.Generator().manual_seed(0), 5)
    assert [order[s] for s in range(20)] == before
    huge = _Order(torch.Generator().manual_seed(0), 5)
    assert huge[0] == before[0] and len(huge.drawn) == 5  # one pass drawn, not 10**9 steps


def _lying_copy(quantized: Path, tmp_path: Path, change) -> tuple[Path, str]:
    """A copy of the checkpoint whose config.json's NVFP4 group is changed by ``change``;
    (folder, the group's name)."""
    import shutil

    folder = tmp_path / "lying"
    shutil.copytree(quantized, folder)
    config = json.loads((folder / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    name = next(n for n, g in groups.items() if g.get("format") == "nvfp4-pack-quantized"
                and g.get("input_activations"))
    change(groups[name])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder, name


@pytest.mark.slow
@pytest.mark.parametrize("lie, said", [
    (lambda g: g.pop("input_activations"), "quantizes no input activations"),
    (lambda g: g.update(format="mxfp4-pack-quantized"), "says format mxfp4-pack-quantized"),
    (lambda g: g["weights"].update(group_size=32), "says group size 32"),
    (lambda g: g["weights"].update(num_bits=8), "says 8-bit weights"),
], ids=["acts-dropped", "wrong-format", "group-size", "bits"])
def test_a_config_that_lies_about_its_tensors_is_named(quantized, tmp_path, lie, said):
    """eval (and every command sharing the checker) refuses a config.json whose groups do
    not describe the stored tensors, naming the group and a module, before loading."""
    folder, group = _lying_copy(quantized, tmp_path, lie)
    proc = subprocess.run([FP4SENSE, "eval", str(folder)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert said in line and f"config group {group!r}" in line and "model.layers." in line, line


@pytest.mark.slow
def test_eval_against_another_base_says_so(quantized, tiny_llama, text_file, tmp_path):
    """`eval --base` with a model of the same architecture but other weights: a note
    naming both fingerprints (plan.json records the base's); the right base: none."""
    import shutil

    from conftest import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", seed=1)
    for f in tiny_llama.iterdir():  # the same tokenizer: only the weights differ
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, other / f.name)
    for base, differs in ((tiny_llama, False), (other, True)):
        proc = subprocess.run([FP4SENSE, "eval", str(quantized), "--base", str(base),
                               "--text", str(text_file), "--eval-windows", "1", "--tokens", "64",
                               "--json"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        notes = [n for n in json.loads(proc.stdout)["notes"] if "is not the model" in n]
        assert bool(notes) == differs, notes


def test_a_full_disk_while_safetensors_saves_is_one_line():
    """safetensors reports a full disk with its own error (no OSError): still one line."""
    import argparse
    import contextlib
    import io

    from safetensors import SafetensorError

    from fp4sense.cli import EXIT_USER_ERROR, run_command

    def fills(args):  # the message safetensors' Rust writer gives for ENOSPC
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                              'StorageFull, message: "No space left on device" })')

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_command(fills, argparse.Namespace(json=False))
    assert code == EXIT_USER_ERROR and err.getvalue().count("\n") == 1
    assert "No space left on device" in err.getvalue() and "free space" in err.getvalue()


def test_a_folder_given_as_a_file_is_named(tmp_path):
    from fp4sense.inputs.gguf import GGUFConversionError, convert_gguf
    from fp4sense.inputs.texts import DataError, load_text

    with pytest.raises(DataError, match="is a folder; give one text file"):
        load_text(tmp_path)
    with pytest.raises(GGUFConversionError, match="is a folder; give the .gguf file"):
        convert_gguf(tmp_path, tmp_path / "out")


def test_qad_says_when_it_trains_on_fewer_windows_than_asked():
    from fp4sense.quantization.distill import DistillSettings, _split

    windows = torch.zeros(4, 8, dtype=torch.long)
    said = []
    assert len(_split(windows, DistillSettings(steps=4, windows=2, holdout=1), said.append)) == 3
    assert said == []
    assert len(_split(windows, DistillSettings(steps=4, windows=16, holdout=1),
                      said.append)) == 4
    assert len(said) == 1 and "trains on 3 calibration windows, not the 16 asked" in said[0]


@pytest.mark.slow
def test_a_recipe_run_from_another_folder_names_where_its_plan_is_read(quantized, tiny_llama,
                                                                      tmp_path, monkeypatch):
    """recipe.yaml names plan.json relative to its folder; llm-compressor reads a recipe's
    paths from the folder oneshot runs in. Run elsewhere: one line saying so, and how."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.planning.milp import PlanError
    from helpers import calibration_dataset

    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with pytest.raises(PlanError, match=r"plan 'plan\.json' not found from the current "
                       r"folder .*run it from the folder holding recipe\.yaml and plan\.json"):
        oneshot(model=model, recipe=str(quantized / "recipe.yaml"),
                dataset=calibration_dataset(tiny_llama), num_calibration_samples=2,
                max_seq_length=64)


def test_local_records_of_checkpoints_with_the_same_plan_stay_apart(tmp_path, monkeypatch):
    """Two checkpoints with identical plan.json (the same model quantized from two copies
    of its folder) keep their own base; a renamed folder keeps its record; a copied one
    finds the newest record of its plan whose base is still here."""
    import shutil

    from fp4sense.structure.lineage import local_record, write_local_record

    monkeypatch.setenv("FP4SENSE_CACHE", str(tmp_path / "cache"))
    bases = [tmp_path / "base-a", tmp_path / "base-b"]
    folders = [tmp_path / "ck-a", tmp_path / "ck-b"]
    for base, folder in zip(bases, folders, strict=True):
        base.mkdir()
        folder.mkdir()
        (folder / "plan.json").write_text('{"choices": []}')
        write_local_record(folder, base=base)
    assert [local_record(f)["base"] for f in folders] == [str(b.resolve()) for b in bases]
    moved = tmp_path / "moved"
    folders[0].rename(moved)
    assert local_record(moved)["base"] == str(bases[0].resolve())
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)
    shutil.rmtree(bases[1])  # the newest record's base is gone: the other one is found
    assert local_record(copy)["base"] == str(bases[0].resolve())
