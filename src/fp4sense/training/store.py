"""The cache of a training run's pieces (analyze-training's estimates and trials,
train-trial's arms): one JSON file per run, keyed by the model, its token windows and the
settings; each piece read back when there and written as it finishes, so a run stopped
by Ctrl-C or SIGTERM resumes at the next piece."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fp4sense.runtime import distributed
from fp4sense.structure.units import model_fingerprint

__all__ = ["RunStore", "run_key"]


def run_key(model: torch.nn.Module, windows: Sequence[torch.Tensor], settings: list) -> str:
    """The run's key: the model's fingerprint, its windows' tokens, the settings (JSON) and
    the model's dtype."""
    h = hashlib.sha256()
    h.update(model_fingerprint(model).encode())
    for w in windows:
        h.update(w.cpu().numpy().tobytes())
    h.update(json.dumps([*settings, str(next(model.parameters()).dtype)]).encode())
    return h.hexdigest()[:24]


class RunStore:
    """One run's pieces by name (``folder`` None: nothing kept). A damaged file is
    computed again; under torchrun rank 0 writes."""

    def __init__(self, folder: Path | None, key: str):
        self.path = None if folder is None else folder / f"{key}.json"
        self.data = {}
        if self.path is not None and self.path.is_file():
            try:
                self.data = json.loads(self.path.read_text())
            except ValueError:
                self.data = {}  # a damaged entry is computed again

    def get(self, name: str, compute: Callable[[], object]):
        if name not in self.data:
            self.data[name] = compute()
            if self.path is not None and distributed.is_main():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.data))
                tmp.replace(self.path)
        return self.data[name]
