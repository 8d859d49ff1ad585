"""How far the trials' held-aside text lets the training estimate's block ranking agree
with them: the loss each block's FP4 forward adds, measured on the evaluation text in
chunks the size of the trials' held-aside set, ranked chunk against chunk.

    .venv/bin/python -m bench training_noise [--windows 4] [--tokens 256] [--trial-steps 4]
        [--seeds 3] [--eval-windows 4] [--chunks 4] [--recipe nvfp4] [--from RESULT]
        [--out bench/results/training_noise.json]

The trials score each arm on ``--eval-windows`` windows (1,024 tokens by default). A
block's FP4 forward moves that loss by about 0.01 nats, and which blocks rank first then
depends on which 1,024 tokens were drawn. Per block, with only its forward GEMMs in FP4
(from the model's own weights, no training): the loss change on each of ``--chunks``
chunks of the evaluation text, the first chunk being the trials' own held-aside windows.
Reports Spearman's rho between chunks (how well one chunk's ranking predicts another's),
of the estimate against the chunks' mean, and of the trials against their own chunk.
The same loss change on the estimate's own text (its calibration windows) says how well
the estimate reproduces an exact measurement where it looked, and how well that text, as
such, predicts the evaluation text.

The estimate and the trials come from analyze-training with the fp4sense cache and the
settings of ``python -m bench training`` (run that first, or the trials run here), or,
with ``--from``, from a result that command wrote (only the forwards run here).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from bench.harness import RESULTS, command


def _two_or_more(value: str) -> int:
    if not value.isdigit() or int(value) < 2:
        raise argparse.ArgumentTypeError(f"{value!r}: at least 2 chunks, to rank one "
                                         "against another")
    return int(value)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--windows", type=int, default=4, help="analysis windows")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--trial-steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-windows", type=int, default=4,
                        help="the trials' held-aside windows: one chunk")
    parser.add_argument("--chunks", type=_two_or_more, default=4,
                        help="chunks of --eval-windows each (at least 2: ranked in pairs)")
    parser.add_argument("--recipe", default="nvfp4")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="take the estimate and the trials by block from this result of "
                        "`python -m bench training` (nothing trained again); its trials' "
                        "held-aside text is the first of its per-window losses' count")
    parser.add_argument("--trials", type=Path, default=None,
                        help="with --from: the trials by block from this result instead "
                        "(e.g. an estimate on more windows scored against earlier trials; "
                        "their training windows may differ, their text is the same split)")
    parser.add_argument("--out", type=Path, default=RESULTS / "training_noise.json")


def _rho(a, b) -> float:
    from scipy.stats import spearmanr

    return round(float(spearmanr(a, b).statistic), 3)


def run(args: argparse.Namespace) -> int:
    import torch

    from fp4sense.api import analyze_training
    from fp4sense.inputs.models import load_model
    from fp4sense.inputs.texts import model_context, protocol_windows
    from fp4sense.numerics.training_linear import apply_training_policy
    from fp4sense.structure.units import find_units, model_name
    from fp4sense.training.estimate import training_units

    t0 = time.perf_counter()
    if args.source is not None:  # a bench training result: its block view, read back
        source = json.loads(args.source.read_text())
        rows, recipe = source["block_view"], source["recipe"]
        if args.trials is not None:
            measured = {r["block"]: r["measured"] for r in json.loads(
                args.trials.read_text())["block_view"]}
            rows = [{**r, "measured": measured[r["block"]]} for r in rows]
        # an estimate-only result has no trials: the figures against them are None
        trial_windows = len(rows[0]["measured"]["per_window"]) if "measured" in rows[0] \
            else None
    else:
        result = analyze_training(None, recipe=args.recipe, modes=("estimated", "measured"),
                                  views=("block",), analysis_windows=args.windows,
                                  window_tokens=args.tokens, eval_windows=args.eval_windows,
                                  seeds=args.seeds, trial_steps=args.trial_steps,
                                  plots=False, progress=False, log=lambda m: None)
        rows, recipe, trial_windows = result["views"]["block"], result["recipe"], \
            args.eval_windows
    model, tokenizer, _ = load_model(None)
    context = model_context(model.config)
    held = protocol_windows(tokenizer, "evaluation", args.chunks * args.eval_windows, None,
                            args.tokens, False, context, print)
    # the estimate's own text: the calibration windows its passes ran on
    own = protocol_windows(tokenizer, "calibration", args.windows, None, args.tokens, False,
                           context, print)
    chunks = [*held.split(args.eval_windows), own]
    model.eval()

    @torch.no_grad()
    def losses(policy) -> list[float]:
        apply_training_policy(model, policy, default="bf16")
        return [sum(float(model(input_ids=w, labels=w).loss) * len(w) for w in c.split(4))
                / len(c) for c in chunks]

    modules: dict[int, list[str]] = {}  # block -> its linears (before any is emulated)
    for u in training_units(find_units(model, own[:1, :16]), model):
        modules.setdefault(u.block, []).extend(u.modules)
    base = losses({})
    forward = {}  # block -> the loss its FP4 forward adds, per chunk (the last: own text)
    for block, names in modules.items():
        forward[block] = [q - b for q, b in zip(losses(
            {m: {"fprop": recipe} for m in names}), base, strict=True)]
        print(f"block {block}: {[round(d, 4) for d in forward[block]]}", flush=True)
    blocks = [r["block"] for r in rows]
    n = args.chunks
    per_chunk = [[forward[b][c] for b in blocks] for c in range(n)]
    mean = [sum(forward[b][:n]) / n for b in blocks]
    on_own = [forward[b][n] for b in blocks]
    estimate = [r["damage"]["total"] for r in rows]
    trial = [r["measured"]["delta"] if "measured" in r else None for r in rows]
    trials = trial_windows is not None
    between = [_rho(per_chunk[i], per_chunk[j]) for i, j in itertools.combinations(range(n), 2)]
    rest = [sum(forward[b][1:n]) / (n - 1) for b in blocks]
    out = {"command": command("training_noise", args.argv), "model": model_name(model, ""),
           "recipe": recipe, "tokens_per_chunk": args.eval_windows * args.tokens,
           "chunks": n, "estimate_tokens": args.windows * args.tokens,
           "trials_tokens": trial_windows * args.tokens if trials else None, "wall_s": round(
               time.perf_counter() - t0, 1),
           "rho_between_chunks": between,
           "rho_between_chunks_mean": round(sum(between) / len(between), 3),
           "rho_trials_chunk_vs_other_chunks": _rho(per_chunk[0], rest),
           "rho_estimate_vs_forward_all_chunks": _rho(estimate, mean),
           "rho_estimate_vs_forward_other_chunks": _rho(estimate, rest),
           "rho_estimate_vs_forward_own_text": _rho(estimate, on_own),
           "rho_forward_own_text_vs_forward_all_chunks": _rho(on_own, mean),
           "rho_estimate_vs_trials": _rho(estimate, trial) if trials else None,
           "rho_trials_vs_forward_trials_chunk": _rho(trial, per_chunk[0]) if trials else None,
           "rho_trials_vs_forward_other_chunks": _rho(trial, rest) if trials else None,
           "rho_trials_vs_forward_own_text": _rho(trial, on_own) if trials else None,
           "blocks": [{"block": b, "estimate": e, "trial": t, "forward": forward[b][:n],
                       "forward_own_text": forward[b][n]}
                      for b, e, t in zip(blocks, estimate, trial, strict=True)]}
    if trials and n * args.eval_windows == trial_windows:  # the chunks: the trials' text
        out["rho_trials_vs_forward_trials_text"] = _rho(trial, mean)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "blocks"}, indent=1))
    return 0
