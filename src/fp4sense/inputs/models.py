"""Loading the model to analyze, quantize or compare against, with every check that
makes a bad model one clear line; and the analysis windows of a text."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fp4sense import defaults
from fp4sense.inputs.assets import ensure_model
from fp4sense.inputs.texts import protocol_windows
from fp4sense.structure.lineage import is_hub_id
from fp4sense.structure.offload import BlockStore
from fp4sense.structure.units import find_blocks
from fp4sense.validate import InputError

__all__ = ["BUNDLED_MODEL_NOTE", "DEFAULT_ANALYSIS_WINDOWS", "STORED_DTYPES", "analysis_windows",
           "load_model", "quantization_dtypes", "stored_dtype"]

#: Printed beside every figure measured on the bundled model (protocol.md).
BUNDLED_MODEL_NOTE = ("The bundled SmolLM2-135M-Instruct weights were Q4_1-quantized (GGUF) "
                      "before fp4sense got them; figures are relative to that model.")
#: dtypes a base model's files may store its weights in (a checkpoint of other tensors,
#: e.g. already quantized, is no base to quantize)
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The way out when --low-memory cannot read a model block by block, per command.
ANALYZE_INSTEAD = "use --offload-dir DIR instead (blocks are copied there, experts split)"
QUANTIZE_INSTEAD = "drop --low-memory (the estimate then holds the whole model in memory)"

#: Analysis windows by default: the protocol's quick analysis (8 calibration windows).
DEFAULT_ANALYSIS_WINDOWS = defaults.ANALYSIS_WINDOWS


def load_model(source: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", low_memory: bool = False,
               instead: str = ANALYZE_INSTEAD):
    """(model, tokenizer, notes) for a hub id or local folder; None = the bundled model;
    in ``dtype`` on ``device`` (a resolved one, :func:`fp4sense.runtime.devices.resolve`).

    Refuses, in one line naming the culprit: a folder that does not exist, weights that
    cannot be read (truncated, corrupt), a model that is not a decoder-only causal LM
    (weights transformers would initialize at random), and NaN/Inf weights (by module).

    ``low_memory``: only the weights outside the decoder blocks are loaded; each block's
    are read from the model's own safetensors files when the block runs, and dropped
    after (``model.fp4sense_blocks``, a :class:`~fp4sense.structure.offload.BlockStore`;
    nothing is copied). Memory then holds one block, not the model. A model that cannot
    be read so is refused in one line ending with ``instead``: the caller's way out."""


    notes: list[str] = []
    if source is None:

        source = ensure_model(log=lambda msg: None)
        notes.append(BUNDLED_MODEL_NOTE)
    text = str(source)
    looks_local = os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1
    if not Path(text).exists() and (looks_local or ("/" in text and not is_hub_id(text))):
        raise InputError(f"model {text!r} not found: no such folder here, and not a Hub id "
                         "(ORG/NAME); pass a model folder or a Hub id")
    try:
        files_dtype = stored_dtype(source)
        if low_memory:
            model, info = _load_without_blocks(source, dtype, instead)
        else:
            model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype,
                                                               output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except InputError:
        raise
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
    # what the checkpoint will store unquantized tensors in (the files', not the compute's)
    model.fp4sense_stored_dtype = files_dtype
    if low_memory:
        _attach_blocks(model, source, text, dtype, device, instead)
    else:
        from fp4sense.inputs.moe import linearize_experts

        linearize_experts(model, text)  # MoE: per-expert linears, as the host saves them
        _check_finite(model, text)  # (low memory: each block is read when it runs)
    if torch.device(device) != model.device:
        model.to(device)
    return model, tokenizer, notes


def stored_dtype(source: str | os.PathLike) -> torch.dtype:
    """The dtype the files of ``source`` (a folder or Hub id) store its weights in, from
    its config (float32 where the config names none, as transformers then assumes).
    Refuses, in one line, a checkpoint that is already quantized or stores another dtype."""


    config = AutoConfig.from_pretrained(source)
    if getattr(config, "quantization_config", None):
        raise InputError(f"model {str(source)!r} is already quantized (its config.json has a "
                         "quantization_config); give the unquantized base model")
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if named is None or named == "auto":
        return torch.float32
    name = str(named).removeprefix("torch.")
    if name not in STORED_DTYPES:
        raise InputError(f"model {str(source)!r} stores its weights in {name}; fp4sense "
                         f"quantizes models stored in {', '.join(STORED_DTYPES)}")
    return STORED_DTYPES[name]


def quantization_dtypes(model: torch.nn.Module) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype ``model``'s weights are quantized in, the dtype FP8 / INT scales are
    stored in): its compute dtype, the one the host's oneshot calibrates in; and its
    files' dtype (:func:`stored_dtype`, as :func:`load_model` recorded it; the compute
    dtype for a model built in memory)."""
    compute = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return compute, getattr(model, "fp4sense_stored_dtype", compute)


def _weight_files(source) -> dict[str, Path]:
    """tensor name -> safetensors file of a model folder (or Hub snapshot)."""

    folder = Path(source)
    if not folder.is_dir():

        folder = Path(snapshot_download(str(source), allow_patterns=["*.json",
                                                                      "*.safetensors"]))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), "pt") as fh:
        return dict.fromkeys(fh.keys(), single)


def _load_without_blocks(source, dtype: torch.dtype, instead: str):
    """The model with its weights outside the decoder blocks loaded and its blocks on
    the meta device (built with the full config, each with its index)."""


    config = AutoConfig.from_pretrained(source)
    text = config.get_text_config()
    n_blocks, layer_types = text.num_hidden_layers, getattr(text, "layer_types", None)
    small = copy.deepcopy(config)
    small_text = small.get_text_config()
    small_text.num_hidden_layers = 1
    if layer_types is not None:
        small_text.layer_types = list(layer_types[:1])
    quiet = logging.getLogger("transformers.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the other blocks' weights are unused here, by design
    try:
        model, info = AutoModelForCausalLM.from_pretrained(source, config=small, dtype=dtype,
                                                           output_loading_info=True)
    finally:
        quiet.setLevel(level)
    # the configs the model's modules hold (transformers copies the one given): all blocks
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if c is not None}
    for c in configs.values():
        for cfg in {id(c): c, id(c.get_text_config()): c.get_text_config()}.values():
            if getattr(cfg, "num_hidden_layers", None) == 1:
                cfg.num_hidden_layers = n_blocks
                if layer_types is not None:
                    cfg.layer_types = list(layer_types)
    from fp4sense.inputs.moe import fused_experts

    if fused_experts(model):

        raise InputError(f"model {str(source)!r} keeps its experts as 3-D parameters, which "
                         f"--low-memory cannot read block by block yet: {instead}")
    blocks_path, blocks = find_blocks(model)
    parent = model.get_submodule(blocks_path.rpartition(".")[0])
    block_config = getattr(parent, "config", model.config).get_text_config()
    block_class = type(blocks[0])
    with torch.device("meta"):
        built = [block_class(block_config, layer_idx=i).to(dtype) for i in range(n_blocks)]
    for block in built:  # empty parameters until a block runs (meta ones cannot be set)
        for module in block.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    module._parameters[name] = torch.nn.Parameter(
                        torch.empty(0, dtype=param.dtype), requires_grad=param.requires_grad)
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                raise ValueError(f"{block_class.__name__} keeps buffers of its own; fp4sense "
                                 f"cannot build its blocks without loading them: {instead}")
    for i, block in enumerate(built):
        if i < len(blocks):
            blocks[i] = block
        else:
            blocks.append(block)
    return model, info


def _attach_blocks(model, source, text: str, dtype: torch.dtype,
                   device: str | torch.device = "cpu", instead: str = "") -> None:
    """Read each block's weights from the model's files when it runs (one line naming the
    first weight that is not in them, and the way out)."""

    files = _weight_files(source)
    blocks_path, blocks = find_blocks(model)
    names = [f"{blocks_path}.{i}.{n}" for i, b in enumerate(blocks)
             for n, _ in b.named_parameters()]
    absent = [n for n in names if n not in files]
    if absent:
        raise InputError(f"model {text!r} cannot be read block by block from its safetensors "
                         f"files: {absent[0]} is not stored under that name"
                         f"{f' ({len(absent)} weights)' if len(absent) > 1 else ''}; "
                         f"{instead}")
    model.fp4sense_blocks = BlockStore(model, blocks_path, device=device, files=files,
                                       dtype=dtype)


def _check_finite(model: torch.nn.Module, source: str) -> None:
    """One line naming the modules whose weights hold NaN or Inf."""

    bad = [(name, int((~torch.isfinite(p)).sum())) for name, p in model.named_parameters()
           if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        shown = ", ".join(f"{name.removesuffix('.weight')} ({n} NaN/Inf)"
                          for name, n in bad[:3])
        raise InputError(f"model {source!r} has non-finite weights in {shown}"
                         f"{', ...' if len(bad) > 3 else ''}; fix or re-download the "
                         "checkpoint")


def analysis_windows(tokenizer, text: str | os.PathLike | None = None, n_windows: int =
                     DEFAULT_ANALYSIS_WINDOWS, window_tokens: int = defaults.WINDOW_TOKENS,
                     raw: bool = False, context: int | None = None,
                     log: Callable[[str], None] | None = None) -> torch.Tensor:
    """Analysis windows: the protocol's calibration split, or ``text`` (a file path or
    ``dataset:NAME[:CONFIG][:SPLIT]``). Never the evaluation split. Each starts as the
    tokenizer starts a sequence, unless ``raw`` (:func:`fp4sense.inputs.texts.make_windows`)."""

    return protocol_windows(tokenizer, "calibration", n_windows, text, window_tokens, raw,
                            context, log)
