"""The Python API behind the CLI: one function per command, same arguments, same files.

>>> from fp4sense.api import analyze_model
>>> report = analyze_model(schemes=["NVFP4", "MXFP4"], views=["component", "block"],
...                        out_dir="analysis")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from fp4sense.sensitivity import SensitivityReport

__all__ = ["BUNDLED_MODEL_NOTE", "analyze_model", "analysis_windows", "load_model"]

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

    from fp4sense.lineage import is_hub_id
    from fp4sense.validate import InputError

    notes: list[str] = []
    if source is None:
        from fp4sense.assets import ensure_model

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
    from fp4sense.data import protocol_windows

    return protocol_windows(tokenizer, "calibration", n_windows, text, window_tokens)


def analyze_model(
    model: str | os.PathLike | None = None,
    *,
    text: str | os.PathLike | None = None,
    schemes: Sequence[str] = ("NVFP4", "MXFP4"),
    views: Sequence[str] = ("component", "block"),
    modes: Sequence[str] = ("measured",),
    n_windows: int = DEFAULT_ANALYSIS_WINDOWS,
    window_tokens: int = 512,
    grid_blocks: Iterable[int] | None = None,
    out_dir: str | os.PathLike | None = None,
    cache: bool | str | os.PathLike = True,
    plots: bool = True,
    offload_dir: str | os.PathLike | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> SensitivityReport:
    """``fp4sense analyze``: analyze ``model`` and write sensitivity.json, report.md and
    plots into ``out_dir`` (when given). Results are cached (resumable) in the fp4sense
    cache, or in the folder ``cache`` names; ``cache=False`` turns that off."""
    from fp4sense.assets import cache_dir
    from fp4sense.report import write_analysis
    from fp4sense.sensitivity import analyze, check_request
    from fp4sense.validate import InputError, check_writable

    schemes = check_request(schemes, views, modes)  # bad input fails before loading
    cache_folder = (cache_dir() / "analysis" if cache is True else Path(cache) if cache
                    else None)
    if out_dir is not None:  # nothing is computed when the results cannot be written
        if Path(out_dir).exists() and not Path(out_dir).is_dir():
            raise InputError(f"--out {out_dir} is an existing file; choose a folder name")
        check_writable(Path(out_dir), "--out", "choose a folder you can write to")
    if cache_folder is not None:
        check_writable(cache_folder, "the analysis cache", "pass --no-cache, or point "
                       "FP4SENSE_CACHE at a writable folder")
    hf_model, tokenizer, notes = load_model(model)
    windows = analysis_windows(tokenizer, text, n_windows, window_tokens)
    report = analyze(
        hf_model, windows, schemes=schemes, views=views, modes=modes, grid_blocks=grid_blocks,
        cache_dir=cache_folder,
        text={"source": _text_source(text)},
        progress=progress, log=log, offload_dir=offload_dir,
    )
    if out_dir is not None:
        paths = write_analysis(report, Path(out_dir), notes=notes, plots=plots)
        for key, path in paths.items():
            log(f"{key:12s} {path}")
    return report


def _text_source(text: str | os.PathLike | None) -> str:
    """How reports name the analysis text (a file by its name, never its path)."""
    from fp4sense.lineage import public_name

    return public_name(text) if text is not None else "protocol calibration split"


# --- evaluation -----------------------------------------------------------------------
def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    text: str | os.PathLike | None = None,
    n_windows: int = 16,
    window_tokens: int = 512,
    as_served: bool = False,
    progress: bool = True,
) -> dict:
    """``fp4sense eval``: PPL, KL vs base and top-1 agreement on the evaluation windows,
    and the measured effective bits, of any compressed-tensors checkpoint (float32).

    :param base: the unquantized model (default: the one the checkpoint records).
    :param as_served: compute MXFP4A16 layers as W4A4, as vLLM serves them.

    The result names the checkpoint, base and text by name (Hub id, folder or file name),
    as files that may be shared do, never by their paths on this machine.
    """
    import json

    from fp4sense.checkpoint import check_checkpoint, checkpoint_tokenizer, effective_bits
    from fp4sense.data import PROTOCOL_EVAL_TEXT, protocol_windows
    from fp4sense.lineage import public_name
    from fp4sense.metrics import compare_models
    from fp4sense.quantized import load_checkpoint

    folder = Path(checkpoint)
    check_checkpoint(folder)
    tokenizer = checkpoint_tokenizer(folder)
    if base is None:
        base = _recorded_base(folder)
    windows = protocol_windows(tokenizer, "evaluation", n_windows, text, window_tokens)
    base_model, _, _ = load_model(base)
    _check_base_matches(folder, base_model, base)
    quant, act_layers, notes = load_checkpoint(folder, promote_mxfp4=as_served)
    comparison = compare_models(base_model, quant, windows,
                                desc="evaluating" if progress else "")
    bits = effective_bits(folder)
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    return {
        "checkpoint": folder.resolve().name, "base": public_name(base),
        **comparison.to_dict(),
        "effective_bits": bits["bits"], "linear_bytes": bits["bytes"],
        "format": qcfg.get("format"), "activation_quantized_layers": act_layers,
        "windows": n_windows, "window_tokens": window_tokens,
        "text": public_name(text) if text is not None else PROTOCOL_EVAL_TEXT,
        "notes": notes,
    }


def _check_base_matches(folder: Path, base_model: torch.nn.Module, base) -> None:
    """The base model has the checkpoint's architecture and shapes (else KL vs it is
    meaningless): one line naming both."""
    import json

    from fp4sense.validate import InputError

    saved = json.loads((folder / "config.json").read_text())
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size")
    config = base_model.config.to_dict()
    differ = [f"{k} {config.get(k)} vs {saved.get(k)}" for k in keys
              if k in saved and config.get(k) != saved.get(k)]
    if differ:
        raise InputError(f"base model {str(base)!r} is not the model {folder} was made from "
                         f"({'; '.join(differ)}); pass the right --base")


def _recorded_base(folder: Path) -> str:
    """The base model a checkpoint was made from: the local path fp4sense recorded on
    this machine, else the Hub id or folder plan.json and config.json name."""
    import json

    from fp4sense.lineage import is_hub_id, local_record

    candidates = [local_record(folder).get("base")]
    plan = folder / "plan.json"
    if plan.is_file():
        candidates.append(json.loads(plan.read_text()).get("model"))
    config = json.loads((folder / "config.json").read_text())
    candidates.append(config.get("_name_or_path"))
    for cand in candidates:
        if cand and Path(cand).is_dir() and (Path(cand) / "config.json").is_file():
            return cand
    for cand in candidates:
        if cand and is_hub_id(cand):
            return cand
    raise ValueError(f"{folder} does not name a base model that is on this machine "
                     f"(found {[c for c in candidates if c]}); pass --base MODEL")


# --- quantization ---------------------------------------------------------------------
def quantize_model(
    model: str | os.PathLike | None = None,
    *,
    out_dir: str | os.PathLike,
    budget_bits: float | None = None,
    budget_bytes: int | None = None,
    kl_target: float | None = None,
    menu: Sequence[str] = ("NVFP4", "FP8_DYNAMIC", "BF16"),
    sensitivity: str | os.PathLike | None = None,
    sensitivity_mode: str | None = None,
    pins: dict[str, str] | None = None,
    gptq: bool = False,
    base_model_id: str | None = None,
    text: str | os.PathLike | None = None,
    calib_windows: int = 32,
    estimate_windows: int = DEFAULT_ANALYSIS_WINDOWS,
    window_tokens: int = 512,
    evaluate: bool = True,
    eval_windows: int = 16,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """``fp4sense quantize``: plan under the budget and quantize with llm-compressor's
    oneshot (SensitivityGuidedModifier, optionally + GPTQModifier), writing the
    compressed checkpoint with plan.json, sensitivity.json, recipe.yaml and a model card.

    ``base_model_id`` names the base model's Hub id for the model card's lineage
    (``base_model``) where it cannot be derived (a local folder outside the Hugging Face
    cache). Shared files name the base and the text without local paths (see
    :mod:`fp4sense.lineage`).

    Works in a temporary folder beside ``out_dir`` and renames it at the end, so an
    interrupted run never leaves a checkpoint that looks complete. Without
    ``overwrite`` a non-empty ``out_dir`` is refused before anything runs.
    """
    import shutil
    import tempfile
    import time

    from fp4sense.assets import default_model_path
    from fp4sense.lineage import hub_id_of, public_name, write_local_record
    from fp4sense.planner import plan_cost, solve
    from fp4sense.schemes import get_scheme
    from fp4sense.sensitivity import analyze
    from fp4sense.validate import check_output_folder, remove_dead_partials, write_owner

    out = Path(out_dir)
    # the user's model is never the output, nor inside it, nor holding it
    base_path = default_model_path() if model is None else Path(model)
    check_output_folder(out, overwrite=overwrite,
                        protected=[base_path] if base_path.exists() else [])
    menu = [get_scheme(s).name for s in menu]
    if base_model_id is not None:
        hub_id_of("", base_model_id)  # a malformed id fails before anything runs
    if sum(x is not None for x in (budget_bits, budget_bytes, kl_target)) != 1:
        raise ValueError("give exactly one of --budget, --budget-bytes, --kl-target")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    hf_model, tokenizer, notes = load_model(model)
    source = str(model) if model is not None else hf_model.config._name_or_path
    hub_id = hub_id_of(source, base_model_id)
    calib = analysis_windows(tokenizer, text, calib_windows, window_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    for note in remove_dead_partials(out.parent, out.name):
        log(f"note: {note}")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    work.chmod(0o777 & ~umask)  # a normal folder once published, not mkdtemp's 0700
    try:
        write_owner(work)  # a later run may remove this folder once this process is gone
        if sensitivity is not None:
            from fp4sense.sensitivity import SensitivityReport
            from fp4sense.units import model_fingerprint

            report = SensitivityReport.load(sensitivity, model_fingerprint(hf_model))
        else:
            t = time.perf_counter()
            quantized = [s for s in menu if get_scheme(s).quantizes]
            report = analyze(hf_model, calib[:estimate_windows], schemes=quantized,
                             views=["grid"], modes=["estimated"], cache_dir=None,
                             text={"source": _text_source(text)},
                             progress=progress, log=log)
            timings["sensitivity_s"] = time.perf_counter() - t
        # shared files name the base and the text, not their paths here
        report.model = public_name(report.model, hub_id)
        report.text["source"] = public_name(report.text.get("source"))
        report.save(work / "sensitivity.json")
        lo, hi = plan_cost(report.units, menu)
        plan = solve(report, budget_bits=budget_bits, budget_bytes=budget_bytes,
                     kl_target=kl_target, menu=menu, pins=pins, mode=sensitivity_mode)
        log(f"plan: {plan.schemes()}, {plan.bits:.3f} bits per weight (menu reaches "
            f"{lo:.2f}–{hi:.2f}), predicted KL {plan.predicted_kl:.4f}")
        _check_plan_quantizes(plan, budget_bits, budget_bytes, lo, hi,
                              sum(u.numel for u in report.units.units), log)
        del hf_model

        plan.save(work / "plan.json")  # solved once: the modifier applies this file
        t = time.perf_counter()
        recipe = _oneshot_plan(source, calib, work, plan="plan.json", gptq=gptq)
        timings["oneshot_s"] = time.perf_counter() - t
        tokenizer.save_pretrained(work)
        (work / "recipe.yaml").write_text(recipe)

        result = {"plan": {"schemes": plan.schemes(), "bits_theory": plan.bits,
                           "predicted_kl": plan.predicted_kl, "score": plan.score}}
        if evaluate:
            t = time.perf_counter()
            result["eval"] = evaluate_checkpoint(work, base=source, n_windows=eval_windows,
                                                 window_tokens=window_tokens,
                                                 progress=progress)
            result["eval"]["checkpoint"] = out.resolve().name
            result["eval"]["base"] = public_name(source, hub_id)
            timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0
        result["timings"] = {k: round(v, 1) for k, v in timings.items()}
        from fp4sense.model_card import write_model_card

        write_local_record(work, base=source, text=text)
        write_model_card(work, plan, result.get("eval"), source=source, hub_id=hub_id,
                         notes=notes,
                         gptq=gptq, name=out.name)
        (work / "fp4sense-quantize.json").write_text(json.dumps(result, indent=1))
        # publish: the finished folder replaces out_dir in one rename
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(trash / out.name)
            work.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    result["out"] = str(out)
    return result


def _check_plan_quantizes(plan, budget_bits: float | None, budget_bytes: int | None,
                          lo: float, hi: float, numel: int, log: Callable[[str], None]) -> None:
    """A budget above what the menu can use plans at the menu's top (said in a note); a
    plan that quantizes nothing is refused: it would not be a quantized checkpoint."""
    from fp4sense.planner import PlanError
    from fp4sense.schemes import get_scheme

    asked = budget_bits if budget_bits is not None else (
        budget_bytes * 8 / numel if budget_bytes is not None else None)
    if asked is not None and asked > hi + 1e-9:
        log(f"note: the budget ({asked:.3f} bits per weight) is above what the menu can use "
            f"({hi:.3f}); planned at the menu's top")
    if not any(get_scheme(c.scheme).quantizes for c in plan.choices):
        raise PlanError(
            f"the plan leaves every unit in BF16, so nothing would be quantized; give a "
            f"budget below {hi:.3f} bits per weight (the menu reaches {lo:.3f}–{hi:.3f}) or "
            "drop BF16 from the menu")


def _oneshot_plan(source: str, calib: torch.Tensor, work: Path, *, plan: str, gptq: bool
                  ) -> str:
    """Apply the plan saved as ``work / plan`` with the registered quantizer (the
    llm-compressor plugin's oneshot); return the recipe YAML that reproduces it."""
    from fp4sense.hosts import quantizer

    return quantizer()(source, calib, work, plan=plan, gptq=gptq)
