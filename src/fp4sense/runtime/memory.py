"""The memory a run will need, said before it starts, and refused in one line when this
machine does not have it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from pathlib import Path

__all__ = ["GiB", "available_bytes", "check_fits", "mapped_allocations",
           "return_freed_memory"]

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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAPPED_ABOVE = 128 * 1024  # glibc's own starting threshold
_MAPPED = {"depth": 0}  # how many mapped_allocations are open
HEAP_UP_TO = 32 * 2**20  # the ceiling glibc's own threshold rises to


@contextlib.contextmanager
def mapped_allocations():
    """Inside, glibc gives every allocation above 128 KiB its own mapping, returned to the
    operating system when freed; after, allocations up to 32 MiB come from its heap again.
    For bursts of large temporaries (quantizing a block's weights): glibc otherwise
    serves them from its heap, once freed tensors have raised its threshold, and the
    freed ones stay resident until a trim. Outside such bursts the heap is faster: every
    mapped allocation is paid for in page faults (bench/scaling.py). Setting the
    threshold fixes it for the process (glibc stops adjusting it). A no-op where libc is
    not glibc. Nested uses (a perturbation quantized while its block loads) keep the
    mapping until the outermost ends."""
    lib = _libc()
    if lib and not _MAPPED["depth"]:
        lib.mallopt(M_MMAP_THRESHOLD, MAPPED_ABOVE)
    _MAPPED["depth"] += 1
    try:
        yield
    finally:
        _MAPPED["depth"] -= 1
        if lib and not _MAPPED["depth"]:
            lib.mallopt(M_MMAP_THRESHOLD, HEAP_UP_TO)


def return_freed_memory() -> bool:
    """Give memory freed inside the process back to the operating system (glibc's
    ``malloc_trim``): tensors freed when a decoder block is dropped otherwise stay in the
    allocator's heap, and the process's resident memory ratchets up block after block.
    Costs page faults when the memory is needed again (bench/scaling.py measures it). A
    no-op where libc is not glibc."""
    lib = _libc()
    return bool(lib and lib.malloc_trim(0))


def _libc():
    """glibc through ctypes, or False where the C library is another."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
            _LIBC.mallopt  # noqa: B018
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


_LIBC = None
