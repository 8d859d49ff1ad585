"""The console script: --help, --version, subcommands, errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FP4SENSE
from fp4sense import __version__


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FP4SENSE, *args], capture_output=True, text=True, timeout=300)


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fp4sense {__version__}"


def test_help_lists_subcommands():
    proc = run("--help")
    assert proc.returncode == 0
    for sub in ("setup", "convert-gguf", "schemes"):
        assert sub in proc.stdout


def test_schemes_json():
    proc = run("schemes", "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["NVFP4A16"]["bits_per_weight_576x1536"] > 4.5
    assert rows["BF16"]["bits_per_weight_576x1536"] == 16


def test_setup_json_points_at_the_assets(assets):
    proc = run("setup", "--json")
    assert proc.returncode == 0, proc.stderr
    paths = json.loads(proc.stdout)
    assert Path(paths["model"]) == assets["model"]


def test_user_error_is_one_line_with_exit_code_1(tmp_path):
    proc = run("convert-gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "GGUF file not found" in proc.stderr and "Traceback" not in proc.stderr


def test_every_user_error_is_typed_with_its_exit_code():
    """Each error users can fix is a fp4sense.validate.UserError carrying its exit code
    (no matching by module names); the command line prints it as one line with that
    code, and anything else still raises."""
    import argparse
    import importlib
    import pkgutil

    import fp4sense
    from fp4sense.cli import EXIT_ASSET_ERROR, EXIT_HUB_ERROR, run_command
    from fp4sense.validate import UserError

    errors = {}
    for info in pkgutil.walk_packages(fp4sense.__path__, "fp4sense."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ ==
                    info.name and name.endswith("Error")):
                errors[name] = obj
    internal = {"RoundedWeightsError"}  # a file fp4sense wrote lacks a weight: a bug
    assert {n for n, e in errors.items() if not issubclass(e, UserError)} == internal
    assert errors["AssetError"].exit_code == EXIT_ASSET_ERROR == 3
    assert errors["HubError"].exit_code == EXIT_HUB_ERROR == 5
    assert {e.exit_code for n, e in errors.items()
            if n not in internal | {"AssetError", "HubError"}} == {1}

    def fails(exc):
        def action(_args):
            raise exc
        return action

    for exc in (errors["HubError"]("no token"), errors["PlanError"]("bad menu"),
                ValueError("bad value")):
        assert run_command(fails(exc), argparse.Namespace()) == getattr(exc, "exit_code", 1)
    with pytest.raises(RuntimeError):
        run_command(fails(RuntimeError("a bug")), argparse.Namespace())


def test_help_lists_every_command_and_the_exit_codes():
    from fp4sense.cli import COMMANDS

    proc = run("--help")
    for name in COMMANDS:
        assert name in proc.stdout
    for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "5 ", "130 ", "143 "):
        assert f"\n  {code}" in proc.stdout


def test_the_cli_reference_documents_the_exit_codes():
    from fp4sense.cli import EXIT_CODES_HELP

    readme = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for line in EXIT_CODES_HELP.splitlines()[1:]:
        code, meaning = line.split(maxsplit=1)
        assert f"| {code} | {meaning} |" in readme, line


def _flags(name: str) -> set[str]:
    import argparse

    from fp4sense.cli import COMMANDS

    parser = argparse.ArgumentParser()
    COMMANDS[name][1](parser)
    return {s for a in parser._actions for s in a.option_strings}


def test_flags_are_consistent_across_commands():
    from fp4sense.cli import COMMANDS

    for name in COMMANDS:  # every command can print for scripts
        assert "--json" in _flags(name), name
    for name in ("analyze", "quantize", "eval", "verify-vllm"):  # text in, same words
        assert {"--text", "--dataset", "--tokens", "--raw-windows"} <= _flags(name), name
    # one name for each kind of window, whichever command takes it
    kinds = {"analyze": {"--analysis-windows"}, "eval": {"--eval-windows"},
             "verify-vllm": {"--eval-windows"},
             "quantize": {"--calib-windows", "--analysis-windows", "--eval-windows",
                          "--distill-windows"}}
    for name, flags in kinds.items():
        assert {f for f in _flags(name) if f[2:].endswith("-windows") and f != "--raw-windows"} \
            == flags, name
    for name in ("convert-gguf", "quantize"):  # writes a folder: refuses, unless told
        assert {"--out", "--overwrite"} <= _flags(name), name


def test_interrupt_inside_a_progress_bar_still_ends_in_one_line(tmp_path):
    """A Ctrl-C that lands while a progress bar is being built leaves a bar whose
    finalizer fails; it is finalized quietly before the one line, which stays last."""
    script = tmp_path / "interrupted.py"
    script.write_text("""
import argparse, sys
from tqdm.asyncio import tqdm_asyncio
from fp4sense.cli import run_command

class HalfBuilt(tqdm_asyncio):  # interrupted after `disable`, before `pos` (as seen in CI)
    def __init__(self, *args, **kwargs):
        self.disable = False
        raise KeyboardInterrupt

def action(args):
    HalfBuilt(total=3)

sys.exit(run_command(action, argparse.Namespace(json=False)))
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("fp4sense: interrupted")
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


@pytest.mark.parametrize("sig, code, said", [
    ("SIGINT", 130, "fp4sense: interrupted"),
    ("SIGTERM", 143, "fp4sense: terminated (SIGTERM)"),  # schedulers, docker stop, timeout
], ids=["ctrl-c", "sigterm"])
def test_interrupt_exits_with_one_line(tiny_llama, text_file, tmp_path, sig, code, said):
    import signal
    import time

    # long enough (8 windows x 256 tokens) that the interrupt lands while it measures
    proc = subprocess.Popen([FP4SENSE, "analyze", str(tiny_llama), "--text", str(text_file),
                             "--tokens", "256", "--analysis-windows", "8", "--no-cache", "--views",
                             "component,block,grid", "--out", str(tmp_path / "a")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as at a terminal: a shell's background job (CI launched with
                            # &) ignores SIGINT, and children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    seen = ""
    while "measuring" not in seen and time.time() < deadline:  # progress bar: work started
        seen += proc.stderr.read(1)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(said)
    assert "Traceback" not in err


def test_a_wrong_out_is_refused_before_torch_is_imported(tmp_path):
    """quantize and analyze check their output folder (and the analysis cache) first, so
    such an error is one line in a moment: the process never imports torch."""
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "file").write_text("x")
    probe = ("import sys; from fp4sense.cli import main; rc = main(sys.argv[1:]); "
             "print(rc, 'torch' in sys.modules)")
    for args, culprit in (
            (["quantize", str(model), "--budget", "5", "--out", str(model / "q")],
             "is, holds or is inside the input"),
            (["analyze", str(model), "--out", str(tmp_path / "file")], "is an existing file"),
            (["analyze", str(model), "--out", str(tmp_path / "a")], "the analysis cache")):
        env = {"FP4SENSE_CACHE": str(tmp_path / "file")} if culprit.endswith("cache") else {}
        proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True,
                              text=True, timeout=300, env={**os.environ, **env})
        assert proc.stdout.split() == ["1", "False"], (args, proc.stdout, proc.stderr[-2000:])
        assert culprit in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
