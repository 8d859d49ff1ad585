"""The issue-15 table: per menu, every method (rows) at every budget (columns), merged from
the results of `bench/stack.py`, `bench/gptq_scores.py` and `bench/rotation.py` runs.

Each cell is the KL (16 evaluation windows, per protocol), the bits, where it was measured
(``ckpt``: a checkpoint written by `fp4sense quantize` and read back from disk, bits
measured from its files; ``mem``: in memory, bits from the plan's accounting) and, for
a checkpoint, the wall time of writing it. An empty cell was not run. When one method
and budget appear in several results, a checkpoint wins over an in-memory row, then the
file named first.

    .venv/bin/python -m bench stack_table [RESULT.json ...]

Writes bench/results/stack_table.md; prints it.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.harness import RESULTS, plain_menu

DEFAULT = ["stack.json", "stack_block.json", "stack_block_w4a4.json",
           "gptq_scores_weight_only.json", "gptq_scores_W4A4.json", "stack_rounding.json",
           "stack_rounding_w4a4.json", "stack_rounding_weight_only.json",
           "stack_rounding_weight_only_gptq.json", "stack_block_w4a4_budgets.json",
           "stack_rounding_mx.json", "stack_qad_w4a4_budgets.json",
           "stack_qad_mx_budgets.json", "stack_block_weight_only_budgets.json",
           "stack_qad_weight_only_budgets.json", "stack_block_mx_budgets.json",
           "stack_block_uniform.json", "rotation.json"]
ORDER = ["uniform RTN", "uniform + searched scales", "plan RTN", "plan + searched scales",
         "plan + GPTQ", "plan + GPTQ + QAD", "plan + GPTQ + block QAD", "plan + QAD",
         "uniform + QAD"]


def rows_of(path: Path) -> list[dict]:
    """``path``'s rows with a method name, a column and where they were measured."""
    result = json.loads(path.read_text())
    if isinstance(result["rows"], dict):
        return rotation_rows(result["rows"])
    out = []
    for r in result["rows"]:
        if "scores" in r:  # bench/gptq_scores.py: plans from RTN or after-GPTQ scores
            how = re.sub(r" \(.*?\)", "", r["method"]).split(",")[0]
            method = f"plan ({r['scores']}) + {how}" + (", fp32" if r.get("eval") !=
                                                         "checkpoint" else "")
        else:
            method = r["method"]
        column = "uniform" if r.get("budget") is None else f"{r['budget']:g}"
        out.append({**r, "method": method, "column": column,
                    "eval": r.get("eval", "in memory")})
    return out


def rotation_rows(rows: dict) -> list[dict]:
    """`bench/rotation.py`'s rows (checkpoints), under the menu of their FP4 format: a
    uniform row by its scheme (a plain one is the menu's own ``uniform`` row), a plan row
    under its rotated menu's plain menu (the same FP4 format and activations); a plan that
    rotates no unit (not written) is the plain menu's own row."""
    out = []
    for name, r in rows.items():
        if not r.get("written", True) or r.get("model"):  # a plan that rotates nothing is
            continue  # the plain menu's; another model than SmolLM2 is not in this table
        if "menu" in r:
            menu = plain_menu(r["menu"])
            method = (f"plan + {'GPTQ' if r['gptq'] else 'RTN'}"
                      + (f" + {r['qad']['mode']} QAD" if r.get("qad") else "")
                      + f", rotations ({r['menu']})"
                      + (", after-GPTQ scores" if r.get("gptq_scores") else "")
                      + (f", scores of {Path(r['scores_from']).parent.name}"
                         if r.get("scores_from") else ""))
            column = f"{r['budget']:g}"
        else:
            menu = "W4A4" if r["scheme"].startswith("NVFP4") else "MX"
            plain = r["scheme"] in ("NVFP4", "MXFP4")
            method = ("uniform" if plain else f"uniform {r['scheme']}") + (
                " + GPTQ" if r["gptq"] else " RTN")
            column = "uniform"
        out.append({"menu": menu, "method": method, "column": column, "kl": r["kl"],
                    **({"rotated": r["rotated_units"]} if "menu" in r else {}),
                    "kl_se": r["kl_se"], "bits": r["effective_bits"], "eval": "checkpoint",
                    "wall_s": r["oneshot_s"] if "oneshot_s" in r else r["wall_s"] - r.get(
                        "timings", {}).get("eval_s", 0.0), "source": name})
    return out


def merge(paths: list[Path]) -> dict[str, dict[tuple[str, str], dict]]:
    """menu -> (method, column) -> the row kept."""
    table: dict[str, dict[tuple[str, str], dict]] = {}
    for path in paths:
        for r in rows_of(path):
            cells = table.setdefault(r["menu"], {})
            key = (r["method"], r["column"])
            kept = cells.get(key)
            if kept is None or (kept["eval"] != "checkpoint" and r["eval"] == "checkpoint"):
                cells[key] = r
    return table


def cell(r: dict) -> str:
    where = "ckpt" if r["eval"] == "checkpoint" else "mem"
    wall = f", {r['wall_s']:.0f} s" if r["eval"] == "checkpoint" and r.get("wall_s") else ""
    turned = f", {r['rotated']} rotated" if "rotated" in r else ""
    return f"{r['kl']:.4f}<br>{r['bits']:.3f} b, {where}{wall}{turned}"


def source(path: Path) -> str:
    """A source's name, with its plain NVFP4 oneshot's seconds where it timed one."""
    plain = json.loads(path.read_text()).get("plain_nvfp4_oneshot_s")
    return f"`{path.name}`" + (f" ({plain:.0f} s)" if plain else "")


def markdown(table: dict, paths: list[Path]) -> str:
    lines = ["# Every method at every budget (issue 15's table)", "",
             "`python -m bench stack_table` from " + ", ".join(map(source, paths))
             + ". KL on 16 evaluation windows; `ckpt`: written by `fp4sense quantize`, read "
             "back from disk, bits measured from its files, wall time of writing it; `mem`: "
             "in memory (fp4sense's fake quantization, bit for bit the checkpoint's, bits from "
             "the plan); `fp32`: llm-compressor's oneshot on the float32 model, in memory "
             "(`bench/gptq_scores.py`). Rows with rotations come from `bench/rotation.py` "
             "(a plan row recorded without its timings counts its evaluation, about 60 s, "
             "in the wall time). Empty: not run. Each row's QAD settings (steps, learning "
             "rate, windows) are in its source's Markdown (the same name, `.md`). Wall times "
             "are of the machine each source ran on (all 2-core CPUs, not all alike): the "
             "seconds after a source's name are a plain llm-compressor NVFP4 oneshot (in "
             "bf16) on the same data there, many times longer on a CPU without native bf16 "
             "(AVX2 only), which tells the two kinds apart.", ""]
    for menu, cells in table.items():
        columns = sorted({c for _, c in cells}, key=lambda c: -1.0 if c == "uniform" else
                         float(c))
        methods = sorted({m for m, _ in cells},
                         key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
        lines += [f"## {menu}", "", "| method | " + " | ".join(
            "uniform (4 bits + scales)" if c == "uniform" else f"{c} bits" for c in columns)
            + " |", "|---" * (len(columns) + 1) + "|"]
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(
                cell(cells[(m, c)]) if (m, c) in cells else "" for c in columns) + " |")
        lines.append("")
    return "\n".join(lines)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="*", metavar="RESULT.json",
                        help=f"results to merge (default: {', '.join(DEFAULT)})")


def run(args: argparse.Namespace) -> int:
    names = args.results or DEFAULT
    paths = [p if p.is_file() else RESULTS / p.name for p in map(Path, names)]
    paths = [p for p in paths if p.is_file()]
    text = markdown(merge(paths), paths)
    (RESULTS / "stack_table.md").write_text(text)
    print(text)
    return 0

