"""The Python API behind the CLI: one function per command, same arguments, same files.

>>> from fp4sense.api import analyze_model
>>> report = analyze_model(schemes=["NVFP4", "MXFP4"], views=["component", "block"],
...                        out_dir="analysis")          # doctest: +SKIP

``quantize_model`` (:mod:`fp4sense.quantization.pipeline`), ``evaluate_checkpoint``
(:mod:`fp4sense.evaluation.evaluate`) and ``load_model`` / ``analysis_windows``
(:mod:`fp4sense.inputs.models`) are importable from here as well.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from fp4sense.diagnosis import SensitivityReport
from fp4sense.evaluation.evaluate import evaluate_checkpoint
from fp4sense.inputs.models import (
    BUNDLED_MODEL_NOTE,
    DEFAULT_ANALYSIS_WINDOWS,
    analysis_windows,
    load_model,
)
from fp4sense.publishing.lineage import text_name
from fp4sense.quantization.pipeline import quantize_model

__all__ = ["BUNDLED_MODEL_NOTE", "analysis_windows", "analyze_model", "evaluate_checkpoint",
           "load_model", "quantize_model"]


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
    from fp4sense.diagnosis import analyze, check_request
    from fp4sense.inputs.assets import cache_dir
    from fp4sense.reports.analysis import write_analysis
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
        text={"source": text_name(text)},
        progress=progress, log=log, offload_dir=offload_dir,
    )
    if out_dir is not None:
        paths = write_analysis(report, Path(out_dir), notes=notes, plots=plots)
        for key, path in paths.items():
            log(f"{key:12s} {path}")
    return report
