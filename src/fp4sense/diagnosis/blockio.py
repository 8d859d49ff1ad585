"""A decoder block's call, kept and replayed: its hidden-state input and output inside
the arguments transformers passes (positionally or as ``hidden_states``; a tuple or the
tensor alone), moved between devices, and without a key/value cache. The analysis
(measured and streamed estimate) and block-wise QAD replay blocks with these."""

from __future__ import annotations

import inspect

import torch

__all__ = ["hidden", "hidden_input", "moved", "no_cache", "uncached", "with_hidden",
           "with_hidden_input"]


def no_cache(model) -> dict:
    """``use_cache=False`` where the model takes it: a recomputed block must not append
    to a key/value cache its first forward filled."""
    return {"use_cache": False} if "use_cache" in inspect.signature(
        model.forward).parameters else {}


def moved(obj, device: torch.device, memo: dict):
    """``obj`` with every tensor moved to ``device`` (detached; a tensor shared by several
    calls, such as the rotary embeddings, moved once)."""
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:  # the original is kept with its copy, so its id stays its own
            memo[key] = (obj, obj.detach().to(device))
        return memo[key][1]
    if isinstance(obj, tuple):
        return tuple(moved(o, device, memo) for o in obj)
    if isinstance(obj, list):
        return [moved(o, device, memo) for o in obj]
    if isinstance(obj, dict):
        return {k: moved(v, device, memo) for k, v in obj.items()}
    return obj


def hidden(output):
    """A block's hidden-state output (blocks return it alone, or first in a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def with_hidden(output, x):
    """``output`` with its hidden state replaced by ``x``."""
    return (x, *output[1:]) if isinstance(output, tuple) else x


def hidden_input(args, kwargs) -> torch.Tensor:
    """A block call's hidden-state input."""
    return args[0] if args else kwargs["hidden_states"]


def with_hidden_input(args, kwargs, x):
    """A block call's arguments with ``x`` as its hidden-state input."""
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def uncached(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's arguments without a key/value cache (a replayed block must not append
    to one its first call filled)."""
    return args, {k: (None if k in ("past_key_values", "past_key_value") else
                      False if k == "use_cache" else v) for k, v in kwargs.items()}
