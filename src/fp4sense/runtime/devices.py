"""``--device auto|cpu|cuda|cuda:N`` and ``--dtype float32|bfloat16``: one placement for a
command, resolved and checked before any model is loaded.

The same code runs everywhere: the analysis, the Fisher estimate and the metrics move the
windows to the model's device and compute there; nothing branches on the device type.
The protocol's figures are CPU float32 (the default); ``auto`` takes the GPU of this rank
when there is one, and bfloat16 there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4sense.validate import UserError

__all__ = ["DEVICE_CHOICES", "DTYPES", "DeviceError", "Placement", "cpu_has_native_bf16",
           "resolve"]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEVICE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


class DeviceError(UserError, ValueError):
    """A device or dtype this machine cannot give (the message names it and the way out)."""


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def describe(self) -> str:
        return f"{self.device} {self.dtype_name}"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve(device: str | torch.device | None = "cpu", dtype: str | torch.dtype | None = None,
            *, log=None) -> Placement:
    """The placement for ``device`` and ``dtype`` (None: float32 on the CPU, bfloat16 on a
    GPU). Under torchrun, ``auto`` and ``cuda`` mean this rank's GPU (``LOCAL_RANK``).

    Raises :class:`DeviceError` for a device this machine lacks; says (through ``log``)
    when bfloat16 on this CPU will be slow."""
    text = str(device if device is not None else "cpu")
    m = _DEVICE.match(text)
    if m is None or (m.group(1) != "cuda" and m.group(2) is not None):
        raise DeviceError(f"--device {text}: unknown device; choose {DEVICE_CHOICES}")
    kind, index = m.group(1), m.group(2)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        kind = "cuda" if gpus else "cpu"
    if kind == "cuda":
        if not gpus:
            raise DeviceError(f"--device {text}: this machine has no CUDA GPU that torch "
                              f"{torch.__version__} can use; use --device cpu (or auto)")
        i = int(index) if index is not None else _local_rank()
        if i >= gpus:
            raise DeviceError(f"--device {text}: this machine has {gpus} CUDA GPU(s) "
                              f"(cuda:0–cuda:{gpus - 1}); choose one of them")
        where = torch.device("cuda", i)
    else:
        where = torch.device("cpu")
    if dtype is None:
        dt = torch.bfloat16 if where.type == "cuda" else torch.float32
    elif isinstance(dtype, torch.dtype):
        dt = dtype
    elif str(dtype) in DTYPES:
        dt = DTYPES[str(dtype)]
    else:
        raise DeviceError(f"--dtype {dtype}: choose {' or '.join(DTYPES)}")
    if dt not in DTYPES.values():
        raise DeviceError(f"--dtype {dtype}: choose {' or '.join(DTYPES)}")
    if where.type == "cpu" and dt == torch.bfloat16 and log is not None \
            and not cpu_has_native_bf16():
        log("note: bfloat16 on this CPU (no AVX512-BF16 / AMX) is computed by conversion "
            "and runs several times slower than float32; drop --dtype (float32 is the CPU default) "
            "unless you need bfloat16's numerics")
    return Placement(where, dt)
