"""Module paths of 0.4 that moved in 0.5 (the layout by stage): deprecated aliases for
one release. ``import fp4sense.formats`` still works, warns, and gives the very module
``fp4sense.numerics.formats`` (not a copy). ``fp4sense.checkpoint``, ``fp4sense.evaluation``
and ``fp4sense.cli`` became packages that export what the 0.4 modules did.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

# the aliases name fp4sense's own modules only (tests/test_layout.py checks it), so this
# import by name cannot hide a host from the import contract
from importlib import import_module  # noqa: TID251

MOVED = {
    "fp4sense.e2m1": "fp4sense.numerics.e2m1",
    "fp4sense.formats": "fp4sense.numerics.formats",
    "fp4sense.fp4": "fp4sense.numerics.fp4",
    "fp4sense.schemes": "fp4sense.numerics.schemes",
    "fp4sense.fakequant": "fp4sense.numerics.fakequant",
    "fp4sense.scale_search": "fp4sense.numerics.scale_search",
    "fp4sense.units": "fp4sense.diagnosis.units",
    "fp4sense.sensitivity": "fp4sense.diagnosis",
    "fp4sense.diagnosis.report": "fp4sense.diagnosis.results",
    "fp4sense.planner": "fp4sense.planning.milp",
    "fp4sense.quantize": "fp4sense.quantization.pipeline",
    "fp4sense.hosts": "fp4sense.quantization.hosts",
    "fp4sense.quantized": "fp4sense.checkpoint.loading",
    "fp4sense.metrics": "fp4sense.evaluation.metrics",
    "fp4sense.verify": "fp4sense.evaluation.vllm_check",
    "fp4sense.data": "fp4sense.inputs.texts",
    "fp4sense.models": "fp4sense.inputs.models",
    "fp4sense.assets": "fp4sense.inputs.assets",
    "fp4sense.gguf": "fp4sense.inputs.gguf",
    "fp4sense.report": "fp4sense.reports.analysis",
    "fp4sense.model_card": "fp4sense.reports.model_card",
    "fp4sense.hub": "fp4sense.publishing.hub",
    "fp4sense.lineage": "fp4sense.publishing.lineage",
    "fp4sense.cli_args": "fp4sense.cli.arguments",
}
ALIAS_REMOVED_IN = "0.6"


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands back the module that lives at the new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the alias goes in {ALIAS_REMOVED_IN}",
                      DeprecationWarning, stacklevel=2)
        return import_module(new)

    def exec_module(self, module):
        """The module is the new one, already executed."""


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
