"""Every option defined once: each front door's names and defaults for QAD come from
:class:`fp4sense.quantization.distill_settings.DistillSettings`, and a test fails when one
differs (the command line, optimum-cli's reuse of it, the YAML modifier, the API)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

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
