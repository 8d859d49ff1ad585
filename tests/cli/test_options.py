"""Every option defined once: each front door's names and defaults for QAD come from
:class:`fp4sense.quantization.distill_settings.DistillSettings`, and a test fails when one
differs (the command line, optimum-cli's reuse of it, the YAML modifier, the API); the
command line passes the API functions' own defaults; quantize's staged run takes exactly
its front door's keywords."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from fp4sense.quantization.distill_settings import DistillSettings, cli_options


def _defaults() -> dict:
    return {f.name: f.default for f in fields(DistillSettings) if f.name != "steps"}


def test_the_command_line_takes_qad_defaults_from_the_definition():
    from fp4sense.cli.commands import build_parser

    parser = build_parser()
    args = parser.parse_args(["quantize", "--budget", "5", "--out", "x", "--distill", "3"])
    quantize = parser._subparsers._group_actions[0].choices["quantize"]
    shown = " ".join(quantize.format_help().split())
    for name, (flag, default, help_) in cli_options().items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        assert value == (3 if name == "steps" else default), name
        assert " ".join(help_.split()) in shown, name  # the help is the definition's
    from fp4sense.cli.commands import _distill_settings

    settings = _distill_settings(args)
    assert settings == DistillSettings(steps=3)  # the flags' defaults are the API's


def test_the_yaml_modifier_takes_qad_defaults_from_the_definition():
    code = ("import json; from fp4sense_llmcompressor.distill import "
            "QuantizationAwareDistillationModifier as M; m = M(steps=3); "
            "print(json.dumps({k: getattr(m, k) for k in " + repr(sorted(_defaults())) + "}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    import json

    assert json.loads(out.strip().splitlines()[-1]) == _defaults()


def test_holdout_is_four_everywhere():
    """The drift that started this: --distill-holdout was 4, the API's and the YAML
    modifier's holdout 0, so the same step count trained differently."""
    assert DistillSettings(steps=1).holdout == 4 == cli_options()["holdout"][1]


def _signature_defaults(fn) -> dict:
    import inspect

    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


class _Called(Exception):
    pass


@pytest.mark.parametrize("argv,function,given", [
    (["quantize", "--budget", "5", "--out", "x"], "quantize_model",
     {"out_dir": Path("x"), "budget_bits": 5.0}),
    # the command writes its report folder; the function returns the report
    (["analyze"], "analyze_model", {"out_dir": Path("fp4sense-analysis")}),
    (["eval", "ckpt"], "evaluate_checkpoint", {}),
])
def test_the_command_line_passes_the_apis_defaults(argv, function, given, monkeypatch):
    """A command with no optional flag calls its API function with every keyword at the
    function's own default (windows, tokens, menu, search, selection, ...): the signature
    is the one definition, and a flag whose default drifts fails here. ``log`` and
    ``progress`` follow ``--json``; what the command names itself is in ``given``."""
    import inspect

    from fp4sense import api
    from fp4sense.cli import commands

    real = getattr(api, function)
    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs, positional=args)
        raise _Called

    monkeypatch.setattr(api, function, capture)
    monkeypatch.chdir(Path(__file__).parent)  # analyze's default --out is not written
    args = commands.build_parser().parse_args(argv)
    with pytest.raises(_Called):
        args.func(args)
    bound = inspect.signature(real).bind_partial(*seen.pop("positional"))
    seen.update(bound.arguments)
    for name, p in inspect.signature(real).parameters.items():
        if name in given or name == "log" or p.default is inspect.Parameter.empty:
            continue
        value, default = seen[name], p.default
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        assert value == default, (f"{function}({name}=...): the command line passes "
                                  f"{value!r}, the API's default is {default!r}")
    for name, value in given.items():
        assert seen[name] == value


def test_the_staged_run_takes_exactly_the_front_doors_keywords():
    """quantize_model's flat signature and QuantizeRequest.parse name the same keywords:
    a keyword added to one and not the other fails here, not in a user's run."""
    import inspect

    from fp4sense.jobs.quantize import quantize_model
    from fp4sense.jobs.quantize_request import QuantizeRequest

    flat = list(inspect.signature(quantize_model).parameters)
    parsed = list(inspect.signature(QuantizeRequest.parse).parameters)
    assert flat == parsed


def test_a_quantize_result_reads_as_its_json():
    from fp4sense.jobs.quantize_run import QuantizeResult

    result = QuantizeResult("out", {"schemes": {}}, None, {"total_s": 1.0})
    assert dict(result) == result.to_dict() == {"plan": {"schemes": {}},
                                                "timings": {"total_s": 1.0}, "out": "out"}
    assert "eval" not in result and result.get("eval") is None and result["out"] == "out"
    other = QuantizeResult("out", rank=1)
    assert "rank" in other and other.to_dict() == {"out": "out", "rank": 1}


#: quantize's keywords the YAML plan modifier also takes (its name for it)
MODIFIER_FIELDS = {"budget_bits": "budget_bits", "budget_bytes": "budget_bytes",
                   "kl_target": "kl_target", "menu": "menu", "sensitivity": "sensitivity",
                   "sensitivity_mode": "sensitivity_mode", "pins": "pins",
                   "analysis_windows": "analysis_windows", "scale_search": "scale_search"}


def test_the_yaml_plan_modifier_takes_quantizes_defaults():
    """SensitivityGuidedModifier (recipe.yaml) plans as quantize does when a field is not
    given: its defaults are quantize_model's (a pydantic model keeps lists and dicts, so
    the menu compares as a list and "no pins" is {} against None)."""
    from fp4sense import defaults
    from fp4sense.api import quantize_model

    code = ("import json; from fp4sense_llmcompressor.modifier import "
            "SensitivityGuidedModifier as M; m = M(budget_bits=5.0); "
            "print(json.dumps({k: getattr(m, k) for k in "
            + repr(sorted(MODIFIER_FIELDS.values())) + "}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    import json

    got = json.loads(out.strip().splitlines()[-1])
    api = _signature_defaults(quantize_model)
    for keyword, field in MODIFIER_FIELDS.items():
        want = api[keyword]
        if keyword == "budget_bits":
            want = 5.0  # given: the modifier needs one objective
        elif keyword == "menu":
            want = list(want)
        elif keyword == "pins":
            want = want or {}
        assert got[field] == want, keyword
    assert tuple(got["menu"]) == defaults.MENU
    assert got["analysis_windows"] == defaults.ANALYSIS_WINDOWS


def test_the_yaml_modifier_and_the_command_line_resolve_the_same_menu():
    """Not only the defaults: the menu each door plans from, resolved by its own code
    path (quantize's Objective, the modifier's field), is the same, with the searched-scale
    twins; without scale search, neither adds them."""
    import json

    from fp4sense import defaults
    from fp4sense.jobs.quantize_request import Objective

    def modifier(**fields) -> list[str]:
        code = ("import json; from fp4sense_llmcompressor.modifier import "
                f"SensitivityGuidedModifier as M; m = M(budget_bits=5.0, **{fields!r}); "
                "print(json.dumps(m.resolved_menu))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    def command_line(scale_search: bool) -> list[str]:
        return list(Objective.parse(menu=defaults.MENU, scale_search=scale_search,
                                    budget_bits=5.0, budget_bytes=None, kl_target=None,
                                    pins=None, sensitivity=None, sensitivity_mode=None,
                                    select_plans=1).menu)

    assert modifier() == command_line(True)
    assert "NVFP4_SEARCH" in command_line(True)
    assert modifier(scale_search=False) == command_line(False) == list(defaults.MENU)


def test_window_defaults_are_the_definitions_everywhere():
    """The menu and the window counts: the command line, quantize, analyze and eval
    take them from fp4sense.defaults."""
    from fp4sense import defaults
    from fp4sense.api import analyze_model, evaluate_checkpoint, quantize_model
    from fp4sense.cli.commands import build_parser

    q = _signature_defaults(quantize_model)
    assert (q["menu"], q["calib_windows"], q["analysis_windows"], q["eval_windows"],
            q["window_tokens"]) == (defaults.MENU, defaults.CALIB_WINDOWS,
                                    defaults.ANALYSIS_WINDOWS, defaults.EVAL_WINDOWS,
                                    defaults.WINDOW_TOKENS)
    a, e = _signature_defaults(analyze_model), _signature_defaults(evaluate_checkpoint)
    assert (a["analysis_windows"], a["window_tokens"]) == (defaults.ANALYSIS_WINDOWS,
                                                    defaults.WINDOW_TOKENS)
    assert (e["eval_windows"], e["window_tokens"]) == (defaults.EVAL_WINDOWS,
                                                    defaults.WINDOW_TOKENS)
    parser = build_parser()
    args = parser.parse_args(["quantize", "--budget", "5", "--out", "x"])
    assert (args.menu, args.calib_windows, args.analysis_windows, args.eval_windows,
            args.window_tokens) == (
        ",".join(defaults.MENU), defaults.CALIB_WINDOWS, defaults.ANALYSIS_WINDOWS,
        defaults.EVAL_WINDOWS, defaults.WINDOW_TOKENS)


#: each table's function, and its keywords that are no flag of the table (the positional
#: argument, the text's two flags, QAD's own definition, what --json decides)
TABLES = {"QUANTIZE": ("quantize_model", {"model", "text", "distill", "progress", "log"}),
          "ANALYZE": ("analyze_model", {"model", "text", "progress", "log"}),
          "EVAL": ("evaluate_checkpoint", {"checkpoint", "text", "progress", "log"}),
          "ANALYZE_TRAINING": ("analyze_training", {"model", "text", "progress", "log"}),
          "TRAIN_TRIAL": ("train_trial", {"model", "text", "progress", "log"})}


def _table(name: str):
    from fp4sense import options, options_training

    return getattr(options, name, None) or getattr(options_training, name)


@pytest.mark.parametrize("table", sorted(TABLES))
def test_the_option_table_is_the_functions_signature(table):
    """Every keyword of the function is in its option table (or named above as the
    command line's own), and every option's default is the function's."""
    from fp4sense import api

    function, own = TABLES[table]
    signature = _signature_defaults(getattr(api, function))
    rows = _table(table)
    keywords = [o.keyword for o in rows]
    assert len(keywords) == len(set(keywords)), "an option defined twice"
    import inspect

    every = set(inspect.signature(getattr(api, function)).parameters)
    assert set(keywords) | own == every, (set(keywords) | own) ^ every
    for option in rows:
        if not option.required:
            assert option.default == signature[option.keyword], option.keyword


@pytest.mark.parametrize("command,table", [("quantize", "QUANTIZE"), ("analyze", "ANALYZE"),
                                           ("eval", "EVAL"),
                                           ("analyze-training", "ANALYZE_TRAINING"),
                                           ("train-trial", "TRAIN_TRIAL")])
def test_the_flags_are_generated_from_the_table(command, table):
    """Each option's flag exists with the table's help, default and type; the flags
    with no value say the function's default by being absent."""
    import argparse

    from fp4sense.cli import COMMANDS

    parser = argparse.ArgumentParser()
    COMMANDS[command][1](parser)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for option in _table(table):
        action = actions[option.flag]
        assert action.dest == option.keyword and option.help in action.help, option.flag
        if option.switch:
            assert action.default == option.default and action.nargs == 0, option.flag
        elif option.group is None and not option.required:
            assert action.default == option.shown and action.type is option.parse


@pytest.mark.parametrize("function,keyword,bad", [
    ("quantize_model", "calib_windows", 0), ("quantize_model", "budget_bits", -1.0),
    ("quantize_model", "select_plans", 1.5), ("quantize_model", "eval_windows", "8"),
    ("analyze_model", "analysis_windows", 0), ("analyze_model", "window_tokens", True),
    ("evaluate_checkpoint", "eval_windows", -2), ("analyze_training", "bf16_share", 2.0),
    ("analyze_training", "seeds", 0), ("train_trial", "steps", 0)])
def test_the_functions_refuse_what_the_flags_refuse(function, keyword, bad, tmp_path):
    """A keyword out of range is one InputError naming it, before anything is read or
    written (the flags' parser checks it; the same check runs on the function's value)."""
    from fp4sense import api
    from fp4sense.validate import InputError

    given = {"quantize_model": dict(out_dir=tmp_path / "out", budget_bits=5.0),
             "analyze_model": dict(out_dir=tmp_path / "out"),
             "evaluate_checkpoint": dict(checkpoint=tmp_path / "missing"),
             "analyze_training": dict(out_dir=tmp_path / "out"),
             "train_trial": dict(policy=tmp_path / "p.json", out_dir=tmp_path / "out")
             }[function]
    with pytest.raises(InputError, match=rf"{function}\({keyword}="):
        getattr(api, function)(**{**given, keyword: bad})
    assert not (tmp_path / "out").exists()


def test_the_cli_reference_is_generated_from_the_parsers():
    """docs/cli.md's option reference is what the parsers (built from the option table)
    say: `python -m fp4sense.cli.reference` rewrites it after a change."""
    from fp4sense.cli.reference import page_with_reference

    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert page_with_reference(page) == page, "run: python -m fp4sense.cli.reference"
    assert "`--distill-holdout N` | `4` |" in page and "| `--menu MENU` | `NVFP4," in page


def test_the_functions_take_numbers_of_any_kind_in_range():
    """numpy's integers and floats pass the same checks as Python's."""
    import numpy as np

    from fp4sense import options

    options.check(options.QUANTIZE, {"calib_windows": np.int64(4), "budget_bits": np.float32(5),
                                     "select_plans": 2, "menu": ("NVFP4",)}, "quantize_model")


def test_every_number_parser_is_checked_on_the_functions_side():
    """An option parsed by one of validate's number parsers gets the same range check when
    its keyword comes through a Python function (options._NUMBERS lists them all)."""
    from fp4sense import options, validate

    parsers = {f for name, f in vars(validate).items()
               if name.startswith(("positive_", "non_negative_")) and callable(f)}
    assert parsers and set(options._NUMBERS) == parsers


@pytest.mark.parametrize("table, function", [
    ("VERIFY_VLLM", "fp4sense.evaluation.vllm_check:verify_vllm_many"),
    ("PUSH", "fp4sense.publishing.hub:push"),
    ("CONVERT_GGUF", "fp4sense.inputs.gguf:convert_gguf"),
])
def test_verify_push_and_convert_take_their_flags_from_the_option_table(table, function):
    """verify-vllm, push and convert-gguf join the option table: every flag the command
    line passes to the function by keyword is one of its parameters, with the same
    default (the prompt and the timeout are written once, in fp4sense.defaults)."""
    import importlib

    from fp4sense import options

    module, name = function.split(":")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    passed = [o for o in getattr(options, table)
              if o.keyword not in ("eval_windows", "window_tokens", "raw_windows", "max_abs",
                                   "mean_abs", "ppl_rel")]  # windows and tolerance: built first
    for option in passed:
        assert option.keyword in params, (table, option.keyword)
        default = params[option.keyword].default
        if default is not inspect.Parameter.empty:
            assert option.default == default, (table, option.keyword)


def test_window_names_before_0_6_0_still_work_with_one_warning(capsys):
    """One name per kind of window (analysis_windows, calib_windows, eval_windows); the
    names before 0.6.0 (--windows, n_windows=, estimate_windows=) are still taken, with a
    warning naming the new one, until 0.7.0."""
    from fp4sense.api import analyze_model, evaluate_checkpoint, quantize_model
    from fp4sense.cli.commands import build_parser
    from fp4sense.validate import InputError

    parser = build_parser()
    for command, keyword in (("analyze", "analysis_windows"), ("eval", "eval_windows"),
                             ("verify-vllm", "eval_windows")):
        given = [command] + (["ckpt"] if command != "analyze" else [])
        args = parser.parse_args([*given, "--windows", "3"])
        assert getattr(args, keyword) == 3
        flag = "--" + keyword.replace("_", "-")
        assert f"--windows is now {flag}" in capsys.readouterr().err
        args = parser.parse_args(given)  # untouched without it, and silent
        assert getattr(args, keyword) != 3 and capsys.readouterr().err == ""
    args = parser.parse_args(["quantize", "--budget", "5", "--out", "x", "--windows", "3"])
    assert args.analysis_windows == 3 and args.eval_windows != 3
    for function, old, new in ((analyze_model, "n_windows", "analysis_windows"),
                               (evaluate_checkpoint, "n_windows", "eval_windows"),
                               (quantize_model, "estimate_windows", "analysis_windows")):
        extra = {"out_dir": "x", "budget_bits": 5} if function is quantize_model else {}
        target = ("ckpt",) if function is evaluate_checkpoint else ()
        with pytest.warns(FutureWarning, match=f"{old}=\\) is now {new}="), \
                pytest.raises(InputError, match=f"{new}=0"):  # the value checked as the new
            function(*target, **{old: 0}, **extra)
        with pytest.raises(InputError, match=f"give {new}= only"):
            function(*target, **{old: 1, new: 1}, **extra)
