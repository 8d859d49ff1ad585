"""The Python API behind the CLI: one function per command, same arguments, same files.

>>> from fp4sense.api import analyze_model
>>> report = analyze_model(schemes=["NVFP4", "MXFP4"], views=["component", "block"],
...                        out_dir="analysis")          # doctest: +SKIP
"""

from __future__ import annotations

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
    """(model, tokenizer, notes) for a hub id or local folder; None = the bundled model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    notes: list[str] = []
    if source is None:
        from fp4sense.assets import ensure_model

        source = ensure_model(log=lambda msg: None)
        notes.append(BUNDLED_MODEL_NOTE)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load model {str(source)!r} as a causal LM: "
                         f"{str(exc).splitlines()[0]}") from None
    return model, tokenizer, notes


def analysis_windows(tokenizer, text: str | os.PathLike | None = None, n_windows: int =
                     DEFAULT_ANALYSIS_WINDOWS, window_tokens: int = 512) -> torch.Tensor:
    """Analysis windows: the protocol's calibration split, or ``text`` (a file path or
    ``dataset:NAME[:CONFIG][:SPLIT]``). Never the evaluation split."""
    from fp4sense.data import load_text, make_windows

    what = str(text) if text is not None else "the calibration split"
    return make_windows(tokenizer, load_text(text, "calibration"), n_windows, window_tokens,
                        what=what)


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
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> SensitivityReport:
    """``fp4sense analyze``: analyze ``model`` and write sensitivity.json, report.md and
    plots into ``out_dir`` (when given). Results are cached (resumable) in the fp4sense
    cache, or in the folder ``cache`` names; ``cache=False`` turns that off."""
    from fp4sense.assets import cache_dir
    from fp4sense.report import write_analysis
    from fp4sense.sensitivity import analyze, check_request

    schemes = check_request(schemes, views, modes)  # bad input fails before loading
    hf_model, tokenizer, notes = load_model(model)
    windows = analysis_windows(tokenizer, text, n_windows, window_tokens)
    report = analyze(
        hf_model, windows, schemes=schemes, views=views, modes=modes, grid_blocks=grid_blocks,
        cache_dir=(cache_dir() / "analysis" if cache is True else Path(cache) if cache
                   else None),
        text={"source": str(text) if text is not None else "protocol calibration split"},
        progress=progress, log=log,
    )
    if out_dir is not None:
        paths = write_analysis(report, Path(out_dir), notes=notes, plots=plots)
        for key, path in paths.items():
            log(f"{key:12s} {path}")
    return report
