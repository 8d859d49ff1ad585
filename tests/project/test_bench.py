"""The benchmark harness: every experiment runs as ``python -m bench NAME`` (imports,
parses its options, documents how it is run), no ``sys.path`` inserts, the shared menus,
and every published result names a command that still exists."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench import experiments, harness
from bench.__main__ import parser_of

REPO = Path(__file__).resolve().parents[2]

NAMES = experiments()
#: options an experiment requires (everything else has a default)
REQUIRED = {"smollm2_moe": ["OUT"]}


def test_the_experiments_are_the_bench_files():
    files = sorted(p.stem for p in (REPO / "bench").glob("*.py")
                   if p.stem not in ("__init__", "__main__", "harness"))
    assert NAMES == files and len(NAMES) >= 19
    doc = importlib.import_module("bench").__doc__
    listed = re.search(r"Experiments: (.*?)\.\n", doc, re.S).group(1)
    assert [n.strip() for n in listed.split(",")] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_each_experiment_parses_its_options(name):
    module = importlib.import_module(f"bench.{name}")
    assert callable(module.add_args) and callable(module.run)
    assert not hasattr(module, "main"), "run through python -m bench, not a main of its own"
    parser = parser_of(name, module)
    parser.parse_args(REQUIRED.get(name, []))  # its defaults parse (raises if not)
    assert f"python -m bench {name}" in module.__doc__, "its docstring says how to run it"
    source = (REPO / "bench" / f"{name}.py").read_text()
    assert "sys.path" not in source and "__file__, " not in source
    assert "python bench/" not in source


def test_python_m_bench_lists_every_experiment():
    done = subprocess.run([sys.executable, "-m", "bench"], cwd=REPO, capture_output=True,
                          text=True, check=True)
    assert all(re.search(rf"^  {n} ", done.stdout, re.M) for n in NAMES)
    bad = subprocess.run([sys.executable, "-m", "bench", "nope"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no benchmark 'nope'" in bad.stderr


def test_results_name_a_command_that_exists():
    """Each published result's command runs an experiment that is still there (results
    written before the package record ``python bench/NAME.py``, now ``python -m bench
    NAME``)."""
    checked = 0
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        command = json.loads(path.read_text()).get("command")
        if not command:
            continue
        named = [a or b for a, b in re.findall(r"python (?:bench/(\w+)\.py|-m bench (\w+))",
                                                command)]
        assert named or command.startswith("fp4sense "), f"{path.name}: {command}"
        assert set(named) <= set(NAMES), f"{path.name}: {command}"
        checked += 1
    assert checked >= 10


def test_menus_are_defined_once():
    """The menus' scheme lists are spelled in the harness alone."""
    for name in NAMES:
        tree = ast.parse((REPO / "bench" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.List) and node.elts and all(
                    isinstance(e, ast.Constant) for e in node.elts):
                values = [e.value for e in node.elts]
                assert values not in list(harness.MENUS.values()) + list(
                    harness.ROTATED_MENUS.values()), f"{name}: a menu spelled again"
    assert harness.menu("NVFP4") == harness.MENUS["W4A4"]
    assert harness.searched(harness.MENUS["MX"])[0] == "MXFP4_SEARCH"
    assert harness.command("stack", ["--only", "plan + GPTQ"]) == (
        "python -m bench stack --only 'plan + GPTQ'")


def test_resumable_records_skip_a_torn_line(tmp_path):
    done = harness.Done(tmp_path / "rows.jsonl")
    done.keep({"key": "a", "kl": 0.5})
    with (tmp_path / "rows.jsonl").open("a") as fh:
        fh.write('{"key": "b", "kl"')  # a run stopped mid-write
    again = harness.Done(tmp_path / "rows.jsonl")
    assert dict(again) == {"a": {"key": "a", "kl": 0.5}}


def test_rotation_rows_go_under_their_plain_menu():
    """A rotated menu's row is tabled under the plain menu of its FP4 format; a plan that
    rotates nothing (not written) and another model's row stay out of SmolLM2's table."""
    from bench.stack_table import cell, rotation_rows

    assert {n: harness.plain_menu(n) for n in harness.ROTATED_MENUS} == {
        "W4A4+H": "W4A4", "MX+H": "MX", "W4A4+H16s": "W4A4", "MX+H32": "MX"}
    assert all(harness.plain_menu(n) == n for n in harness.MENUS)
    row = {"menu": "MX+H32", "budget": 4.95, "gptq": True, "rotated_units": 3, "kl": 0.2,
           "kl_se": 0.01, "effective_bits": 4.9, "wall_s": 70.0, "timings": {"eval_s": 60.0}}
    rows = {"written": row, "plan only": {**row, "written": False},
            "moe": {**row, "model": "SmolLM2-MoE top-6"}}
    [tabled] = rotation_rows(rows)
    assert (tabled["menu"], tabled["source"], tabled["column"]) == ("MX", "written", "4.95")
    assert tabled["method"] == "plan + GPTQ, rotations (MX+H32)"
    assert tabled["wall_s"] == 10.0 and tabled["rotated"] == 3
    assert cell(tabled) == "0.2000<br>4.900 b, ckpt, 10 s, 3 rotated"


def test_training_ranks_the_estimate_against_the_first_windows_and_bounds_it():
    """bench training's rho by held-aside windows uses each trial's first n windows' mean
    Δ; the ceiling is sqrt(2r / (1 + r)) of the trials' split-half rho r."""
    from bench.training import by_windows, ceiling

    def row(damage, per_window):
        return {"damage": {"total": damage}, "measured": {"per_window": per_window}}

    # on the first 4 windows the trials reverse the estimate; over all 8 they agree
    rows = [row(3.0, [0, 0, 0, 0, 9, 9, 9, 9]), row(2.0, [1, 1, 1, 1, 4, 4, 4, 4]),
            row(1.0, [2, 2, 2, 2, 0, 0, 0, 0])]
    assert by_windows({"block": rows, "gemm": rows[:2]}, 8) == {"block": {4: -1.0, 8: 1.0}}
    assert ceiling({"block": 0.5, "component": -0.2, "gemm": None}) == {
        "block": round((2 / 3) ** 0.5, 3), "component": None, "gemm": None}


def test_training_scores_a_new_estimate_against_the_trials_of_the_same_command():
    """bench training --trials-from takes an earlier result's measured rows into the new
    estimate's views, and refuses one whose trials ran on other windows or seeds."""
    import argparse

    from bench.training import add_args, with_trials

    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--seeds", "3", "--eval-windows", "16"])

    def measured(delta, windows):
        return {"delta": delta, "se": 0.01, "per_window": windows}

    earlier = {"command": "python -m bench training --seeds 3 --eval-windows 16 "
                          "--no-train-trial --out x.json",
               "block_view": [{"block": b, "measured": measured(d, [d, d])}
                              for b, d in ((0, 0.3), (1, 0.1), (2, 0.2))],
               "component_view": [{"kind": "q", "measured": measured(0.1, [0.1, 0.2])}],
               "gemm_view": [{"gemm": g, "measured": measured(d, [d, d])}
                             for g, d in (("fprop", 0.5), ("dgrad", 0.05), ("wgrad", 0.01))]}
    views = {"block": [{"block": b, "damage": {"total": d}} for b, d in ((0, 3), (1, 1), (2, 2))],
             "component": [{"kind": "q", "damage": {"total": 1.0}}],
             "gemm": [{"gemm": g, "damage": d} for g, d in (("fprop", 1), ("dgrad", 0.1),
                                                           ("wgrad", 0.2))]}
    out = with_trials({"views": views}, earlier, args)
    assert out["views"]["block"][0]["measured"]["delta"] == 0.3
    assert out["rank_correlation"] == {"block": 1.0, "gemm": 0.5}  # one component: no rho
    assert out["trial_agreement"] == {"block": 1.0, "gemm": 1.0}
    other = parser.parse_args(["--seeds", "2", "--eval-windows", "16"])
    with pytest.raises(SystemExit, match="other seeds .seeds=3"):
        with_trials({"views": views}, earlier, other)
    views["block"].append({"block": 3, "damage": {"total": 0.5}})
    with pytest.raises(SystemExit, match="no trial of block 3"):
        with_trials({"views": views}, earlier, args)
