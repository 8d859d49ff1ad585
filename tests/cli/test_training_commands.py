"""``fp4sense analyze-training`` and ``train-trial`` from the command line (and
optimum-cli): every file written, the cache resumes, --json, bad input in one line with
nothing lost; a MoE family through the same door."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FP4SENSE
from helpers import one_line

OPTIMUM_CLI = str(Path(sys.executable).parent / "optimum-cli")
SMALL = ["--analysis-windows", "3", "--tokens", "48", "--eval-windows", "2"]


def _run(*args, env=None, exe=FP4SENSE) -> subprocess.CompletedProcess:
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)


@pytest.fixture(scope="module")
def analysis(tiny_llama, text_file, tmp_path_factory):
    """Both modes on the tiny Llama, cached in a cache of its own."""
    out = tmp_path_factory.mktemp("training") / "out"
    cache = out.parent / "cache"
    proc = _run("analyze-training", tiny_llama, "--text", text_file, *SMALL, "--mode", "both",
                "--trial-steps", "2", "--out", out, "--json",
                env={"FP4SENSE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, cache, json.loads(proc.stdout)


@pytest.mark.slow
def test_analyze_training_writes_every_file_and_resumes(analysis, tiny_llama, text_file):
    out, cache, summary = analysis
    from fp4sense.jobs.analyze_training import TRAINING_FILES

    assert sorted(p.name for p in out.iterdir()) == sorted(TRAINING_FILES)
    result = json.loads((out / "training-sensitivity.json").read_text())
    assert {v for v in result["views"]} == {"block", "component", "gemm"}
    assert all("measured" in row for rows in result["views"].values() for row in rows)
    assert set(result["rank_correlation"]) == {"component", "gemm"}  # 2 blocks: too few
    kinds = [r["kind"] for r in result["views"]["component"]]
    assert list(result["forward_stakes"]) == kinds  # each kind's forward cost, measured
    assert "each kind's fprop in FP4 costs" in (out / "report.md").read_text()
    assert "(gemm view): Spearman" in (out / "report.md").read_text()
    assert "trials scored on 96 held-aside tokens" in (out / "report.md").read_text()
    measured = [row["measured"] for rows in result["views"].values() for row in rows]
    assert all(len(m["per_window"]) == 2 and m["se"] >= m["se_seeds"] for m in measured)
    assert set(result["trial_agreement"]) == {"component", "gemm"}  # one window a half
    assert "against the other half" in (out / "report.md").read_text()
    assert summary["findings"] and summary["predicted_damage"] >= 0
    policy = json.loads((out / "training-policy.json").read_text())
    assert policy["nvidia_rule"]["bf16_blocks"] and len(policy["choices"]) == 8
    stored = {p: json.loads(p.read_text()) for p in (cache / "training").glob("*.json")}
    arms = ["bf16", "block:0", "block:1", "gemm:fprop", "gemm:dgrad", "gemm:wgrad",
            *(f"component:{r['kind']}" for r in result["views"]["component"])]
    assert sorted(map(sorted, stored.values())) == [  # the trials keyed by their held text too
        ["estimate-mxfp8-v3", "estimate-v3"], sorted(f"trial:{a}" for a in arms)]
    # a run stopped after some trials resumes: drop two, run again, the same figures
    cache_file, entries = next((p, e) for p, e in stored.items() if "trial:bf16" in e)
    entries.pop("trial:block:1")
    entries.pop("trial:gemm:dgrad")
    cache_file.write_text(json.dumps(entries))
    again = out.parent / "again"
    proc = _run("analyze-training", tiny_llama, "--text", text_file, *SMALL, "--mode", "both",
                "--trial-steps", "2", "--out", again, env={"FP4SENSE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((again / "training-sensitivity.json").read_text())["views"] == \
        result["views"]
    assert "trial:block:1" in json.loads(cache_file.read_text())
    # other held-aside windows: the estimate read back, the trials run anew
    proc = _run("analyze-training", tiny_llama, "--text", text_file, *SMALL[:4],
                "--eval-windows", "1", "--mode", "both", "--views", "gemm", "--trial-steps",
                "2", "--out", out.parent / "third", env={"FP4SENSE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((cache / "training").glob("*.json"))) == 3
    third = json.loads((out.parent / "third" / "training-sensitivity.json").read_text())
    assert third["views"]["gemm"] != result["views"]["gemm"]


@pytest.mark.slow
def test_low_memory_estimates_block_by_block_with_the_same_figures(analysis, tiny_llama,
                                                                  text_file, tmp_path):
    """--low-memory (each block read from the model's files when it runs): the estimate
    and its stakes are the whole model's (computed anew, no cache), so is the policy."""
    out, _, _ = analysis
    proc = _run("analyze-training", tiny_llama, "--text", text_file, *SMALL, "--trial-steps",
                "2", "--low-memory", "--no-cache", "--out", tmp_path / "lean")
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = json.loads((out / "training-sensitivity.json").read_text())
    lean = json.loads((tmp_path / "lean" / "training-sensitivity.json").read_text())
    for key in ("gradient_stakes", "forward_stakes"):
        assert lean[key] == pytest.approx(whole[key], rel=1e-5), key
    for a, b in zip(whole["units"], lean["units"], strict=True):
        assert (a["name"], a["kind"]) == (b["name"], b["kind"])
        for gemm, figures in a["gemms"].items():
            assert b["gemms"][gemm] == pytest.approx(figures, rel=1e-5), (a["name"], gemm)
    policy = json.loads((tmp_path / "lean" / "training-policy.json").read_text())
    assert [(c["unit"], c["gemms"]) for c in policy["choices"]] == [
        (c["unit"], c["gemms"])
        for c in json.loads((out / "training-policy.json").read_text())["choices"]]


@pytest.mark.slow
def test_train_trial_prints_its_arms_on_one_line(analysis, tiny_llama, text_file, tmp_path):
    out, _, _ = analysis
    proc = _run("train-trial", tiny_llama, "--policy", out / "training-policy.json",
                "--steps", "3", "--text", text_file, "--analysis-windows", "4", "--tokens",
                "48", "--eval-windows", "2", "--monitor-every", "2", "--no-cache", "--out",
                tmp_path / "trial", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    arms = json.loads(lines[0])["arms"]
    assert list(arms) == ["bf16", "all-fp4", "nvidia-rule", "policy"]
    assert all(set(a) == {"loss", "se"} and a["loss"] > 0 for a in arms.values())
    trial = json.loads((tmp_path / "trial" / "trial.json").read_text())
    assert trial["differences"].keys() == {"all-fp4", "nvidia-rule", "policy"}
    assert all(d["se_text"] is not None and len(d["per_window"]) == 2
               for d in trial["differences"].values())  # the text drawn counted in the SE
    assert (tmp_path / "trial" / "loss-curves.png").is_file()
    assert "## Stability" in (tmp_path / "trial" / "report.md").read_text()


@pytest.mark.slow
def test_train_trial_stopped_by_ctrl_c_resumes_at_the_next_arm(analysis, tiny_llama,
                                                                 text_file, tmp_path):
    import signal
    import time

    out, _, _ = analysis
    cache = tmp_path / "cache"
    args = [FP4SENSE, "train-trial", str(tiny_llama), "--policy",
            str(out / "training-policy.json"), "--steps", "16", "--text", str(text_file),
            "--analysis-windows", "4", "--tokens", "48", "--eval-windows", "2",
            "--monitor-every", "8", "--out", str(tmp_path / "trial"), "--json"]
    env = {**os.environ, "FP4SENSE_CACHE": str(cache)}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and not list((cache / "training").glob("*.json")):
        time.sleep(0.02)  # the first arm is written when it finishes
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("fp4sense: interrupted")
    assert not (tmp_path / "trial").exists()  # no partial output folder
    stored = next((cache / "training").glob("*.json"))
    entries = json.loads(stored.read_text())
    assert 1 <= len(entries) < 4 and next(iter(entries)).startswith("arm:bf16:")
    entries[next(iter(entries))]["loss"] = 123.0  # read back, not trained again
    stored.write_text(json.dumps(entries))
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["arms"]["bf16"]["loss"] == 123.0
    assert len(json.loads(stored.read_text())) == 4


@pytest.mark.slow
def test_bad_training_input_is_one_line_and_loses_nothing(analysis, tiny_llama, text_file,
                                                          tmp_path):
    out, _, _ = analysis
    proc = _run("analyze-training", tiny_llama, "--bf16-share", "2")
    assert proc.returncode == 2 and "--bf16-share" in proc.stderr
    one_line(_run("analyze-training", tiny_llama, "--views", "block,layers", "--no-cache",
                  "--out", tmp_path / "v"), 1, "--views", "layers")
    one_line(_run("analyze-training", tiny_llama, "--low-memory", "--mode", "both",
                  "--no-cache", "--out", tmp_path / "lm"), 1, "--low-memory", "--mode")
    one_line(_run("analyze-training", tiny_llama, "--text", text_file, *SMALL, "--no-cache",
                  "--step-time-ms", "1e-9", "--out", tmp_path / "t"), 1, "below the least")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "megatron.json").write_text("my own")
    one_line(_run("analyze-training", tiny_llama, "--no-cache", "--out", mine), 1,
             "megatron.json")
    assert (mine / "megatron.json").read_text() == "my own"
    broken = tmp_path / "broken.json"
    broken.write_text('{"recipe": "nvfp4", "choices": [{"unit": "0:x"}]}')
    one_line(_run("train-trial", tiny_llama, "--policy", broken, "--out", tmp_path / "b"), 1,
             str(broken), "analyze-training")
    other = json.loads((out / "training-policy.json").read_text())
    other["choices"][0]["modules"] = ["model.layers.0.attn.wq"]
    (tmp_path / "other.json").write_text(json.dumps(other))
    one_line(_run("train-trial", tiny_llama, "--policy", tmp_path / "other.json", "--text",
                  text_file, "--out", tmp_path / "o"), 1, "model.layers.0.attn.wq")
    assert not (tmp_path / "o").exists() and not (tmp_path / "b").exists()
    assert not (tmp_path / "lm").exists()


@pytest.mark.slow
def test_optimum_cli_and_a_moe_family_through_the_same_door(tiny_llama, text_file, tmp_path):
    from families import make_family_model

    assert _run("fp4sense", "analyze-training", "--help", exe=OPTIMUM_CLI).returncode == 0
    model = make_family_model("qwen3_moe", tmp_path / "moe", tokenizer_from=tiny_llama)
    from fp4sense.api import analyze_training

    result = analyze_training(model, text=text_file, analysis_windows=2, window_tokens=32,
                              seeds=1, cache=False, progress=False, log=lambda m: None)
    kinds = {u["kind"] for u in result["units"]}
    assert "mlp.experts" in kinds  # load_model's per-expert linears: emulated, one unit
    assert result["left_in_bf16"] == ["lm_head"]
    from fp4sense.training.exports import megatron_config

    matchers = megatron_config(result["policy"])["te_precision_config"]["matchers"]
    assert any(".mlp.experts.linear_fc" in m["pattern"] for m in matchers.values())
