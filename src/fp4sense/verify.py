"""``fp4sense verify-vllm``: does vLLM load a checkpoint and compute the same numbers?

Runs in the quantize environment. It checks the folder first (config, safetensors
headers and sizes, every config group matching a module, every quantized module having
its scale tensors), then runs vLLM in the serve environment as a subprocess (as a
deployment would be separate), scores a few evaluation windows there and with
transformers' own load of the folder (compressed-tensors decompression), and compares
the per-token log-probs.

Both sides compute in float32. Remaining differences come from the order of operations
(vLLM's fused q/k/v and gate/up matmuls, its attention kernel), from the weights
(compressed-tensors decompresses FP4 to bf16; vLLM's emulation dequantizes to the
compute dtype) and, for W4A4 schemes, from activation-quantization decisions that flip
with those small differences. See the tolerances below for the measured spread.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from compressed_tensors.utils.match import match_name

__all__ = [
    "CheckpointError",
    "ACTIVATION_QUANT_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "WEIGHT_ONLY_TOLERANCE",
    "Tolerance",
    "VerifyError",
    "VerifyResult",
    "check_checkpoint",
    "tensor_index",
    "compare_logprobs",
    "find_serve_python",
    "reference_logprobs",
    "run_vllm",
    "verify_vllm",
]

SERVE_PYTHON_ENV = "FP4SENSE_SERVE_PYTHON"
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


class CheckpointError(ValueError):
    """The checkpoint folder is missing, corrupt or inconsistent (names what and where)."""


class VerifyError(RuntimeError):
    """vLLM could not run the checkpoint, or took too long (says which)."""


@dataclass(frozen=True)
class Tolerance:
    """Limits on |logprob_vLLM - logprob_transformers| per token, on average, and on the
    relative perplexity difference."""

    max_abs: float
    mean_abs: float
    ppl_rel: float


#: Derived from the spread measured on SmolLM2 (2 evaluation windows, float32 on both
#: sides; numbers in README). Weight-only checkpoints (NVFP4A16): max 0.12, mean 0.008
#: nats, perplexities within 0.1%; the limits leave about 8x room while a wrong scale or
#: a mis-packed nibble moves the mean by far more than 0.05.
WEIGHT_ONLY_TOLERANCE = Tolerance(max_abs=1.0, mean_abs=0.05, ppl_rel=0.01)
#: With quantized activations the two sides' tiny differences (fused matmuls, attention
#: kernel, bf16-rounded decompressed weights; for NVFP4 also vLLM's multiply-by-reciprocal
#: against compressed-tensors' division) flip block-scale and rounding decisions, and the
#: flips compound over the layers. Measured on SmolLM2: MXFP4 as W4A4 max 4.0, mean 0.27
#: nats, perplexities within 1.3%; NVFP4 (W4A4) max 6.3, mean 0.52, within 3.3%. Single
#: tokens are then no signal (no max limit); the mean and the perplexity are, with about
#: 2x room over the worst measured spread, while a real numerics error (a wrong scale, a
#: swapped nibble) moves the perplexity by multiples.
ACTIVATION_QUANT_TOLERANCE = Tolerance(max_abs=math.inf, mean_abs=1.0, ppl_rel=0.1)
DEFAULT_TOLERANCE = WEIGHT_ONLY_TOLERANCE


@dataclass
class VerifyResult:
    """Outcome of :func:`verify_vllm` (JSON-serialisable with :meth:`to_dict`)."""

    checkpoint: str
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    vllm_ppl: float
    transformers_ppl: float
    completion: str
    passed: bool
    tolerance: dict
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# --- checkpoint checks ---------------------------------------------------------------
def _stored_tensors(path: Path) -> dict[str, dict]:
    """name -> {dtype, shape, nbytes} of one safetensors file, read with safetensors'
    own reader (which also refuses a file that does not hold every byte it declares)."""
    from safetensors import SafetensorError, safe_open

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
    return qcfg


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
    from safetensors import safe_open

    with safe_open(folder / entry["file"], framework="pt") as fh:
        return fh.get_tensor(name).float()


def checkpoint_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in a checkpoint folder; one line naming the folder if none."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / TOKENIZER_CONFIG).is_file() or not any(
            (folder / v).is_file() for v in VOCABULARIES):
        raise CheckpointError(f"{folder}: no tokenizer ({TOKENIZER_CONFIG} and one of "
                              f"{', '.join(VOCABULARIES)}); copy the base model's tokenizer "
                              "in with tokenizer.save_pretrained")
    return AutoTokenizer.from_pretrained(folder)


# --- the two sides ---------------------------------------------------------------------
def find_serve_python(explicit: str | os.PathLike | None = None) -> Path:
    """The serve environment's python: argument, $FP4SENSE_SERVE_PYTHON, or .venv-vllm."""
    candidates = [explicit, os.environ.get(SERVE_PYTHON_ENV)]
    prefix = Path(sys.prefix)
    candidates.append(prefix.parent / ".venv-vllm" / "bin" / "python")
    for cand in candidates:
        if cand and Path(cand).is_file():
            return Path(cand)
    raise VerifyError(
        "cannot find the serve environment's python (vLLM); pass --serve-python PATH, set "
        f"{SERVE_PYTHON_ENV}, or run `make setup` to create .venv-vllm"
    )


@torch.no_grad()
def reference_logprobs(folder: str | os.PathLike, windows: torch.Tensor,
                       notes: list[str] | None = None) -> tuple[list[list[float]], int]:
    """Per-token log-probs from transformers' own load of the checkpoint, in float32,
    and the number of layers whose activations are quantized."""
    from fp4sense.metrics import next_token_logprobs
    from fp4sense.quantized import load_checkpoint

    model, act_layers, added = load_checkpoint(folder, promote_mxfp4=True)
    if notes is not None:
        notes.extend(added)
    out = []
    for window in windows:
        logits = model(input_ids=window[None]).logits[0].float()
        out.append(next_token_logprobs(logits, window).tolist())
    return out, act_layers


def run_vllm(folder: Path, windows: torch.Tensor, prompt: str, serve_python: Path,
             timeout_s: float, max_tokens: int = 16) -> dict:
    """Score ``windows`` (and complete ``prompt``) with vLLM in the serve environment."""
    with tempfile.TemporaryDirectory(prefix="fp4sense-vllm-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({
            "model": str(Path(folder).resolve()), "windows": windows.tolist(), "prompt": prompt,
            "max_tokens": max_tokens, "dtype": "float32",
            "max_model_len": max(1024, windows.shape[1] + max_tokens + 1),
        }))
        try:
            proc = subprocess.run([str(serve_python), "-m", "fp4sense_vllm.worker", str(job),
                                   str(result)], capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise VerifyError(
                f"vLLM did not finish within {timeout_s:.0f} s on {folder}; raise --timeout "
                "or check the machine's load"
            ) from None
        if proc.returncode != 0 or not result.is_file():
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error" in ln]
            last = (errors or lines or ["no output"])[-1].strip()
            raise VerifyError(f"vLLM could not run {folder}: {last}")
        return json.loads(result.read_text())


def verify_vllm(
    folder: str | os.PathLike,
    windows: torch.Tensor,
    prompt: str = "The President of the United States said that",
    serve_python: str | os.PathLike | None = None,
    tolerance: Tolerance | None = None,
    timeout_s: float = 900.0,
) -> VerifyResult:
    """Check ``folder``, then compare vLLM's and transformers' log-probs on ``windows``.

    ``tolerance`` defaults to :data:`WEIGHT_ONLY_TOLERANCE`, or to
    :data:`ACTIVATION_QUANT_TOLERANCE` when vLLM quantizes activations of any layer.
    """
    folder = Path(folder)
    check_checkpoint(folder)
    python = find_serve_python(serve_python)
    served = run_vllm(folder, windows, prompt, python, timeout_s)
    notes: list[str] = []
    reference, act_layers = reference_logprobs(folder, windows, notes)
    if tolerance is None:
        tolerance = ACTIVATION_QUANT_TOLERANCE if act_layers else WEIGHT_ONLY_TOLERANCE
    return compare_logprobs(folder, served, reference, tolerance, notes)


def compare_logprobs(folder: str | os.PathLike, served: dict, reference: list[list[float]],
                     tolerance: Tolerance, notes: list[str] | None = None) -> VerifyResult:
    """Judge vLLM's log-probs (``served``, the worker's result) against ``reference``."""
    a = torch.tensor(served["logprobs"], dtype=torch.float64)
    b = torch.tensor(reference, dtype=torch.float64)
    if a.shape != b.shape:
        raise VerifyError(f"vLLM returned log-probs of shape {tuple(a.shape)} for {folder}, "
                          f"transformers {tuple(b.shape)}; the two did not score the same text")
    diff = (a - b).abs()
    result = VerifyResult(
        checkpoint=str(folder), tokens=int(diff.numel()),
        max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
        vllm_ppl=math.exp(-float(a.mean())), transformers_ppl=math.exp(-float(b.mean())),
        completion=served["completion"], passed=False, tolerance=asdict(tolerance),
        notes=list(notes or []),
    )
    ppl_rel = abs(result.vllm_ppl - result.transformers_ppl) / result.transformers_ppl
    result.passed = (result.max_abs_diff <= tolerance.max_abs
                     and result.mean_abs_diff <= tolerance.mean_abs
                     and ppl_rel <= tolerance.ppl_rel)
    return result
