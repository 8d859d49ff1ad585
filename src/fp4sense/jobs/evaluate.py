"""``fp4sense eval``: a compressed-tensors checkpoint against its base model, per protocol."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fp4sense import defaults, options
from fp4sense.checkpoint.checks import check_checkpoint, checkpoint_tokenizer, effective_bits
from fp4sense.checkpoint.loading import load_checkpoint
from fp4sense.inputs.models import load_model
from fp4sense.inputs.texts import (
    PROTOCOL_EVAL_TEXT,
    model_context,
    protocol_windows,
    window_prefix,
)
from fp4sense.numerics.metrics import compare_models, implausible
from fp4sense.runtime.devices import resolve
from fp4sense.structure.lineage import is_hub_id, local_record, public_name
from fp4sense.structure.units import model_fingerprint
from fp4sense.validate import InputError, read_json, renamed_keywords

__all__ = ["evaluate_checkpoint"]


@renamed_keywords(n_windows="eval_windows")
def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    text: str | os.PathLike | None = None,
    eval_windows: int = defaults.EVAL_WINDOWS,
    window_tokens: int = defaults.WINDOW_TOKENS,
    as_served: bool = False,
    raw_windows: bool = False,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    log=print,
) -> dict:
    """``fp4sense eval``: PPL, KL vs base and top-1 agreement on the evaluation windows,
    and the measured effective bits, of any compressed-tensors checkpoint (float32).

    :param base: the unquantized model (default: the one the checkpoint records).
    :param as_served: compute MXFP4A16 layers as W4A4, as vLLM serves them.
    :param raw_windows: windows of text tokens only, without the tokens the tokenizer
        starts a sequence with (BOS; see :func:`fp4sense.inputs.texts.make_windows`).
    :param device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; ``dtype`` float32 (default on
        the CPU, the protocol) or bfloat16 (default on a GPU).

    The result names the checkpoint, base and text by name (Hub id, folder or file name),
    as files that may be shared do, never by their paths on this machine.
    """
    options.check(options.EVAL, locals(), "evaluate_checkpoint")  # as the flags are
    placement = resolve(device, dtype, log=log)
    folder = Path(checkpoint)
    check_checkpoint(folder)
    tokenizer = checkpoint_tokenizer(folder)
    if base is None:
        base = _recorded_base(folder)
    windows = protocol_windows(tokenizer, "evaluation", eval_windows, text, window_tokens,
                               raw_windows, model_context(read_json(
                                   folder / "config.json", "checkpoint's config",
                                   "restore it from the checkpoint's source")), log)
    base_model, _, _ = load_model(base, placement.dtype, placement.device)
    _check_base_matches(folder, base_model, base)
    quant, act_layers, notes = load_checkpoint(folder, as_served, placement.device,
                                               placement.dtype)
    other = _other_base(folder, base_model)
    if other:
        log(f"note: {other}")
        notes.append(other)
    comparison = compare_models(base_model, quant, windows,
                                desc="evaluating" if progress else "")
    warning = implausible(comparison.base_ppl, base_model.config.get_text_config().vocab_size,
                          comparison.nll_diff, comparison.nll_diff_se)
    if warning:
        log(warning)
    bits = effective_bits(folder)
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    return {
        "checkpoint": folder.resolve().name, "base": public_name(base),
        **comparison.to_dict(),
        "effective_bits": bits["bits"], "linear_bytes": bits["bytes"],
        "format": qcfg.get("format"), "activation_quantized_layers": act_layers,
        "windows": eval_windows, "window_tokens": window_tokens,
        "window_prefix": window_prefix(tokenizer, raw_windows),
        "device": placement.describe(),
        "text": public_name(text) if text is not None else PROTOCOL_EVAL_TEXT,
        "notes": notes,
    }


def _check_base_matches(folder: Path, base_model: torch.nn.Module, base) -> None:
    """The base model has the checkpoint's architecture and shapes (else KL vs it is
    meaningless): one line naming both."""

    saved = json.loads((folder / "config.json").read_text())
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size")
    config = base_model.config.to_dict()
    differ = [f"{k} {config.get(k)} vs {saved.get(k)}" for k in keys
              if k in saved and config.get(k) != saved.get(k)]
    if differ:
        raise InputError(f"base model {str(base)!r} is not the model {folder} was made from "
                         f"({'; '.join(differ)}); pass the right --base")


def _other_base(folder: Path, base_model: torch.nn.Module) -> str | None:
    """A line when plan.json records the fingerprint of another base than the one given
    (same architecture, other weights: the KL is then against a model the checkpoint was
    not made from); None when they agree or nothing is recorded."""

    recorded = _plan_field(folder, "model_fingerprint")
    given = model_fingerprint(base_model) if recorded else None
    if recorded and given != recorded:
        return (f"the base given (fingerprint {given}) is not the model the checkpoint was "
                f"made from (plan.json records {recorded}): the figures compare it with "
                "another model; pass the right --base")
    return None


def _plan_field(folder: Path, key: str):
    """One field of the checkpoint's plan.json (None without one); a plan.json that does
    not read is named in one line."""
    plan = folder / "plan.json"
    if not plan.is_file():
        return None
    record = read_json(plan, "checkpoint's plan", "restore it, or quantize again")
    if not isinstance(record, dict):
        raise InputError(f"{plan}: not a plan (a JSON object); restore it, or quantize again")
    return record.get(key)


def _recorded_base(folder: Path) -> str:
    """The base model a checkpoint was made from: the local path fp4sense recorded on
    this machine, else the Hub id or folder plan.json and config.json name."""

    candidates = [local_record(folder).get("base")]
    candidates.append(_plan_field(folder, "model"))
    config = read_json(folder / "config.json", "checkpoint's config",
                       "restore it from the checkpoint's source")
    candidates.append(config.get("_name_or_path"))
    for cand in candidates:
        if cand and Path(cand).is_dir() and (Path(cand) / "config.json").is_file():
            return cand
    for cand in candidates:
        if cand and is_hub_id(cand):
            return cand
    raise ValueError(f"{folder} does not name a base model that is on this machine "
                     f"(found {[c for c in candidates if c]}); pass --base MODEL")
