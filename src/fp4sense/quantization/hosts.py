"""Host code the core finds through entry points, never by importing it.

The core (``src/fp4sense``) imports no host framework (llm-compressor, vLLM, optimum),
not even inside a function; a static import contract in the tests keeps it so. Hosts
register what the core calls as entry points: ``fp4sense.quantizers`` names a function
that applies a saved plan to a model and writes the compressed checkpoint
(``fp4sense-llmcompressor`` registers ``llmcompressor``).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

__all__ = ["QUANTIZERS", "HostMissingError", "quantizer"]

#: entry-point group of plan appliers: f(source, calib, work, *, plan, gptq) -> recipe YAML
QUANTIZERS = "fp4sense.quantizers"
DEFAULT_QUANTIZER = "llmcompressor"


class HostMissingError(ValueError):
    """The host package a command needs is not installed in this environment."""


def quantizer(name: str = DEFAULT_QUANTIZER) -> Callable[..., str]:
    """The plan applier registered under ``name`` in :data:`QUANTIZERS`."""
    found = {ep.name: ep for ep in entry_points(group=QUANTIZERS)}
    if name not in found:
        raise HostMissingError(
            f"quantizing needs the fp4sense-{name} plugin (entry point {QUANTIZERS}:{name}), "
            f"which is not installed here (found: {sorted(found) or 'none'}); "
            f"pip install fp4sense-{name}")
    try:
        return found[name].load()
    except ImportError as exc:
        raise HostMissingError(f"the fp4sense-{name} plugin is installed but cannot be "
                               f"imported ({exc}); reinstall it with its host") from None
