"""Many ranks under torchrun (gloo on this CPU machine): two ranks give the one-rank
report and checkpoint, a rank that dies or is killed stops the others in one line."""

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
    args = ["analyze", str(tiny_llama), "--text", str(text_file), "--analysis-windows", "4",
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
           "--text", str(assets["calibration"]), "--analysis-windows", "16", "--tokens", "512",
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


@pytest.mark.slow
def test_two_ranks_share_the_training_trials(tiny_llama, text_file, tmp_path):
    """analyze-training under torchrun: the ranks share the trial arms and rank 0 writes
    the one-rank figures (the same arms, data order and seeds, run on another rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["analyze-training", str(tiny_llama), "--text", str(text_file),
            "--analysis-windows", "3", "--tokens", "48", "--eval-windows", "2", "--mode",
            "both", "--views", "block,gemm", "--trial-steps", "2", "--no-cache",
            "--no-plots"]
    outs = {}
    for ranks in (1, 2):
        out = tmp_path / f"r{ranks}"
        cmd = ([FP4SENSE] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            f"--master-port={_free_port()}", "-m", "fp4sense"]) + args + ["--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outs[ranks] = json.loads((out / "training-sensitivity.json").read_text())
    for view in ("block", "gemm"):
        one = [r["measured"]["delta"] for r in outs[1]["views"][view]]
        two = [r["measured"]["delta"] for r in outs[2]["views"][view]]
        assert two == pytest.approx(one, abs=2e-4), view  # 1 thread vs 2: summation order
