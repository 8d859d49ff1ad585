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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fp4sense import defaults

# the one checkpoint checker (eval, push and this comparison share it)
from fp4sense.checkpoint.checks import check_checkpoint
from fp4sense.checkpoint.loading import load_checkpoint
from fp4sense.numerics.metrics import next_token_logprobs
from fp4sense.validate import UserError

__all__ = [
    "ACTIVATION_QUANT_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "WEIGHT_ONLY_TOLERANCE",
    "Tolerance",
    "VerifyError",
    "VerifyResult",
    "compare_logprobs",
    "find_serve_python",
    "reference_logprobs",
    "run_vllm",
    "run_vllm_many",
    "verify_vllm",
    "verify_vllm_many",
]

SERVE_PYTHON_ENV = "FP4SENSE_SERVE_PYTHON"

class VerifyError(UserError, RuntimeError):
    """vLLM could not run the checkpoint, or took too long (says which)."""


@dataclass(frozen=True)
class Tolerance:
    """Limits on |logprob_vLLM - logprob_transformers| per token, on average, and on the
    relative perplexity difference."""

    max_abs: float
    mean_abs: float
    ppl_rel: float


#: Derived from the spread measured on SmolLM2 (2 evaluation windows, float32 on both
#: sides; numbers in docs/vllm.md). Weight-only checkpoints (NVFP4A16): max 0.12, mean 0.008
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


# --- the two sides ---------------------------------------------------------------------
def find_serve_python(explicit: str | os.PathLike | None = None) -> Path:
    """The serve environment's python: argument, $FP4SENSE_SERVE_PYTHON, or .venv-vllm."""
    for given, what in ((explicit, "--serve-python"), (os.environ.get(SERVE_PYTHON_ENV),
                                                       SERVE_PYTHON_ENV)):
        if given:  # named by the user: that one or none, never a silent fallback
            if not Path(given).is_file():
                raise VerifyError(f"{what} {given}: no such file; give the serve "
                                  "environment's python (e.g. .venv-vllm/bin/python)")
            return Path(given)
    beside = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    if beside.is_file():
        return beside
    raise VerifyError(
        "cannot find the serve environment's python (vLLM); pass --serve-python PATH, set "
        f"{SERVE_PYTHON_ENV}, or run `make setup` to create .venv-vllm"
    )


@torch.no_grad()
def reference_logprobs(folder: str | os.PathLike, windows: torch.Tensor,
                       notes: list[str] | None = None) -> tuple[list[list[float]], int]:
    """Per-token log-probs from transformers' own load of the checkpoint, in float32,
    and the number of layers whose activations are quantized."""

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
    return run_vllm_many([folder], [windows], prompt, serve_python, timeout_s, max_tokens)[0]


def run_vllm_many(folders: Sequence[Path], windows: Sequence[torch.Tensor], prompt: str,
                  serve_python: Path, timeout_s: float, max_tokens: int = 16) -> list[dict]:
    """:func:`run_vllm` for several checkpoints in one serve process (vLLM is imported
    once; each checkpoint gets its own engine). ``timeout_s`` is per checkpoint."""
    with tempfile.TemporaryDirectory(prefix="fp4sense-vllm-") as tmp:
        args, results = [], []
        for i, (folder, w) in enumerate(zip(folders, windows, strict=True)):
            job, result = Path(tmp) / f"job{i}.json", Path(tmp) / f"result{i}.json"
            job.write_text(json.dumps({
                "model": str(Path(folder).resolve()), "windows": w.tolist(),
                "prompt": prompt, "max_tokens": max_tokens, "dtype": "float32",
                "max_model_len": max(1024, w.shape[1] + max_tokens + 1),
            }))
            args += [str(job), str(result)]
            results.append(result)
        try:
            proc = subprocess.run([str(serve_python), "-m", "fp4sense_vllm.worker", *args],
                                  capture_output=True, text=True,
                                  timeout=timeout_s * len(folders))
        except subprocess.TimeoutExpired:
            raise VerifyError(
                f"vLLM did not finish within {timeout_s:.0f} s per checkpoint on "
                f"{', '.join(str(f) for f in folders)}; raise --timeout or check the "
                "machine's load") from None
        for folder, result in zip(folders, results, strict=True):
            if not result.is_file():  # the worker stopped at this checkpoint
                lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                errors = [ln for ln in lines if "Error" in ln or "error" in ln]
                last = (errors or lines or ["no output"])[-1].strip()
                if "hadacore_transform" in last:  # a rotated checkpoint, no Hadamard kernel
                    last += ("; this vLLM has no kernel for the checkpoint's Hadamard "
                             "transforms here: install fp4sense-vllm (CPU) or serve on a "
                             "CUDA GPU")
                raise VerifyError(f"vLLM could not run {folder}: {last}")
        return [json.loads(result.read_text()) for result in results]


def verify_vllm(
    folder: str | os.PathLike,
    windows: torch.Tensor,
    prompt: str = defaults.VLLM_PROMPT,
    serve_python: str | os.PathLike | None = None,
    tolerance: Tolerance | None = None,
    timeout_s: float = defaults.VLLM_TIMEOUT_S,
) -> VerifyResult:
    """Check ``folder``, then compare vLLM's and transformers' log-probs on ``windows``.

    ``tolerance`` defaults to :data:`WEIGHT_ONLY_TOLERANCE`, or to
    :data:`ACTIVATION_QUANT_TOLERANCE` when vLLM quantizes activations of any layer.
    """
    return verify_vllm_many([folder], [windows], prompt, serve_python, tolerance,
                            timeout_s)[0]


def verify_vllm_many(
    folders: Sequence[str | os.PathLike],
    windows: Sequence[torch.Tensor],
    prompt: str = defaults.VLLM_PROMPT,
    serve_python: str | os.PathLike | None = None,
    tolerance: Tolerance | None = None,
    timeout_s: float = defaults.VLLM_TIMEOUT_S,
) -> list[VerifyResult]:
    """:func:`verify_vllm` for several checkpoints (``windows[i]`` scores ``folders[i]``)
    with one vLLM process: every folder is checked before vLLM starts."""
    folders = [Path(f) for f in folders]
    for folder in folders:
        check_checkpoint(folder)
    python = find_serve_python(serve_python)
    served = run_vllm_many(folders, windows, prompt, python, timeout_s)
    out = []
    for folder, w, result in zip(folders, windows, served, strict=True):
        notes: list[str] = []
        reference, act_layers = reference_logprobs(folder, w, notes)
        tol = tolerance or (ACTIVATION_QUANT_TOLERANCE if act_layers else WEIGHT_ONLY_TOLERANCE)
        out.append(compare_logprobs(folder, result, reference, tol, notes))
    return out


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
