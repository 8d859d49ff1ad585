"""Many ranks under ``torchrun``: torch.distributed is the engine (gloo on CPUs, NCCL on
GPUs); no process pool, sockets or job queue of our own.

``torchrun --nproc-per-node N -m fp4sense analyze ...`` starts N copies; each calls
:func:`init_from_env` (a no-op outside torchrun), takes its share of the work with
:func:`shard`, and the results meet with :func:`gather`. Rank 0 writes the outputs.
A rank that dies stops the others: torchrun ends the group, and a collective waits at
most :data:`COLLECTIVE_TIMEOUT_S` before it fails with one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from fp4sense.validate import UserError

__all__ = ["COLLECTIVE_TIMEOUT_S", "QUANTIZE_TIMEOUT_S", "RankError", "disband", "gather",
           "init_from_env", "is_main", "launch_rank", "leave", "on_main", "rank", "shard", "share",
           "unshard", "world_size"]

T = TypeVar("T")
#: How long a rank waits for the others at a collective (a dead peer ends the run then).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("FP4SENSE_RANK_TIMEOUT", "60"))
#: The same for ``quantize``, whose ranks wait while rank 0 plans (``--select-plans``
#: measures plans there).
QUANTIZE_TIMEOUT_S = float(os.environ.get("FP4SENSE_RANK_TIMEOUT", "3600"))


class RankError(UserError, RuntimeError):
    """Another rank stopped (died or was killed) before the work met; nothing of this
    rank's finished entries is lost (they are in the analysis cache)."""


def init_from_env(device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1); True when this
    process is one of several ranks. On GPUs each rank works on its own (``LOCAL_RANK``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        index = torch.device(device).index
        torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_world_size() > 1


_broken = False


def leave(code: int = 0) -> None:
    """Leave the process group at the end of a command (no-op outside torchrun). After a
    peer died the group's threads cannot be joined (a normal exit would abort in
    C++), so the process ends here with ``code``, its output flushed."""
    if _broken:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    disband()


def disband() -> None:
    """Leave the process group once the ranks' shared work is done (every rank calls it
    after the last collective); the process goes on alone, as outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def launch_rank() -> int:
    """This process's rank as torchrun launched it, before (or without) the group: work
    one rank does before the ranks meet (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def is_main() -> bool:
    return rank() == 0


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share: every ``world_size``-th item from its rank on."""
    return list(items[rank()::world_size()])


def gather(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order (a one-element list outside torchrun)."""
    if not _active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as exc:  # a peer died: gloo/NCCL report it as a runtime error
        global _broken
        _broken = True
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RankError(f"rank {dist.get_rank()}: another rank stopped before the results "
                        f"met ({first[:160]}); finished entries stay in the analysis "
                        "cache, run again to resume") from None
    return out


def share(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (``obj`` itself outside torchrun); the other ranks
    pass anything (None)."""
    return gather(obj)[0]


def on_main(work: Callable[[], T], what: str) -> T | None:
    """Run ``work`` on rank 0 alone (everywhere outside torchrun) and return its result
    there (None on the other ranks). An error on rank 0 stops the others at once with one
    line naming ``what`` rank 0 was doing, instead of leaving them waiting."""
    if not _active():
        return work()
    result, error = None, None
    if is_main():
        try:
            result = work()
        except BaseException as exc:  # noqa: BLE001 (re-raised below, after telling)
            error = exc
    failed = share(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise RankError(f"rank {rank()}: rank 0 stopped while {what} ({failed[:200]})")
    return result


def unshard(parts: Sequence[Sequence[T]], n: int) -> list[T]:
    """Undo :func:`shard`: the gathered shares back in the original order of ``n`` items."""
    out: list = [None] * n
    for r, part in enumerate(parts):
        for j, item in enumerate(part):
            out[r + j * len(parts)] = item
    return out
