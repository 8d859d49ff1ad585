"""Reading and checking a compressed-tensors checkpoint folder, before any heavy work:
one checker shared by eval, push, verify-vllm and the vLLM comparison, and the measured
effective bits (from the safetensors headers, no weights loaded)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from compressed_tensors.utils.match import match_name
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer

from fp4sense.validate import UserError

__all__ = ["TOKENIZER_CONFIG", "VOCABULARIES", "CheckpointError", "check_checkpoint",
           "checkpoint_tokenizer", "effective_bits", "tensor_index", "transform_modules"]

TOKENIZER_CONFIG = "tokenizer_config.json"
VOCABULARIES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
# what each stored format keeps per quantized module: tensor -> (dtypes, shape from the
# module's (out, in) weight shape); the block sizes are the formats' (design.md)
_STORED = {
    "nvfp4-pack-quantized": {
        "weight_packed": (("U8",), lambda o, i: [o, i // 2]),
        "weight_scale": (("F8_E4M3",), lambda o, i: [o, i // 16]),
        "weight_global_scale": (("F32",), lambda o, i: [1]),
    },
    "mxfp4-pack-quantized": {
        "weight_packed": (("U8",), lambda o, i: [o, i // 2]),
        "weight_scale": (("U8",), lambda o, i: [o, i // 32]),
    },
    "float-quantized": {
        "weight": (("F8_E4M3",), lambda o, i: [o, i]),
        "weight_scale": (("BF16", "F16", "F32"), lambda o, i: [o, 1]),
    },
}


class CheckpointError(UserError, ValueError):
    """The checkpoint folder is missing, corrupt or inconsistent (names what and where)."""


def _stored_tensors(path: Path) -> dict[str, dict]:
    """name -> {dtype, shape, nbytes} of one safetensors file, read with safetensors'
    own reader (which also refuses a file that does not hold every byte it declares)."""

    out = {}
    try:
        with safe_open(path, framework="pt") as fh:
            for key in fh.keys():
                part = fh.get_slice(key)
                shape = list(part.get_shape())
                # an empty slice has the tensor's element size without reading its data
                size = (part[0:0] if shape else fh.get_tensor(key)).element_size()
                out[key] = {"dtype": part.get_dtype(), "shape": shape,
                            "nbytes": math.prod(shape) * size}
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc}); "
                              "re-copy or re-create it") from None
    return out


def tensor_index(folder: Path) -> dict[str, dict]:
    """tensor name -> {dtype, shape, nbytes, file}, over every weight file the folder
    declares (headers only: no weights are loaded)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
        weight_map = None
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors weight files")
    tensors: dict[str, dict] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: weight file {name} listed in the index is missing")
        for key, entry in _stored_tensors(path).items():
            tensors[key] = {**entry, "file": name}
    if weight_map is not None:
        missing = [k for k in weight_map if k not in tensors]
        if missing:
            raise CheckpointError(f"{folder}: index lists tensors not in any file: {missing[:3]}")
    return tensors


def check_checkpoint(folder: str | os.PathLike) -> dict:
    """Check a compressed-tensors checkpoint folder; return its quantization_config.

    Raises :class:`CheckpointError` naming the file, group, module or tensor at fault.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} not found")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json; not a Hugging Face checkpoint")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
    qcfg = config.get("quantization_config") or config.get("compression_config")
    if not qcfg or qcfg.get("quant_method") != "compressed-tensors":
        raise CheckpointError(
            f"{config_path}: no compressed-tensors quantization_config; quantize the model "
            "with llm-compressor (or fp4sense) first"
        )
    tensors = tensor_index(folder)
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight", ".weight_packed"))}
    ignore = qcfg.get("ignore") or []
    for group_name, group in (qcfg.get("config_groups") or {}).items():
        targets = group.get("targets") or []
        # class-name targets (e.g. "Linear") cannot be resolved without the model: names
        # and regexes must match a module that the checkpoint stores
        named = [t for t in targets if t.startswith("re:") or "." in t]
        if named and not any(match_name(m, t) for t in named for m in modules
                             if not any(match_name(m, i) for i in ignore)):
            raise CheckpointError(
                f"{config_path}: config group {group_name!r} targets {named} but names no "
                "module stored in the checkpoint"
            )
    global_format = qcfg.get("format")
    formats_in_use = {g.get("format") or global_format
                      for g in (qcfg.get("config_groups") or {}).values()}
    for module in sorted(modules):
        packed = f"{module}.weight_packed" in tensors
        fp8 = tensors.get(f"{module}.weight", {}).get("dtype") in ("F8_E4M3", "F8_E5M2")
        if (packed or fp8) and f"{module}.weight_scale" not in tensors:
            raise CheckpointError(f"{folder}: {module} has no weight_scale tensor")
        scale = tensors.get(f"{module}.weight_scale", {})
        if packed and scale.get("dtype") == "F8_E4M3" and "nvfp4-pack-quantized" in \
                formats_in_use and f"{module}.weight_global_scale" not in tensors:
            raise CheckpointError(f"{folder}: {module} has no weight_global_scale tensor")
        if packed or fp8:
            _check_stored(folder, module, tensors)
            _check_group(config_path, qcfg, module, tensors)
    return qcfg


def _group_of(qcfg: dict, module: str) -> tuple[str, dict] | None:
    """The config group that quantizes ``module``: one naming it (a name or ``re:``)
    before one by class name (``Linear``); None when none does or it is ignored."""
    if any(match_name(module, i) for i in qcfg.get("ignore") or []):
        return None
    by_class = None
    for name, group in (qcfg.get("config_groups") or {}).items():
        for t in group.get("targets") or []:
            if t.startswith("re:") or "." in t:
                if match_name(module, t):
                    return name, group
            elif by_class is None:
                by_class = (name, group)
    return by_class


def _check_group(config_path: Path, qcfg: dict, module: str, tensors: dict) -> None:
    """The config group that targets a stored quantized module says what its tensors are:
    the format, the bits, the group size of the stored scales, and whether its input
    activations are quantized with a stored global scale (NVFP4 W4A4). A config that
    says otherwise would be loaded as something else (e.g. W4A4 evaluated as weight-only)."""
    found = _group_of(qcfg, module)
    if found is None:
        raise CheckpointError(f"{config_path}: {module} is stored quantized, but no config "
                              "group quantizes it (or it is ignored); config.json does not "
                              "match the weights")
    name, group = found
    packed = tensors.get(f"{module}.weight_packed")
    stored = ("float-quantized" if packed is None else "nvfp4-pack-quantized"
              if f"{module}.weight_global_scale" in tensors else "mxfp4-pack-quantized")
    said = group.get("format") or qcfg.get("format")
    weights = group.get("weights") or {}
    problem = None
    if said not in (stored, "mixed-precision", None):
        problem = f"says format {said}, the tensors are {stored}"
    elif weights.get("num_bits") not in (None, 4 if packed is not None else 8):
        problem = f"says {weights.get('num_bits')}-bit weights, the tensors are {stored}"
    elif packed is not None and weights.get("group_size") not in (
            None, packed["shape"][1] * 2 // tensors[f"{module}.weight_scale"]["shape"][1]):
        problem = (f"says group size {weights.get('group_size')}, the stored scales are one "
                   f"per {packed['shape'][1] * 2 // tensors[f'{module}.weight_scale']['shape'][1]}"
                   " weights")
    else:
        acts = group.get("input_activations")
        has_input_scale = f"{module}.input_global_scale" in tensors
        if has_input_scale and not acts:
            problem = ("quantizes no input activations, but the tensors store an "
                       "input_global_scale (W4A4)")
        elif (stored == "nvfp4-pack-quantized" and acts and acts.get("dynamic") is not True
              and not has_input_scale):
            problem = "quantizes input activations with a stored global scale, but none is stored"
    if problem:
        raise CheckpointError(f"{config_path}: config group {name!r} (targeting {module}) "
                              f"{problem}; config.json does not match the weights: restore "
                              "it or quantize again")


def _check_stored(folder: Path, module: str, tensors: dict[str, dict]) -> None:
    """The tensors of one quantized module have the dtypes and shapes their format
    implies, and finite, positive scales (read from the file: scales are small)."""
    packed = tensors.get(f"{module}.weight_packed")
    if packed is not None:
        fmt = ("nvfp4-pack-quantized" if f"{module}.weight_global_scale" in tensors
               else "mxfp4-pack-quantized")
        out, inp = packed["shape"][0], packed["shape"][1] * 2  # two E2M1 codes per byte
    else:
        fmt = "float-quantized"
        out, inp = tensors[f"{module}.weight"]["shape"]
    for name, (dtypes, shape_of) in _STORED[fmt].items():
        entry = tensors.get(f"{module}.{name}")
        if entry is None:
            raise CheckpointError(f"{folder}: {module} has no {name} tensor ({fmt})")
        if entry["dtype"] not in dtypes:
            raise CheckpointError(f"{folder}: {module}.{name} is stored as {entry['dtype']}, "
                                  f"{fmt} stores it as {' or '.join(dtypes)}; the checkpoint "
                                  "is damaged: quantize again")
        if list(entry["shape"]) != shape_of(out, inp):
            raise CheckpointError(f"{folder}: {module}.{name} has shape {entry['shape']}, "
                                  f"{fmt} needs {shape_of(out, inp)} for a {out}x{inp} "
                                  "weight; the checkpoint is damaged: quantize again")
    for name in ("weight_global_scale",) + (("weight_scale",) if fmt == "float-quantized"
                                            else ()):
        if f"{module}.{name}" in tensors:
            value = _read_tensor(folder, tensors[f"{module}.{name}"], f"{module}.{name}")
            if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                raise CheckpointError(f"{folder}: {module}.{name} holds a NaN, infinite, zero "
                                      "or negative scale; the checkpoint is damaged: quantize "
                                      "again")


def _read_tensor(folder: Path, entry: dict, name: str) -> torch.Tensor:
    with safe_open(folder / entry["file"], framework="pt") as fh:
        return fh.get_tensor(name).float()


def checkpoint_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in a checkpoint folder; one line naming the folder if none."""

    folder = Path(folder)
    if not (folder / TOKENIZER_CONFIG).is_file() or not any(
            (folder / v).is_file() for v in VOCABULARIES):
        raise CheckpointError(f"{folder}: no tokenizer ({TOKENIZER_CONFIG} and one of "
                              f"{', '.join(VOCABULARIES)}); copy the base model's tokenizer "
                              "in with tokenizer.save_pretrained")
    return AutoTokenizer.from_pretrained(folder)


#: Stored tensors of a linear that are not its weights' codes or scales.
_LINEAR_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_zero_point",
                    "weight_global_scale", "input_global_scale", "weight_shape")


def effective_bits(folder) -> dict:
    """Measured bits per weight of a saved checkpoint (protocol.md): bytes of every stored
    tensor of the quantizable linears (all linears but the embeddings and lm_head), and
    of the transform matrices rotated schemes store (``transform_bytes``), x 8 over the
    linears' number of weights. Read from the safetensors headers, no weights loaded.
    """
    tensors = tensor_index(Path(folder))
    modules: dict[str, dict[str, dict]] = {}
    transform_bytes = 0  # a rotated scheme's transform matrices (one per width, tied)
    transforms = transform_modules(Path(folder))
    for name, entry in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.rpartition(".")[2] in transforms:
            transform_bytes += entry["nbytes"]
        elif leaf in _LINEAR_SUFFIXES:
            modules.setdefault(module, {})[leaf] = entry
    stored = transform_bytes
    weights = 0
    linears = 0
    for module, parts in modules.items():
        if "embed" in module or module.endswith("lm_head"):
            continue
        if "weight_packed" in parts:
            rows, cols = parts["weight_packed"]["shape"][:2]
            if "weight_shape" in parts:  # INT4 pack-quantized: 8 codes per int32
                n = rows * cols * 8
            else:  # FP4: two codes per byte
                n = rows * cols * 2
        elif "weight" in parts and len(parts["weight"]["shape"]) == 2:
            n = parts["weight"]["shape"][0] * parts["weight"]["shape"][1]
        else:
            continue  # norms and other 1-D weights
        linears += 1
        weights += n
        stored += sum(e["nbytes"] for e in parts.values())
    if not weights:
        raise ValueError(f"{folder}: no linear weights found in the checkpoint")
    return {"bits": stored * 8 / weights, "bytes": stored, "weights": weights,
            "linears": linears, "transform_bytes": transform_bytes}


def transform_modules(folder: Path) -> set[str]:
    """The names compressed-tensors gives the transform modules it attaches under a
    linear (``<config group>_<location>``), from the checkpoint's ``transform_config``."""
    config = json.loads((folder / "config.json").read_text())
    given = (config.get("quantization_config") or {}).get("transform_config") or {}
    return {f"{group}_{args['location']}"
            for group, scheme in (given.get("config_groups") or {}).items()
            for args in scheme.get("apply", ())}
