"""The memory a run will need, said before it starts, and refused in one line when this
machine does not have it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["GiB", "available_bytes", "check_fits"]

GiB = 2**30


def available_bytes() -> int:
    """Memory the kernel says a new allocation can get (MemAvailable), else all of it."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(need: int, what: str, fix: str, log=print) -> None:
    """Say how much ``what`` will keep; one line (ValueError, naming ``fix``) when it
    exceeds the available memory. ``FP4SENSE_MEMORY_LIMIT`` (bytes) overrides what is
    available (for tests and shared machines)."""
    limit = os.environ.get("FP4SENSE_MEMORY_LIMIT")
    have = int(limit) if limit else available_bytes()
    log(f"{what}: {need / GiB:.2f} GiB (available {have / GiB:.1f} GiB)")
    if need > have:
        raise ValueError(f"{what} needs {need / GiB:.2f} GiB but {have / GiB:.2f} GiB are "
                         f"available; {fix}")
