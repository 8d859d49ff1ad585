"""Loading the model to analyze, quantize or compare against, with every check that
makes a bad model one clear line; and the analysis windows of a text."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["BUNDLED_MODEL_NOTE", "DEFAULT_ANALYSIS_WINDOWS", "analysis_windows", "load_model"]

#: Printed beside every figure measured on the bundled model (protocol.md).
BUNDLED_MODEL_NOTE = ("The bundled SmolLM2-135M-Instruct weights were Q4_1-quantized (GGUF) "
                      "before fp4sense got them; figures are relative to that model.")
#: Analysis windows by default: the protocol's quick analysis (8 calibration windows).
DEFAULT_ANALYSIS_WINDOWS = 8


def load_model(source: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, notes) for a hub id or local folder; None = the bundled model.

    Refuses, in one line naming the culprit: a folder that does not exist, weights that
    cannot be read (truncated, corrupt), a model that is not a decoder-only causal LM
    (weights transformers would initialize at random), and NaN/Inf weights (by module)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp4sense.publishing.lineage import is_hub_id
    from fp4sense.validate import InputError

    notes: list[str] = []
    if source is None:
        from fp4sense.inputs.assets import ensure_model

        source = ensure_model(log=lambda msg: None)
        notes.append(BUNDLED_MODEL_NOTE)
    text = str(source)
    looks_local = os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1
    if not Path(text).exists() and (looks_local or ("/" in text and not is_hub_id(text))):
        raise InputError(f"model {text!r} not found: no such folder here, and not a Hub id "
                         "(ORG/NAME); pass a model folder or a Hub id")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype,
                                                           output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # truncated files, unknown architectures, offline hub, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"could not load model {text!r} as a causal LM "
                         f"({type(exc).__name__}: {first})") from None
    model.eval()
    missing = [k for k in info.get("missing_keys", ()) if not k.endswith("_buffer")]
    if missing:
        raise InputError(
            f"model {text!r} is not a complete causal LM: {len(missing)} weight(s) would be "
            f"initialized at random ({', '.join(sorted(missing)[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); fp4sense analyzes decoder-only "
            "causal LMs whose weights are all in the checkpoint")
    _check_finite(model, text)
    return model, tokenizer, notes


def _check_finite(model: torch.nn.Module, source: str) -> None:
    """One line naming the modules whose weights hold NaN or Inf."""
    from fp4sense.validate import InputError

    bad = [(name, int((~torch.isfinite(p)).sum())) for name, p in model.named_parameters()
           if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        shown = ", ".join(f"{name.removesuffix('.weight')} ({n} NaN/Inf)"
                          for name, n in bad[:3])
        raise InputError(f"model {source!r} has non-finite weights in {shown}"
                         f"{', ...' if len(bad) > 3 else ''}; fix or re-download the "
                         "checkpoint")


def analysis_windows(tokenizer, text: str | os.PathLike | None = None, n_windows: int =
                     DEFAULT_ANALYSIS_WINDOWS, window_tokens: int = 512) -> torch.Tensor:
    """Analysis windows: the protocol's calibration split, or ``text`` (a file path or
    ``dataset:NAME[:CONFIG][:SPLIT]``). Never the evaluation split."""
    from fp4sense.inputs.texts import protocol_windows

    return protocol_windows(tokenizer, "calibration", n_windows, text, window_tokens)
