"""How the analysis grows with the model: random-weight Llama-family models of growing
size (bf16 files, built from configs), analyzed with ``low_memory`` (one decoder block's
weights at a time, read from the model's files) in both modes; peak RSS and wall time per
billion weights. Baseline in the same run: the largest model loaded whole.

    .venv/bin/python -m bench scaling [--sizes 0.1,0.4,1.5] [--windows 2] [--tokens 128]

Each analysis runs in a fresh process (its own peak RSS). Float32 compute, CPU, no cache.
Results: bench/results/scaling.json and scaling.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, RESULTS, child, command, peak_rss_gib

#: name -> (hidden, intermediate, layers, heads, kv heads); vocab 49152 (SmolLM2's)
SHAPES = {"0.1": (576, 1536, 30, 9, 3), "0.4": (1024, 2816, 32, 16, 4),
          "1.5": (2048, 5632, 30, 32, 4)}


def build(size: str, folder: Path, tokenizer_from: Path) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = SHAPES[size]
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device("meta"):
        numel = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    if not (folder / "config.json").is_file():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
        del model
    return numel


def analysis_child(folder: str, mode: str, low_memory: bool, windows: int, tokens: int) -> dict:
    import torch

    from fp4sense.diagnosis import analyze
    from fp4sense.inputs.models import load_model

    t = time.perf_counter()
    model, _, _ = load_model(folder, low_memory=low_memory)
    ids = torch.randint(0, 49152, (windows, tokens), generator=torch.Generator().manual_seed(0))
    views = ["grid"] if mode == "estimated" else ["component"]
    analyze(model, ids, schemes=["NVFP4"], views=views, modes=[mode], grid_blocks=[],
            progress=False, log=lambda m: None)
    return {"wall_s": round(time.perf_counter() - t, 1), "peak_rss_gib": round(peak_rss_gib(), 3)}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default="0.1,0.4,1.5")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "fp4sense-scaling")
    ap.add_argument("--child", nargs=3, metavar=("FOLDER", "MODE", "LOW_MEMORY"))


def run(args: argparse.Namespace) -> int:
    if args.child:
        folder, mode, low = args.child
        print(json.dumps(analysis_child(folder, mode, low == "1", args.windows, args.tokens)))
        return 0
    from fp4sense.inputs.assets import ensure_model

    tokenizer_from = ensure_model(log=lambda m: None)
    sizes = args.sizes.split(",")
    rows = []

    def measure(size, folder, mode, low, numel):
        out = subprocess.run(child("scaling", "--windows", str(args.windows), "--tokens",
                                   str(args.tokens), "--child", str(folder), mode,
                                   "1" if low else "0"),
                             capture_output=True, text=True, check=True, cwd=REPO)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        row = {"size": size, "params_b": round(numel / 1e9, 3), "mode": mode,
               "low_memory": low, **r, "s_per_b": round(r["wall_s"] / (numel / 1e9), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for size in sizes:
        folder = args.models / f"llama-{size}b"
        numel = build(size, folder, tokenizer_from)
        for mode in ("estimated", "measured"):
            measure(size, folder, mode, True, numel)
    largest = args.models / f"llama-{sizes[-1]}b"
    measure(sizes[-1], largest, "estimated", False, build(sizes[-1], largest, tokenizer_from))
    summary = {"command": command("scaling", args.argv), "windows": args.windows,
               "tokens": args.tokens, "rows": rows}
    for mode in ("estimated", "measured"):
        lean = [r for r in rows if r["mode"] == mode and r["low_memory"]]
        summary[f"{mode}: peak RSS largest / smallest"] = round(
            lean[-1]["peak_rss_gib"] / lean[0]["peak_rss_gib"], 2)
        summary[f"{mode}: seconds per billion weights, largest / smallest"] = round(
            lean[-1]["s_per_b"] / lean[0]["s_per_b"], 2)
    whole = next(r for r in rows if not r["low_memory"])
    lean_est = next(r for r in rows if r["low_memory"] and r["mode"] == "estimated"
                    and r["size"] == sizes[-1])
    summary["largest, estimated: peak RSS whole / low_memory"] = round(
        whole["peak_rss_gib"] / lean_est["peak_rss_gib"], 2)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scaling.json").write_text(json.dumps(summary, indent=1))
    _plot(rows, RESULTS / "scaling.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    return 0


def _plot(rows, path: Path) -> None:
    from fp4sense.reports.plots import pyplot, save_figure

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in ("estimated", "measured"):
        lean = [r for r in rows if r["mode"] == mode and r["low_memory"]]
        x = [r["params_b"] for r in lean]
        a1.plot(x, [r["peak_rss_gib"] for r in lean], marker="o", label=f"{mode}, low memory")
        a2.plot(x, [r["wall_s"] for r in lean], marker="o", label=f"{mode}, low memory")
    for r in rows:
        if not r["low_memory"]:
            a1.scatter([r["params_b"]], [r["peak_rss_gib"]], color="k", marker="x",
                       label="estimated, model loaded whole")
    a1.set_xlabel("parameters (billions)")
    a1.set_ylabel("peak RSS (GiB)")
    a1.set_title("Memory: flat in model size")
    a1.legend(fontsize=8)
    a2.set_xlabel("parameters (billions)")
    a2.set_ylabel("wall time (s)")
    a2.set_title("Time: linear in weights")
    a2.legend(fontsize=8)
    save_figure(fig, path)

