"""Host code the core finds through entry points, never by importing it.

The core (``src/fp4sense``) imports no host framework (llm-compressor, vLLM, optimum),
not even inside a function; a static import contract in the tests keeps it so. Hosts
register what the core calls as entry points: ``fp4sense.quantizers`` names a function
that applies a saved plan to a model and writes the compressed checkpoint
(``fp4sense-llmcompressor`` registers ``llmcompressor``); ``fp4sense.moe_linearizers``
names a function that rewrites a model's fused 3-D experts as one ``nn.Linear`` per expert
and projection, the layout the host calibrates and saves (llm-compressor's
``linearize_moe``); ``fp4sense.rounders`` names a function that rounds a model with
GPTQ under a saved plan and saves the quantized weights, not a checkpoint (the scores
after GPTQ of :mod:`fp4sense.quantization.rounded`).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from fp4sense.validate import UserError

__all__ = ["MOE_LINEARIZERS", "QUANTIZERS", "ROUNDERS", "HostMissingError", "host",
           "quantizer"]

#: entry-point group of plan appliers: f(source, calib, work, *, plan, gptq[, distill,
#: state_dir]) -> recipe YAML
QUANTIZERS = "fp4sense.quantizers"
DEFAULT_QUANTIZER = "llmcompressor"
#: entry-point group of expert linearizers: f(model) -> model (experts as nn.Linear)
MOE_LINEARIZERS = "fp4sense.moe_linearizers"
#: entry-point group of GPTQ rounders: f(source, calib, out_file, *, plan) -> count of
#: linears whose quantized weights (dequantized, bf16) it saved in safetensors out_file
ROUNDERS = "fp4sense.rounders"


class HostMissingError(UserError, ValueError):
    """The host package a command needs is not installed in this environment."""


def quantizer(name: str = DEFAULT_QUANTIZER) -> Callable[..., str]:
    """The plan applier registered under ``name`` in :data:`QUANTIZERS`."""
    return host(QUANTIZERS, name, "quantizing")


def host(group: str, name: str = DEFAULT_QUANTIZER, what: str = "this") -> Callable:
    """The function a host registered under ``name`` in the entry-point ``group``
    (``what`` names the work that needs it, in the error)."""
    found = {ep.name: ep for ep in entry_points(group=group)}
    if name not in found:
        raise HostMissingError(
            f"{what} needs the fp4sense-{name} plugin (entry point {group}:{name}), "
            f"which is not installed here (found: {sorted(found) or 'none'}); "
            f"pip install fp4sense-{name}")
    try:
        return found[name].load()
    except ImportError as exc:
        raise HostMissingError(f"the fp4sense-{name} plugin is installed but cannot be "
                               f"imported ({exc}); reinstall it with its host") from None
