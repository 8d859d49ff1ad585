"""Every option of the commands that have a Python function (``analyze``, ``quantize``,
``eval``), defined once: the function's keyword, the command line's flag, the default
(the function's; values several doors share come from :mod:`fp4sense.defaults`), the
help, and the validation (the flag's parser, which also checks the keyword's value).

- the command line generates its flags from these tables and passes them back by
  keyword (:mod:`fp4sense.cli.arguments`, :func:`keywords`); optimum-cli reuses those
  flags;
- the Python functions check their keywords with :func:`check` before any work;
- ``docs/cli.md``'s option reference is generated from the parsers built here
  (``python -m fp4sense.cli.reference``);
- tests compare the functions' signatures and the YAML modifiers' fields with the tables.

QAD's settings have their own definition, built the same way
(:class:`fp4sense.quantization.distill_settings.DistillSettings`); the text (``--text``
or ``--dataset``), ``--json`` and the positional arguments are the command line's own.
Imports no torch.
"""

from __future__ import annotations

import argparse
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fp4sense import defaults
from fp4sense.validate import (
    InputError,
    block_list,
    bounded_float,
    bounded_int,
    device_name,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

__all__ = ["ANALYZE", "CONVERT_GGUF", "EVAL", "PUSH", "QUANTIZE", "VERIFY_VLLM", "Option",
           "add", "check", "keywords", "pins_of", "windows"]

_NUMBERS = (positive_int, non_negative_int, positive_float, non_negative_float)
#: --tokens: a window of one token predicts nothing (its loss is NaN)
TOKENS_PER_WINDOW = bounded_int(2, 1 << 24, "longer than any model's context")
#: --select-plans: each plan is one more measured run of the model
MAX_SELECT_PLANS = 32
SELECT_PLANS = bounded_int(1, MAX_SELECT_PLANS, "each plan is measured by a full run on the "
                           "held-aside windows; the best few by prediction are enough")


@dataclass(frozen=True)
class Option:
    """One keyword of a Python function and its flag."""

    keyword: str
    flag: str
    default: object = None  # the function's default
    help: str = ""
    parse: Callable[[str], object] | None = None  # the flag's text -> value, validated
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switch: bool = False  # a flag without a value: given, the keyword is not its default
    required: bool = False  # the command line requires it (the function has no default)
    group: str | None = None  # exactly one of the options of a group is given
    csv: bool = False  # comma-separated on the command line, a tuple for the function
    append: bool = False  # repeatable
    flag_default: object = None  # the flag's default where it is not the function's
    convert: Callable[[object], object] | None = None  # flag value -> keyword value
    renamed_from: str | None = None  # the flag's name before 0.6.0, still taken (a warning)

    @property
    def shown(self) -> object:
        """The default as the command line states it."""
        value = self.default if self.flag_default is None else self.flag_default
        return ",".join(value) if self.csv and isinstance(value, tuple) else value

    def add_to(self, parser) -> None:
        """Add the flag to an argparse parser (or group); its value lands in ``keyword``."""
        help_ = self.help
        if not self.switch and self.shown not in (None, False) and "default" not in help_:
            help_ += f" (default {self.shown})"
        if self.switch:
            parser.add_argument(self.flag, dest=self.keyword, help=help_,
                                action="store_false" if self.default else "store_true")
            return
        if self.renamed_from is not None:
            parser.add_argument(self.renamed_from, dest=self.keyword, type=self.parse,
                                help=argparse.SUPPRESS, action=_Renamed, new=self.flag,
                                default=argparse.SUPPRESS)
        metavar = self.metavar or (None if self.choices else
                                   self.flag.lstrip("-").upper().replace("-", "_"))
        kw = dict(dest=self.keyword, help=help_, type=self.parse, metavar=metavar,
                  choices=list(self.choices) if self.choices else None)
        if self.append:
            kw["action"] = "append"
        if self.required:
            kw["required"] = True
        elif self.group is None:
            kw["default"] = self.shown
        parser.add_argument(self.flag, **kw)

    def value(self, given):
        """The keyword's value for the flag's parsed value."""
        if self.convert is not None:
            return self.convert(given)
        if self.csv and isinstance(given, str):
            return tuple(v.strip() for v in given.split(",") if v.strip())
        return given

    def check(self, value, function: str) -> None:
        """The keyword's value, checked as the flag's text is (numbers: range and kind)."""
        if value is None or self.switch or not (self.parse in _NUMBERS or getattr(
                self.parse, "bounded", False)):
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy too
            raise InputError(f"{function}({self.keyword}={value!r}): give a number")
        try:
            self.parse(str(value))
        except argparse.ArgumentTypeError as exc:
            said = str(exc).removeprefix(f"{str(value)!r}: ")
            raise InputError(f"{function}({self.keyword}={value!r}): {said}") from None


class _Renamed(argparse.Action):
    """A flag's name before 0.6.0: its value lands in the new keyword, with one warning."""

    def __init__(self, *args, new: str, **kw):
        super().__init__(*args, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is now {self.new} (the old name goes in 0.7.0)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def pins_of(values: Sequence[str] | None) -> dict[str, str] | None:
    """``--pin UNIT_OR_REGEX=SCHEME`` values -> {pattern: scheme}, each regex compiled;
    None without any (the function's default)."""
    pins = {}
    for item in values or []:
        pattern, sep, scheme = item.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"--pin {item!r}: write UNIT_OR_REGEX=SCHEME, e.g. "
                             "'.*layers\\.0\\..*=BF16'")
        try:
            re.compile(pattern.removeprefix("re:"))
        except re.error as exc:
            raise ValueError(f"--pin {item!r}: {pattern!r} is not a valid regular expression "
                             f"({exc}); escape dots and brackets, or name a unit such as "
                             "'3:mlp.down_proj'") from None
        pins[pattern] = scheme
    return pins or None


def windows(keyword: str, default: int, what: str, renamed: bool = True) -> list[Option]:
    """``--KIND-windows N --tokens T --raw-windows``: the same words on every command. One
    name for each kind of window: ``analysis_windows`` (the sensitivity analysis),
    ``calib_windows`` (quantize's oneshot), ``eval_windows`` (scores); ``renamed``: the
    command called it ``--windows`` before 0.6.0."""
    return [Option(keyword, "--" + keyword.replace("_", "-"), default, what, positive_int,
                   renamed_from="--windows" if renamed else None),
            Option("window_tokens", "--tokens", defaults.WINDOW_TOKENS, "tokens per window "
                   "(at least 2: a window predicts its tokens from the ones before; at most "
                   "the model's context)", TOKENS_PER_WINDOW),
            Option("raw_windows", "--raw-windows", False, "windows of text tokens only: "
                   "without the BOS (or prefix) the tokenizer starts a sequence with, which "
                   "windows otherwise begin with", switch=True)]


_PLACEMENT = [
    Option("device", "--device", "cpu", "auto, cpu, cuda or cuda:N (auto: this rank's GPU "
           "when there is one)", device_name),
    Option("dtype", "--dtype", None, "compute dtype, for quantize also the oneshot's "
           "calibration (default: float32 on the CPU, as the protocol; bfloat16 on a GPU)",
           choices=("float32", "bfloat16")),
]
_LOW_MEMORY = "hold one decoder block's weights at a time, read from the model's " \
              "safetensors files when it runs (models larger than memory)"

ANALYZE: tuple[Option, ...] = (
    Option("schemes", "--schemes", ("NVFP4", "MXFP4"), "comma-separated schemes of the "
           "menu (see `fp4sense schemes`)", non_empty, csv=True),
    Option("views", "--views", ("component", "block"), "comma-separated views: component, "
           "block, grid, experts (MoE: each expert alone; best with --mode estimated)",
           non_empty, csv=True),
    Option("modes", "--mode", ("measured",), "measured (isolation runs), estimated (one "
           "Fisher pass), or both", choices=("measured", "estimated", "both"),
           flag_default="measured",
           convert=lambda m: ("measured", "estimated") if m == "both" else (m,)),
    Option("grid_blocks", "--grid-blocks", None, "measure the grid only for these blocks "
           "(comma-separated; '' for none, the estimate alone; default: all)", block_list),
    *windows("analysis_windows", defaults.ANALYSIS_WINDOWS, "analysis windows (the first "
             "calibration ones)"),
    Option("out_dir", "--out", None, "output folder (sensitivity.json, report.md, plots)",
           Path, flag_default=Path("fp4sense-analysis")),
    Option("cache", "--no-cache", True, "neither read nor write the cache", switch=True),
    Option("plots", "--no-plots", True, "skip the PNG plots", switch=True),
    Option("offload_dir", "--offload-dir", None, "keep decoder blocks on disk here, one in "
           "memory at a time (a copy; --low-memory reads the model's own files instead)",
           Path),
    Option("low_memory", "--low-memory", False, _LOW_MEMORY, switch=True),
    *_PLACEMENT,
)

QUANTIZE: tuple[Option, ...] = (
    Option("budget_bits", "--budget", None, "average bits per weight, e.g. 4.75",
           positive_float, group="goal"),
    Option("budget_bytes", "--budget-bytes", None, "bytes of the decoder linears",
           positive_int, group="goal"),
    Option("kl_target", "--kl-target", None, "fewest bits with predicted KL below",
           positive_float, group="goal"),
    Option("out_dir", "--out", None, "checkpoint folder to write", Path, required=True),
    Option("menu", "--menu", defaults.MENU, "schemes units may get", non_empty, csv=True),
    Option("sensitivity", "--sensitivity", None, "a saved sensitivity.json (default: "
           "estimate it now)", Path),
    Option("sensitivity_mode", "--sensitivity-mode", None, "which grid of the report to "
           "plan with", choices=("measured", "estimated")),
    Option("pins", "--pin", None, "force units to a scheme (repeatable)",
           metavar="UNIT_OR_REGEX=SCHEME", append=True, convert=pins_of),
    Option("gptq", "--gptq", False, "round weights with GPTQ after planning", switch=True),
    Option("gptq_scores", "--gptq-scores", False, "with --gptq: score the units after GPTQ, "
           "not after round-to-nearest (one more GPTQ oneshot per quantizing scheme of the "
           "menu, before planning; units GPTQ repairs well then cost fewer bits)",
           switch=True),
    Option("scale_search", "--no-scale-search", True, "plan without the searched-scale "
           "twins of the FP4 menu schemes (NVFP4 -> NVFP4_SEARCH, used by default where "
           "they score lower)", switch=True),
    Option("select_plans", "--select-plans", 1, "measure the K best plans by prediction on "
           "calibration windows the estimate did not use and keep the lowest (1: no "
           f"measuring; at most {MAX_SELECT_PLANS})", SELECT_PLANS, metavar="K"),
    Option("base_model_id", "--base-model-id", None, "the base model's Hub id, for the "
           "model card's lineage (default: derived where certain: a hub id, a Hugging Face "
           "cache folder)", metavar="ORG/NAME"),
    Option("calib_windows", "--calib-windows", defaults.CALIB_WINDOWS, "calibration windows",
           positive_int),
    *windows("analysis_windows", defaults.ANALYSIS_WINDOWS, "analysis windows for the "
             "sensitivity estimate (the first calibration ones)"),
    Option("eval_windows", "--eval-windows", defaults.EVAL_WINDOWS, "evaluation windows for "
           "the model card's figures", positive_int),
    Option("evaluate", "--no-eval", True, "skip the evaluation for the card", switch=True),
    Option("overwrite", "--overwrite", False, "replace a non-empty --out", switch=True),
    Option("low_memory", "--low-memory", False, "estimate with one decoder block's weights "
           "in memory at a time", switch=True),
    *_PLACEMENT,
)

EVAL: tuple[Option, ...] = (
    Option("base", "--base", None, "unquantized model (default: as recorded)"),
    *windows("eval_windows", defaults.EVAL_WINDOWS, "evaluation windows"),
    Option("as_served", "--as-served", False, "compute MXFP4A16 layers as W4A4, as vLLM "
           "serves them", switch=True),
    *_PLACEMENT,
)


#: verify-vllm --timeout: past a day, a run is hung, not slow (and far past it, the
#: subprocess's timer overflows)
MAX_VLLM_TIMEOUT = 86400.0
VLLM_TIMEOUT = bounded_float(MAX_VLLM_TIMEOUT, "a vLLM run that long is hung; give seconds")

VERIFY_VLLM: tuple[Option, ...] = (
    *windows("eval_windows", 2, "evaluation windows to score; tokens <= 512"),
    Option("prompt", "--prompt", defaults.VLLM_PROMPT, "the prompt vLLM and transformers "
           "both continue greedily"),
    Option("serve_python", "--serve-python", None, "python of the vLLM environment"),
    Option("max_abs", "--max-abs", None, "limit on max |d logprob| (default: by scheme, see "
           "docs/vllm.md)", non_negative_float),
    Option("mean_abs", "--mean-abs", None, "limit on mean |d logprob|", non_negative_float),
    Option("ppl_rel", "--ppl-rel", None, "limit on the relative perplexity difference",
           non_negative_float),
    Option("timeout_s", "--timeout", defaults.VLLM_TIMEOUT_S, "seconds for the vLLM run (at "
           f"most {MAX_VLLM_TIMEOUT:g}: a day)", VLLM_TIMEOUT),
)

PUSH: tuple[Option, ...] = (
    Option("repo_id", "--repo-id", None, "Hub repo, OWNER/NAME (or NAME: yours)",
           required=True),
    Option("private", "--private", False, "create the repo private", switch=True),
    Option("dry_run", "--dry-run", False, "run every check and list the files; upload "
           "nothing", switch=True),
    Option("revision", "--revision", None, "branch to commit to (default: main)"),
    Option("commit_message", "--message", None, "commit message"),
    Option("allow_local_paths", "--allow-local-paths", False, "upload JSON files that record "
           "paths of this machine (older checkpoints)", switch=True),
)

CONVERT_GGUF: tuple[Option, ...] = (
    Option("out_dir", "--out", None, "output folder", Path, required=True),
    Option("name_or_path", "--name", None, "name_or_path to record (e.g. the hub id)"),
    Option("overwrite", "--overwrite", False, "replace a non-empty --out (only a folder "
           "fp4sense wrote)", switch=True),
)


def add(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    """Add every option's flag; the options of a group become one required mutually
    exclusive group."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for option in options:
        target = parser
        if option.group is not None:
            if option.group not in groups:
                groups[option.group] = parser.add_mutually_exclusive_group(required=True)
            target = groups[option.group]
        option.add_to(target)


def keywords(args: argparse.Namespace, options: Sequence[Option]) -> dict:
    """The function's keywords from parsed flags."""
    return {o.keyword: o.value(getattr(args, o.keyword)) for o in options}


def check(options: Sequence[Option], values: Mapping[str, object], function: str) -> None:
    """Check a function's keywords as the command line checks its flags (one
    :class:`~fp4sense.validate.InputError` naming the first bad one)."""
    for option in options:
        if option.keyword in values:
            option.check(values[option.keyword], function)
