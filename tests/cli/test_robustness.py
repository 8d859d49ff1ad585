"""Bad input and faults through every front door: one clear line (exit codes: docs/cli.md),
the culprit named, nothing written or lost, no wrong success.

Tiny random models keep it fast. The cases are counted in docs/reliability.md
(`pytest tests/cli/test_robustness.py --collect-only -q`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FP4SENSE, SMALL, make_tiny_llama
from helpers import one_line

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")


def _run(*args, cwd=None, env=None, exe=FP4SENSE) -> subprocess.CompletedProcess:
    full = None if env is None else {**os.environ, **env}
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=full, timeout=600)


def _one_line(proc: subprocess.CompletedProcess, code: int, *culprits: str) -> None:
    """Exit ``code``, no traceback, and the error line names every culprit."""
    one_line(proc, code, *culprits)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- flags: typed and ranged by the parser (exit 2, the flag named) ----------------------
@pytest.mark.parametrize("args, flag", [
    (["analyze", "--analysis-windows", "0"], "--analysis-windows"),
    (["analyze", "--analysis-windows", "-3"], "--analysis-windows"),
    (["analyze", "--windows", "0"], "--windows"),  # the name before 0.6.0, typed the same
    (["analyze", "--tokens", "0"], "--tokens"),
    (["analyze", "--grid-blocks", "a"], "--grid-blocks"),
    (["analyze", "--schemes", ""], "--schemes"),
    (["analyze", "--views", " "], "--views"),
    (["analyze", "--dataset", ""], "--dataset"),
    (["eval", "ckpt", "--eval-windows", "0"], "--eval-windows"),
    (["quantize", "--budget", "5", "--out", "q", "--calib-windows", "0"], "--calib-windows"),
    (["quantize", "--budget", "5", "--out", "q", "--eval-windows", "-1"], "--eval-windows"),
    (["quantize", "--budget", "nan", "--out", "q"], "--budget"),
    (["quantize", "--budget", "inf", "--out", "q"], "--budget"),
    (["quantize", "--budget", "-4", "--out", "q"], "--budget"),
    (["quantize", "--budget-bytes", "0", "--out", "q"], "--budget-bytes"),
    (["quantize", "--kl-target", "nan", "--out", "q"], "--kl-target"),
    (["quantize", "--budget", "5", "--out", "q", "--menu", ""], "--menu"),
    (["verify-vllm", "ckpt", "--timeout", "0"], "--timeout"),
    (["verify-vllm", "ckpt", "--mean-abs", "-1"], "--mean-abs"),
])
def test_bad_flag_values_are_usage_errors(args, flag, tmp_path):
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"argument {flag}" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_optimum_cli_types_its_flags_the_same_way(tmp_path):
    proc = _run("fp4sense", "analyze", "--analysis-windows", "0", cwd=tmp_path, exe=OPTIMUM_CLI)
    assert proc.returncode == 2 and "argument --analysis-windows" in proc.stderr


def test_python_api_refuses_zero_windows(tiny_llama, text_file):
    from transformers import AutoTokenizer

    from fp4sense.api import analysis_windows
    from fp4sense.inputs.texts import DataError

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(DataError, match="at least 1"):
        analysis_windows(tok, text_file, 0, 64)


# --- the output: never the model, never lost ----------------------------------------------
def test_out_is_the_model_itself(tiny_llama, text_file):
    before = _snapshot(tiny_llama)
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tiny_llama, "--overwrite",
                "--text", text_file, *SMALL)
    _one_line(proc, 1, "--out", "the input")
    assert _snapshot(tiny_llama) == before


def test_out_holding_the_model(tiny_llama, text_file):
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tiny_llama.parent,
                "--overwrite", "--text", text_file, *SMALL)
    _one_line(proc, 1, "--out", "the input")
    assert (tiny_llama / "config.json").is_file()


def test_out_inside_the_model(tiny_llama, text_file):
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tiny_llama / "q",
                "--text", text_file, *SMALL)
    _one_line(proc, 1, "--out", "the input")
    assert not (tiny_llama / "q").exists()


def test_out_is_the_current_folder(tiny_llama, text_file, tmp_path):
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", ".", "--overwrite",
                "--text", text_file, *SMALL, cwd=tmp_path)
    _one_line(proc, 1, "--out .", "current folder")
    assert list(tmp_path.iterdir()) == []


def test_out_is_an_existing_file(tiny_llama, text_file, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for command in (["quantize", tiny_llama, "--budget", "5"], ["analyze", tiny_llama]):
        proc = _run(*command, "--out", tmp_path / "notes.txt", "--text", text_file,
                    "--analysis-windows", "1", "--tokens", "32")
        _one_line(proc, 1, "notes.txt", "existing file")
    assert (tmp_path / "notes.txt").read_text() == "mine" and len(list(tmp_path.iterdir())) == 1


def test_out_under_a_file(tiny_llama, text_file, tmp_path):
    (tmp_path / "f").write_text("x")
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tmp_path / "f" / "q",
                "--text", text_file, *SMALL)
    _one_line(proc, 1, "is a file, not a folder")


def test_unwritable_cache_is_named_before_any_work(tiny_llama, text_file, tmp_path):
    (tmp_path / "file").write_text("x")
    proc = _run("analyze", tiny_llama, "--out", tmp_path / "a", "--text", text_file,
                "--analysis-windows", "1", "--tokens", "32",
                env={"FP4SENSE_CACHE": str(tmp_path / "file")})
    _one_line(proc, 1, "analysis cache", "--no-cache")
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_budget_above_the_menu_never_writes_an_unquantized_checkpoint(tiny_llama, text_file,
                                                                       tmp_path):
    proc = _run("quantize", tiny_llama, "--budget", "17", "--out", tmp_path / "q",
                "--text", text_file, *SMALL)
    _one_line(proc, 1, "every unit in BF16", "below 16.000")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_budget_above_the_menu_without_bf16_plans_at_the_top(tiny_llama, text_file, tmp_path):
    proc = _run("quantize", tiny_llama, "--budget", "12", "--menu", "NVFP4",
                "--no-scale-search", "--out", tmp_path / "q",
                "--text", text_file, *SMALL, "--no-eval", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "above what the menu can use" in proc.stderr
    assert json.loads(proc.stdout)["plan"]["schemes"] == {"NVFP4": 8}  # every unit


# --- leftovers -------------------------------------------------------------------------
@pytest.mark.slow
def test_dead_partial_folders_are_removed_live_or_unknown_ones_named(tiny_llama, text_file,
                                                                     tmp_path):
    import socket

    dead = tmp_path / ".q.partial-dead"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 1000)
    ghost = subprocess.Popen([sys.executable, "-c", "pass"])
    ghost.wait()  # a pid that existed and is gone
    (dead / ".fp4sense-owner").write_text(f"{socket.gethostname()} {ghost.pid}\n")
    live = tmp_path / ".q.partial-live"
    live.mkdir()
    (live / ".fp4sense-owner").write_text(f"{socket.gethostname()} {os.getpid()}\n")
    old = tmp_path / ".q.partial-old"
    old.mkdir()
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tmp_path / "q", "--text",
                text_file, *SMALL, "--no-eval")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not dead.exists() and live.exists() and old.exists()
    assert f"removed {dead}" in proc.stdout and f"{old} is left" in proc.stdout


def test_torn_cache_line_loses_no_later_entry(tmp_path):
    from fp4sense.diagnosis.cache import EntryCache

    path = tmp_path / "c.jsonl"
    cache = EntryCache(path)
    cache.put("a", {"v": 1})
    with path.open("a") as fh:
        fh.write('{"key": "b", "v"')  # a run killed mid-write
    EntryCache(path).put("c", {"v": 3})
    again = EntryCache(path)
    assert again.get("a") == {"key": "a", "v": 1} and again.get("c") == {"key": "c", "v": 3}
    assert again.get("b") is None


def test_disk_errors_are_one_line():
    """A disk that fills mid-run (ENOSPC) ends in one line, not a traceback."""
    import argparse
    import contextlib
    import errno
    import io

    from fp4sense.cli import EXIT_USER_ERROR, run_command

    def fills(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/q/model.safetensors")

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_command(fills, argparse.Namespace(json=False))
    assert code == EXIT_USER_ERROR
    assert err.getvalue().count("\n") == 1 and "model.safetensors" in err.getvalue()
    assert "No space left on device" in err.getvalue()


# --- input models ------------------------------------------------------------------------
def _with_nan(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("command", [
    ["analyze", "--mode", "measured"], ["analyze", "--mode", "estimated"],
    ["quantize", "--budget", "5"],
])
def test_nan_weights_name_the_module(command, tiny_llama, text_file, tmp_path):
    model = _with_nan(tiny_llama, tmp_path / "nan-model")
    proc = _run(command[0], model, *command[1:], "--out", tmp_path / "out", "--text",
                text_file, "--analysis-windows", "1", "--tokens", "32", "--no-cache"
                if command[0] == "analyze" else "--no-eval")
    _one_line(proc, 1, "model.layers.1.mlp.down_proj", "NaN")
    assert not (tmp_path / "out").exists()


def test_truncated_weights_name_the_model(tiny_llama, text_file, tmp_path):
    model = tmp_path / "cut"
    shutil.copytree(tiny_llama, model)
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    proc = _run("analyze", model, "--out", tmp_path / "a", "--text", text_file,
                "--analysis-windows", "1", "--tokens", "32")
    _one_line(proc, 1, str(model), "could not load")
    assert not (tmp_path / "a").exists()


def test_missing_local_model_is_not_called_a_repo_id(tmp_path, text_file):
    proc = _run("analyze", tmp_path / "nowhere" / "model", "--out", tmp_path / "a",
                "--text", text_file)
    _one_line(proc, 1, "nowhere/model", "not found")


def test_an_encoder_is_not_analyzed_as_a_causal_lm(tmp_path, text_file, assets):
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=128)).save_pretrained(
        tmp_path / "bert")
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(tmp_path / "bert")
    proc = _run("analyze", tmp_path / "bert", "--out", tmp_path / "a", "--text", text_file,
                "--analysis-windows", "1", "--tokens", "32")
    _one_line(proc, 1, "bert", "not a complete causal LM", "initialized at random",
              "cls.predictions")
    assert not (tmp_path / "a").exists()


# --- text -----------------------------------------------------------------------------------
def test_non_utf8_text_names_the_file(tiny_llama, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)
    proc = _run("analyze", tiny_llama, "--out", tmp_path / "a", "--text",
                tmp_path / "latin1.txt")
    _one_line(proc, 1, "latin1.txt", "UTF-8")


def test_missing_text_file(tiny_llama, tmp_path):
    proc = _run("analyze", tiny_llama, "--out", tmp_path / "a", "--text", tmp_path / "no.txt")
    _one_line(proc, 1, "no.txt", "not found")


def test_offline_dataset_is_one_line(tiny_llama, tmp_path):
    proc = _run("analyze", tiny_llama, "--out", tmp_path / "a", "--dataset",
                "acme/no-such-dataset", env={"HF_DATASETS_OFFLINE": "1",
                                             "HF_HUB_OFFLINE": "1"})
    _one_line(proc, 1, "acme/no-such-dataset")
    assert not (tmp_path / "a").exists()


def test_grid_blocks_that_do_not_exist(tiny_llama, text_file, tmp_path):
    proc = _run("analyze", tiny_llama, "--views", "grid", "--grid-blocks", "0,7", "--out",
                tmp_path / "a", "--text", text_file, "--analysis-windows", "1", "--tokens", "32",
                "--no-cache")
    _one_line(proc, 1, "grid block(s) 7", "2 decoder blocks")


@pytest.mark.slow
def test_estimated_mode_with_default_views_writes_its_report(tiny_llama, text_file, tmp_path):
    """The crash of 0.3.0: the Formats finding formatted a perplexity change the estimate
    does not have."""
    for exe, prefix in ((FP4SENSE, []), (OPTIMUM_CLI, ["fp4sense"])):
        out = tmp_path / f"a-{Path(exe).name}"
        proc = _run(*prefix, "analyze", tiny_llama, "--mode", "estimated", "--out", out,
                    "--text", text_file, "--analysis-windows", "2", "--tokens", "32", "--no-cache",
                    exe=exe)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = (out / "report.md").read_text()
        assert "**Formats**" in report and "ΔPPL" not in report.split("**Formats**")[1][:200]


# --- saved reports and plans ---------------------------------------------------------------
def _report_with(quantized: Path, dst: Path, edit) -> Path:
    d = json.loads((quantized / "sensitivity.json").read_text())
    edit(d)
    dst.write_text(json.dumps(d))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("edit, culprit", [
    (lambda d: d["entries"][0].update(kl=-0.5), "has KL -0.5"),
    (lambda d: d["entries"][0].update(kl=float("nan")), "has KL nan"),
    (lambda d: d["entries"][0].update(kl="big"), "has KL 'big'"),
    (lambda d: d.pop("units"), "no units"),
    (lambda d: d["entries"][0].pop("kl"), "not a sensitivity report fp4sense can read"),
])
def test_damaged_sensitivity_report(edit, culprit, quantized, tiny_llama, text_file, tmp_path):
    report = _report_with(quantized, tmp_path / "s.json", edit)
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tmp_path / "q", "--text",
                text_file, "--sensitivity", report, *SMALL)
    _one_line(proc, 1, "s.json", culprit)
    assert not (tmp_path / "q").exists()


def test_bad_pin_regex_names_the_pin(tiny_llama, tmp_path):
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", tmp_path / "q", "--pin",
                "layers.(0=BF16")
    _one_line(proc, 1, "--pin 'layers.(0=BF16'", "regular expression")
    assert list(tmp_path.iterdir()) == []


# --- damaged checkpoints: eval, push, verify-vllm name the tensor ------------------------------
def _nvfp4_module(folder: Path) -> str:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as fh:
        return next(k for k in fh.keys() if k.endswith(".weight_global_scale")).rsplit(".", 1)[0]


def _damaged(quantized: Path, dst: Path, how: str) -> tuple[Path, str]:
    from safetensors.torch import load_file, save_file

    shutil.copytree(quantized, dst)
    state = load_file(dst / "model.safetensors")
    module = _nvfp4_module(dst)
    if how == "nan_global_scale":
        state[f"{module}.weight_global_scale"] = torch.tensor([float("nan")])
        culprit = f"{module}.weight_global_scale"
    elif how == "scale_dtype":
        state[f"{module}.weight_scale"] = state[f"{module}.weight_scale"].float()
        culprit = f"{module}.weight_scale is stored as F32"
    else:
        scale = state[f"{module}.weight_scale"]
        state[f"{module}.weight_scale"] = scale[:, : scale.shape[1] // 2].contiguous()
        culprit = f"{module}.weight_scale has shape"
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, culprit


@pytest.mark.slow
@pytest.mark.parametrize("how", ["nan_global_scale", "scale_dtype", "scale_shape"])
def test_damaged_checkpoint_is_named_by_eval_push_and_verify(how, quantized, tmp_path,
                                                             text_file):
    folder, culprit = _damaged(quantized, tmp_path / "bad", how)
    before = _snapshot(folder)
    _one_line(_run("eval", folder, "--text", text_file, "--eval-windows", "1", "--tokens", "32"),
              1, culprit)
    push = _run("push", folder, "--repo-id", "acme/x", "--dry-run")
    assert push.returncode == 1 and culprit in push.stderr and "Traceback" not in push.stderr
    _one_line(_run("verify-vllm", folder, "--eval-windows", "1", "--tokens", "32"), 1, culprit)
    assert _snapshot(folder) == before


@pytest.mark.slow
def test_checkpoint_without_tokenizer(quantized, tmp_path):
    folder = tmp_path / "no-tok"
    shutil.copytree(quantized, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    for command in ("eval", "verify-vllm"):
        _one_line(_run(command, folder, "--eval-windows", "1", "--tokens", "32"), 1,
                  "no tokenizer", "save_pretrained")


def test_verify_vllm_on_a_missing_folder_is_immediate(tmp_path):
    import time

    t = time.perf_counter()
    proc = _run("verify-vllm", tmp_path / "nope", env={"HF_HUB_OFFLINE": "0"})
    _one_line(proc, 1, "nope", "not found")
    assert time.perf_counter() - t < 60  # no Hub retries for a local folder


@pytest.mark.slow
def test_eval_against_another_architecture(quantized, tmp_path, text_file):
    from transformers import AutoTokenizer

    other = make_tiny_llama(tmp_path / "wide", seed=0)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items()
                                    if k not in ("architectures", "transformers_version")})
                     ).save_pretrained(other)
    AutoTokenizer.from_pretrained(quantized).save_pretrained(other)
    proc = _run("eval", quantized, "--base", other, "--text", text_file, "--eval-windows", "1",
                "--tokens", "32")
    _one_line(proc, 1, "num_hidden_layers 3 vs 2", "--base")
