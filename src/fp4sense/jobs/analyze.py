"""The analyze command's run (``fp4sense analyze``, :func:`analyze_model`): check the
request, place it, load the model and the windows, analyze (:func:`fp4sense.diagnosis.
views.analyze`), and write the report; the same steps under torchrun, rank 0 writing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from fp4sense import defaults, options
from fp4sense.diagnosis.results import SensitivityReport
from fp4sense.diagnosis.views import analyze, check_request
from fp4sense.inputs.assets import default_model_path
from fp4sense.inputs.models import analysis_windows as calibration_windows
from fp4sense.inputs.models import load_model
from fp4sense.inputs.texts import model_context, window_prefix
from fp4sense.numerics.metrics import implausible
from fp4sense.reports.analysis import write_analysis
from fp4sense.runtime import distributed
from fp4sense.runtime.devices import resolve
from fp4sense.runtime.outputs import check_analysis_output, local_inputs, record_written
from fp4sense.structure.lineage import text_name
from fp4sense.structure.offload import check_offload_dir
from fp4sense.validate import renamed_keywords

__all__ = ["analyze_model"]


@renamed_keywords(n_windows="analysis_windows")
def analyze_model(
    model: str | os.PathLike | None = None,
    *,
    text: str | os.PathLike | None = None,
    schemes: Sequence[str] = ("NVFP4", "MXFP4"),
    views: Sequence[str] = ("component", "block"),
    modes: Sequence[str] = ("measured",),
    analysis_windows: int = defaults.ANALYSIS_WINDOWS,
    window_tokens: int = defaults.WINDOW_TOKENS,
    raw_windows: bool = False,
    grid_blocks: Iterable[int] | None = None,
    out_dir: str | os.PathLike | None = None,
    cache: bool | str | os.PathLike = True,
    plots: bool = True,
    offload_dir: str | os.PathLike | None = None,
    low_memory: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> SensitivityReport:
    """``fp4sense analyze``: analyze ``model`` and write sensitivity.json, report.md and
    plots into ``out_dir`` (when given). Results are cached (resumable) in the fp4sense
    cache, or in the folder ``cache`` names; ``cache=False`` turns that off.

    ``device`` (auto, cpu, cuda, cuda:N) and ``dtype`` (float32, bfloat16) say where it
    computes (default: the protocol's CPU float32). Under torchrun the ranks share the
    work through torch.distributed, and rank 0 writes ``out_dir``. ``low_memory`` holds
    one decoder block's weights at a time, read from the model's own safetensors files
    (``offload_dir`` does the same from copies, for models whose files cannot be read
    so). ``raw_windows``: windows of text tokens only, without the tokens the tokenizer
    starts a sequence with (:func:`fp4sense.inputs.texts.make_windows`)."""
    options.check(options.ANALYZE, locals(), "analyze_model")  # as the flags are
    schemes = check_request(schemes, views, modes)  # bad input fails before loading
    placement = resolve(device, dtype, log=log)
    cache_folder = check_analysis_output(out_dir, cache,
                                         local_inputs(model or default_model_path(), text))
    if offload_dir is not None:
        check_offload_dir(Path(offload_dir))
    distributed.init_from_env(placement.device)
    if not distributed.is_main():
        log = _quiet  # rank 0 speaks for the run
        progress = False
    # offloaded blocks are loaded onto the device one at a time; the rest moves there
    hf_model, tokenizer, notes = load_model(
        model, placement.dtype, "cpu" if offload_dir is not None else placement.device,
        low_memory=low_memory)
    windows = calibration_windows(tokenizer, text, analysis_windows, window_tokens, raw_windows,
                                  model_context(hf_model.config), log)
    report = analyze(
        hf_model, windows, schemes=schemes, views=views, modes=modes, grid_blocks=grid_blocks,
        cache_dir=cache_folder,
        text={"source": text_name(text),
              "window_prefix": window_prefix(tokenizer, raw_windows)},
        progress=progress, log=log, offload_dir=offload_dir, device=placement.device,
    )
    warning = implausible(report.base_ppl, hf_model.config.get_text_config().vocab_size)
    if warning:
        log(warning)
    if out_dir is not None and distributed.is_main():
        paths = write_analysis(report, Path(out_dir), notes=notes, plots=plots)
        record_written(Path(out_dir), paths.values())  # what it wrote, none of the user's
        for key, path in paths.items():
            log(f"{key:12s} {path}")
    return report


def _quiet(message: str) -> None:
    """The log of ranks other than 0."""
