"""The Python API: one function per command, with the command line's arguments and
files, imported when first used (``import fp4sense.api`` loads none of torch).

>>> from fp4sense.api import analyze_model
>>> report = analyze_model(schemes=["NVFP4", "MXFP4"], views=["component", "block"],
...                        out_dir="analysis")          # doctest: +SKIP

=====================  ==============  ===========================================
name                   command         defined in
=====================  ==============  ===========================================
``analyze_model``      analyze         :mod:`fp4sense.jobs.analyze`
``quantize_model``     quantize        :mod:`fp4sense.jobs.quantize`
``evaluate_checkpoint`` eval           :mod:`fp4sense.jobs.evaluate`
``analyze_training``   analyze-training :mod:`fp4sense.jobs.analyze_training`
``train_trial``        train-trial     :mod:`fp4sense.jobs.train_trial`
``apply_training_      (training, in   :mod:`fp4sense.numerics.training_linear`
policy``               a user's loop)
``FP4TrainingMonitor`` (a transformers :mod:`fp4sense.training.callback`
                       Trainer)
``verify_vllm``        verify-vllm     :mod:`fp4sense.evaluation.vllm_check`
``check_folder``,      push            :mod:`fp4sense.publishing.hub`
``push``
``convert_gguf``       convert-gguf    :mod:`fp4sense.inputs.gguf`
``ensure_assets``      setup           :mod:`fp4sense.inputs.assets`
``load_model``,        (the inputs)    :mod:`fp4sense.inputs.models`
``analysis_windows``,
``BUNDLED_MODEL_NOTE``
=====================  ==============  ===========================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from fp4sense.evaluation.vllm_check import verify_vllm
    from fp4sense.inputs.assets import ensure_assets
    from fp4sense.inputs.gguf import convert_gguf
    from fp4sense.inputs.models import BUNDLED_MODEL_NOTE, analysis_windows, load_model
    from fp4sense.jobs.analyze import analyze_model
    from fp4sense.jobs.analyze_training import analyze_training
    from fp4sense.jobs.evaluate import evaluate_checkpoint
    from fp4sense.jobs.quantize import quantize_model
    from fp4sense.jobs.train_trial import train_trial
    from fp4sense.numerics.training_linear import apply_training_policy
    from fp4sense.publishing.hub import check_folder, push
    from fp4sense.training.callback import FP4TrainingMonitor

__all__ = ["BUNDLED_MODEL_NOTE", "FP4TrainingMonitor", "analysis_windows", "analyze_model",
           "analyze_training", "apply_training_policy", "check_folder", "convert_gguf",
           "ensure_assets", "evaluate_checkpoint", "load_model", "push", "quantize_model",
           "train_trial", "verify_vllm"]


def _run():
    from fp4sense.jobs import analyze as run
    return run


def _pipeline():
    from fp4sense.jobs import quantize as pipeline
    return pipeline


def _evaluate():
    from fp4sense.jobs import evaluate
    return evaluate


def _vllm_check():
    from fp4sense.evaluation import vllm_check
    return vllm_check


def _hub():
    from fp4sense.publishing import hub
    return hub


def _gguf():
    from fp4sense.inputs import gguf
    return gguf


def _assets():
    from fp4sense.inputs import assets
    return assets


def _models():
    from fp4sense.inputs import models
    return models


def _training():
    from fp4sense.jobs import analyze_training
    return analyze_training


def _trial():
    from fp4sense.jobs import train_trial
    return train_trial


def _linear():
    from fp4sense.numerics import training_linear
    return training_linear


def _callback():
    from fp4sense.training import callback
    return callback


#: public name -> the function returning the module that defines it
_WHERE = {"analyze_model": _run, "quantize_model": _pipeline,
          "evaluate_checkpoint": _evaluate, "verify_vllm": _vllm_check,
          "check_folder": _hub, "push": _hub, "convert_gguf": _gguf,
          "ensure_assets": _assets, "load_model": _models, "analysis_windows": _models,
          "BUNDLED_MODEL_NOTE": _models, "analyze_training": _training,
          "train_trial": _trial, "apply_training_policy": _linear,
          "FP4TrainingMonitor": _callback}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'fp4sense.api' has no attribute {name!r}")
    value = getattr(_WHERE[name](), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
