"""The resumable analysis cache: one JSON line per finished entry, keyed by the model's
fingerprint, the analysis tokens and the computation's version. Several writers (the
ranks of a torchrun launch, or two runs sharing a cache) append under a file lock, so
lines never interleave."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["CACHE_VERSION", "EntryCache", "cache_key"]

#: Bump when a change of the computation makes cached entries stale (2: the estimate's
#: sampling generator is seeded per window; 3: weights quantized in the compute dtype,
#: which the key names).
CACHE_VERSION = 3


#: the fields an entry of each kind must hold, and their kinds (a key's first word)
_NUMBER = (int, float)
ENTRY_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "measured": {f: _NUMBER for f in ("kl", "kl_se", "dppl", "dppl_se", "top1", "top1_se",
                                      "block_forwards")},
    "estimated": {"scores": dict},
    "stats": {"stats": dict, "base_ppl": _NUMBER},
}


class EntryCache:
    """Append-only JSON lines, one per finished entry; a torn last line is ignored, and an
    entry whose fields are damaged (missing or of the wrong kind: :data:`ENTRY_FIELDS`)
    is named in one line and computed again."""

    def __init__(self, path: Path | None, log: Callable[[str], None] = print):
        self.path = path
        self.log = log
        self.items: dict[str, dict] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                    self.items[item["key"]] = item
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def get(self, key: str) -> dict | None:
        item = self.items.get(key)
        if item is None:
            return None
        need = ENTRY_FIELDS.get(key.split("|", 1)[0], {})
        bad = [f for f, kind in need.items() if not isinstance(item.get(f), kind)
               or isinstance(item.get(f), bool)]
        if key.startswith("estimated|") and not bad and not all(
                isinstance(v, list) and all(isinstance(x, _NUMBER) for x in v)
                for v in item["scores"].values()):
            bad = ["scores"]
        if bad:
            del self.items[key]
            self.log(f"note: the analysis cache {self.path} has a damaged entry {key!r} "
                     f"(field {bad[0]!r}); it is computed again (the new entry replaces it)")
            return None
        return item

    def put(self, key: str, value: dict) -> None:
        item = {"key": key, **value}
        self.items[key] = item
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps(item) + "\n"
            with self.path.open("a+") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
                # a line torn by a killed run: end it, so this entry starts a line of its own
                fh.seek(0, os.SEEK_END)
                if fh.tell():
                    fh.seek(fh.tell() - 1)
                    if fh.read(1) != "\n":
                        fh.write("\n")
                fh.write(line)
                fh.flush()


def cache_key(fingerprint: str, windows: torch.Tensor, weights: str = "",
              compute_dtype: str = "float32") -> str:
    """Cache identity: model weights, analysis tokens, the computation's version and
    dtype, and ``weights``, the identity of quantized weights given instead of
    round-to-nearest."""
    h = hashlib.sha256()
    h.update(f"{CACHE_VERSION}|{fingerprint}|{tuple(windows.shape)}|{compute_dtype}".encode())
    if weights:
        h.update(f"|{weights}".encode())
    h.update(windows.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:20]
