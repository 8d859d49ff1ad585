"""Resumable benchmarks: what finished, one JSON object a line, keyed by its ``key``."""

from __future__ import annotations

import json
from pathlib import Path


class Done(dict):
    """key -> item finished before (read from ``path``; a torn last line is skipped)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                    self[item["key"]] = item
                except (json.JSONDecodeError, KeyError):
                    continue

    def keep(self, item: dict) -> dict:
        """Record ``item`` as finished (in memory and on disk) and return it."""
        self[item["key"]] = item
        with self.path.open("a") as fh:
            fh.write(json.dumps(item) + "\n")
        return item
