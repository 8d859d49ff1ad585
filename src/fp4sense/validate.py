"""Checks at the edge: every flag typed and ranged, every path checked, before any work.

The parser types below turn a bad value into argparse's one-line usage error (exit 2)
naming the flag; the path checks raise :class:`InputError` (exit 1) naming the path and
the fix. Nothing is computed when the output cannot be written.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

__all__ = ["EXIT_ASSET_ERROR", "EXIT_HUB_ERROR", "EXIT_USER_ERROR", "InputError", "UserError",
           "block_list", "check_output_folder", "check_writable", "device_name",
           "non_empty", "non_negative_int", "positive_float", "positive_int", "non_negative_float",
           "claim_output", "publish_folder", "remove_dead_partials", "set_aside",
           "write_owner"]


#: exit codes of the errors users can fix (2 is argparse's usage error)
EXIT_USER_ERROR = 1
EXIT_ASSET_ERROR = 3
EXIT_HUB_ERROR = 5


class UserError(Exception):
    """An error the user can fix: the command line prints its message as one line and
    exits with its ``exit_code`` (every front door raises it the same way)."""

    exit_code = EXIT_USER_ERROR


class InputError(UserError, ValueError):
    """A flag, path or file the user gave cannot be used (the message names it)."""


def _whole(value: str, least: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{value!r}: " + ("must not be negative" if least == 0
                                                           else f"must be at least {least}"))
    return n


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    return _whole(value, 1)


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    return _whole(value, 0)


def _finite(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{value!r}: must be a finite number")
    return x


def positive_float(value: str) -> float:
    """argparse type: a finite number > 0."""
    x = _finite(value)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be greater than 0")
    return x


def non_negative_float(value: str) -> float:
    """argparse type: a finite number >= 0."""
    x = _finite(value)
    if x < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must not be negative")
    return x


def non_empty(value: str) -> str:
    """argparse type: a string with something in it."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def device_name(value: str) -> str:
    """argparse type: auto, cpu, cuda or cuda:N (whether this machine has it is checked
    when the command starts, :func:`fp4sense.runtime.devices.resolve`)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r}: choose auto, cpu, cuda or cuda:N")
    return value


def block_list(value: str) -> list[int]:
    """argparse type: comma-separated block numbers ('' = none)."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not all(re.fullmatch(r"\d+", v) for v in items):
        raise argparse.ArgumentTypeError(f"{value!r}: give block numbers such as 0,5,29")
    return [int(v) for v in items]


def check_writable(folder: Path, what: str, fix: str) -> None:
    """``folder`` (or the nearest existing parent) accepts new files; else one line."""
    probe = Path(folder)
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{what} {folder}: {probe} is a file, not a folder; {fix}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{what} {folder}: {probe} is not writable; {fix}")


def check_output_folder(out: Path, *, overwrite: bool, protected: list[Path] = ()) -> None:
    """Refuse an output folder that would lose the user's files: the current folder, a
    protected path (the model) or a folder holding or inside one, an existing file, a
    non-empty folder without ``overwrite``, or one that cannot be written."""
    out = Path(out)
    here = Path.cwd().resolve()
    target = out.resolve()
    if target == here or target in here.parents:
        raise InputError(f"--out {out} is the current folder or holds it; fp4sense writes "
                         "a new folder there in one rename: name a new folder")
    for path in protected:
        p = Path(path).resolve()
        if target == p or target in p.parents or p in target.parents:
            raise InputError(f"--out {out} is, holds or is inside the model folder {path}; "
                             "the model would be lost or changed: choose another folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is an existing file; choose a folder name")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{out} exists and is not empty; choose another --out or pass "
                         "--overwrite")
    check_writable(target.parent, "--out", "choose a folder you can write to")


def check_quantize_output(model, out, *, overwrite: bool) -> None:
    """``fp4sense quantize``'s output folder against :func:`check_output_folder`, the model
    (the bundled one when ``model`` is None) protected. Light: the CLI runs it before it
    imports torch, so a wrong ``--out`` is refused in a moment."""
    from fp4sense.inputs.assets import default_model_path

    base = default_model_path() if model is None else Path(model)
    claim_output(Path(out))  # before the folder is judged: no run can publish in between
    check_output_folder(Path(out), overwrite=overwrite,
                        protected=[base] if base.exists() else [])


def check_analysis_output(out_dir, cache) -> Path | None:
    """``fp4sense analyze``'s output folder and analysis cache (``cache``: True for the
    fp4sense cache, a folder, or False for none), checked writable before any work; returns
    the cache folder. Light, like :func:`check_quantize_output`."""
    from fp4sense.inputs.assets import cache_dir

    cache_folder = (cache_dir() / "analysis" if cache is True else Path(cache) if cache
                    else None)
    if out_dir is not None:  # nothing is computed when the results cannot be written
        claim_output(Path(out_dir))
        if Path(out_dir).exists() and not Path(out_dir).is_dir():
            raise InputError(f"--out {out_dir} is an existing file; choose a folder name")
        held = [n for n in ("plan.json", "recipe.yaml") if (Path(out_dir) / n).is_file()]
        if held:
            raise InputError(f"--out {out_dir} holds a checkpoint ({held[0]}): the analysis "
                             "would replace its sensitivity.json; choose another --out")
        check_writable(Path(out_dir), "--out", "choose a folder you can write to")
    if cache_folder is not None:
        check_writable(cache_folder, "the analysis cache", "pass --no-cache, or point "
                       "FP4SENSE_CACHE at a writable folder")
    return cache_folder


_OWNER = ".fp4sense-owner"
#: output folder (resolved) -> the open lock file this process holds for it
_CLAIMED: dict[str, int] = {}


def claim_output(out: Path) -> None:
    """Make this process the one writer of ``out`` until it exits: an exclusive lock on
    a file named after the folder's resolved path, in the fp4sense cache (beside ``out``
    when the cache cannot be written), never inside the folder. A second run to the same
    ``--out`` stops at once in one line naming the running one. Under torchrun only the
    launch's rank 0 (the one that writes) claims it."""
    import fcntl

    from fp4sense.inputs.assets import cache_dir

    target = str(Path(out).resolve())
    if target in _CLAIMED or (int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun: as
                              and os.environ.get("RANK", "0") != "0"):  # launch_rank()
        return
    places = (cache_dir() / "locks" / f"{hashlib.sha256(target.encode()).hexdigest()[:32]}.lock",
              Path(target).parent / f".{Path(target).name}.fp4sense-lock")
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(place, os.O_RDWR | os.O_CREAT, 0o644)
            break
        except OSError:
            continue
    else:
        return  # nowhere to lock: the folder checks that follow name the unwritable path
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise InputError(f"--out {out} is being written by another fp4sense run ({holder}); "
                         "wait for it to finish, or choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                  f"{time.strftime('%H:%M:%S')}".encode(), 0)
    _CLAIMED[target] = fd  # released when this process exits, however it exits


def publish_folder(work: Path, out: Path) -> None:
    """Replace ``out`` by the finished ``work`` folder in one rename (an earlier ``out``,
    with ``--overwrite``, is moved aside first and removed after); the owner mark goes
    first, so the published folder holds only the checkpoint's files."""
    (Path(work) / _OWNER).unlink(missing_ok=True)
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(trash / out.name)
        work.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        work.rename(out)


def write_owner(work: Path) -> None:
    """Mark a work-in-progress folder with the process that writes it."""
    (Path(work) / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def remove_dead_partials(parent: Path, name: str) -> list[str]:
    """Remove ``.NAME.partial-*`` folders beside an output whose writer is provably dead
    (same host, process gone); name the ones that cannot be proven dead. One line each."""
    notes = []
    for folder in sorted(Path(parent).glob(f".{name}.partial-*")):
        owner = folder / _OWNER
        try:
            host, pid = owner.read_text().split()
            alive = host != socket.gethostname() or _alive(int(pid))
        except (OSError, ValueError):
            notes.append(f"{folder} is left from an interrupted run of an older fp4sense; "
                         "remove it by hand if no run is writing it")
            continue
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            notes.append(f"removed {folder}, left by a run that was killed (pid {pid})")
    return notes


def set_aside(path: Path, exc: BaseException, what: str, then: str, log) -> None:
    """A resume file an earlier run left that fails to read: renamed ``NAME.damaged``
    (kept for inspection, never read again), said in one line naming it, the error and
    what the run does instead (``then``)."""
    aside = path.with_name(path.name + ".damaged")
    path.replace(aside)
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    log(f"note: {what} {path} could not be read ({type(exc).__name__}"
        f"{': ' + first if first else ''}); moved to {aside.name}, {then}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
