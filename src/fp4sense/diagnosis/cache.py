"""The resumable analysis cache: one JSON line per finished entry, keyed by the model's
fingerprint, the analysis tokens and the computation's version."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

__all__ = ["CACHE_VERSION", "EntryCache", "cache_key"]

#: Bump when a change of the computation makes cached entries stale.
CACHE_VERSION = 1


class EntryCache:
    """Append-only JSON lines, one per finished entry; a torn last line is ignored."""

    def __init__(self, path: Path | None):
        self.path = path
        self.items: dict[str, dict] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                    self.items[item["key"]] = item
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def get(self, key: str) -> dict | None:
        return self.items.get(key)

    def put(self, key: str, value: dict) -> None:
        item = {"key": key, **value}
        self.items[key] = item
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a+") as fh:
                # a line torn by a killed run: end it, so this entry starts a line of its own
                fh.seek(0, os.SEEK_END)
                if fh.tell():
                    fh.seek(fh.tell() - 1)
                    if fh.read(1) != "\n":
                        fh.write("\n")
                fh.write(json.dumps(item) + "\n")


def cache_key(fingerprint: str, windows: torch.Tensor) -> str:
    """Cache identity: model weights, analysis tokens, and the computation's version."""
    h = hashlib.sha256()
    h.update(f"{CACHE_VERSION}|{fingerprint}|{tuple(windows.shape)}".encode())
    h.update(windows.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:20]
