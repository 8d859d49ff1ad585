"""The layout by stage (docs/architecture.md): every package says what it holds, no
module grows past the size one reader takes in, and 0.4's module paths, deprecated for
0.5, are gone in 0.6 as announced."""

import importlib
import pkgutil
from pathlib import Path

import pytest

import fp4sense

SRC = Path(fp4sense.__file__).parent
# "none much over 350 lines" (the house issue): a little slack for a docstring
MAX_LINES = 360


def test_every_package_says_what_it_holds():
    for info in pkgutil.walk_packages(fp4sense.__path__, "fp4sense."):
        if info.ispkg:
            module = importlib.import_module(info.name)
            assert (module.__doc__ or "").strip(), f"{info.name} has no docstring"


def test_no_module_over_the_size_limit():
    sizes = {p.relative_to(SRC).as_posix(): len(p.read_text().splitlines())
             for p in SRC.rglob("*.py")}
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}


def test_top_level_holds_only_front_doors_and_edges():
    top = sorted(p.name for p in SRC.glob("*.py"))
    # the front doors (api, __main__) and what they share without importing a stage:
    # validate (flag checks, UserError), defaults (the shared default values) and
    # options (every option of analyze, quantize and eval, defined once) and
    # options_training (those of the FP4 training commands, defined the same way)
    assert top == ["__init__.py", "__main__.py", "api.py", "defaults.py", "options.py",
                   "options_training.py", "validate.py"]


#: 0.4's module paths (aliases in 0.5, announced for removal in 0.6)
REMOVED_IN_06 = ["fp4sense.e2m1", "fp4sense.formats", "fp4sense.fp4", "fp4sense.schemes",
                 "fp4sense.fakequant", "fp4sense.scale_search", "fp4sense.units",
                 "fp4sense.sensitivity", "fp4sense.diagnosis.report", "fp4sense.planner",
                 "fp4sense.quantize", "fp4sense.hosts", "fp4sense.quantized",
                 "fp4sense.metrics", "fp4sense.verify", "fp4sense.data", "fp4sense.models",
                 "fp4sense.assets", "fp4sense.gguf", "fp4sense.report", "fp4sense.model_card",
                 "fp4sense.hub", "fp4sense.lineage", "fp4sense.cli_args"]


@pytest.mark.parametrize("old", REMOVED_IN_06)
def test_the_04_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_plan_of_04_loads_with_its_old_field_name(tmp_path):
    """plan.json of 0.4 called the damage source ``score``."""
    import json

    from fp4sense.planning import Plan

    plan = {"choices": [], "menu": ["NVFP4"], "objective": {"budget_bits": 4.5},
            "score": "estimated", "version": 1}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.damage_source == "estimated"
    assert not hasattr(loaded, "score")  # 0.5's deprecated alias, gone in 0.6


def test_python_m_fp4sense_is_the_cli():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fp4sense", "--version"], capture_output=True,
                         text=True, check=True)
    assert fp4sense.__version__ in out.stdout


def test_a_view_without_a_rendering_gets_a_plain_table():
    """report.md renders registered views with their own tables; any other view in the
    report gets the plain one (target, KL, ΔPPL, top-1), so a new view shows up at once."""
    import dataclasses

    import torch

    from fp4sense.diagnosis import analyze
    from fp4sense.reports.analysis import RENDERINGS, markdown
    from helpers import ToyLM

    assert {"component", "block_isolate", "grid"} <= set(RENDERINGS)
    windows = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    report = analyze(ToyLM().eval(), windows, schemes=["NVFP4"], views=["component"],
                     modes=["estimated"], progress=False, log=lambda m: None)
    extra = dataclasses.replace(report.entries[0], view="attention_only", target="attn")
    report.entries.append(extra)
    page = markdown(report, {}, [])
    assert "### Components, NVFP4 (estimated)" in page
    assert "### View attention_only, NVFP4 (estimated)" in page
    assert "| target | KL | ΔPPL | top-1 agreement |" in page


def test_the_api_is_a_lazy_table_of_the_commands():
    """``import fp4sense.api`` loads none of torch; each public name resolves, on first
    use, to the function its stage package defines (one per command, push and verify
    included)."""
    import subprocess
    import sys

    code = ("import sys, fp4sense.api as api; assert 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    import fp4sense.api as api

    where = {"analyze_model": "fp4sense.jobs.analyze",
             "quantize_model": "fp4sense.jobs.quantize",
             "evaluate_checkpoint": "fp4sense.jobs.evaluate",
             "verify_vllm": "fp4sense.evaluation.vllm_check",
             "check_folder": "fp4sense.publishing.hub", "push": "fp4sense.publishing.hub",
             "convert_gguf": "fp4sense.inputs.gguf", "ensure_assets": "fp4sense.inputs.assets",
             "load_model": "fp4sense.inputs.models",
             "analysis_windows": "fp4sense.inputs.models",
             "analyze_training": "fp4sense.jobs.analyze_training",
             "train_trial": "fp4sense.jobs.train_trial",
             "apply_training_policy": "fp4sense.numerics.training_linear",
             "FP4TrainingMonitor": "fp4sense.training.callback"}
    assert set(api.__all__) == set(where) | {"BUNDLED_MODEL_NOTE"}
    for name, module in where.items():
        assert getattr(api, name).__module__ == module, name
    with pytest.raises(AttributeError):
        api.not_a_command  # noqa: B018


def test_every_module_is_named_in_its_package_and_in_the_layout_page():
    """Docs drift: each module of a package is named in the package's docstring and in
    docs/layout.md."""
    layout = (SRC.parents[1] / "docs" / "layout.md").read_text()
    missing = []
    for package in sorted(p for p in SRC.iterdir() if (p / "__init__.py").is_file()):
        doc = importlib.import_module(f"fp4sense.{package.name}").__doc__ or ""
        for module in sorted(package.glob("*.py")):
            if module.name == "__init__.py":
                continue
            if module.stem not in doc:
                missing.append(f"{package.name}/{module.name}: not in the package docstring")
            if module.name not in layout:
                missing.append(f"{package.name}/{module.name}: not in docs/layout.md")
    assert missing == []


def test_tests_mirror_the_stages():
    """Every test module sits in a folder named after the package it tests, or in one of
    the folders that cross the stages (models: every family end to end and MoE; project:
    the repository itself); none at the top of tests/."""
    tests = Path(__file__).resolve().parents[1]
    assert not sorted(tests.glob("test_*.py"))
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.parent.name for p in tests.rglob("test_*.py")}
    assert folders <= packages | {"models", "project"}, folders - packages
    assert len(folders & packages) >= 8


def test_registries_refuse_a_duplicate_name_naming_both_registrants():
    """A format, a report view or a rendering registered under a taken name is one
    RegistryError naming the first registrant and the second (as compressed-tensors'
    RegistryMixin refuses one); the registry keeps the first."""
    from fp4sense.diagnosis.views import REPORT_VIEWS, register_view
    from fp4sense.numerics.formats import FORMATS, NVFP4, register_format
    from fp4sense.reports.analysis import RENDERINGS, register_rendering
    from fp4sense.validate import RegistryError

    class Impostor(type(NVFP4)):
        name = "nvfp4"

    def component(units, blocks):
        return []

    def tables(report):
        return []

    before = (FORMATS["nvfp4"], REPORT_VIEWS["component"], RENDERINGS["component"])
    for register, first in ((lambda: register_format(Impostor), "numerics.formats.NVFP4"),
                            (lambda: register_view("component", "component")(component),
                             "diagnosis.views._component"),
                            (lambda: register_rendering("component")(tables),
                             "reports.analysis._component_tables")):
        with pytest.raises(RegistryError, match="registered twice") as caught:
            register()
        line = str(caught.value)
        assert first in line and "test_layout." in line and "\n" not in line
    assert (FORMATS["nvfp4"], REPORT_VIEWS["component"], RENDERINGS["component"]) == before
