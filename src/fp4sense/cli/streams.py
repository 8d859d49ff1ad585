"""The command line's streams: the JSON document on stdout alone (``--json``) and an
interrupt (Ctrl-C or SIGTERM) that stays one line."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import sys

__all__ = ["Terminated", "emit_json", "interrupt_line", "settle_interrupt",
           "sigterm_as_interrupt", "stdout_for_json"]

# With --json, stdout carries the JSON document alone: while a command runs, file
# descriptor 1 points at stderr (hosts log to stdout: llm-compressor's loguru does), and
# the document is written to the saved stdout.
_json_out = None


def _finite(obj):
    """``obj`` with NaN and infinities as null: what JSON can carry (Python's json module
    would write ``NaN`` / ``Infinity``, which JSON parsers refuse)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def emit_json(obj, one_line: bool = False) -> None:
    """Write ``obj`` as strict JSON (non-finite numbers as null) to the JSON stream
    (``one_line``: on one line, for scripts that read a line)."""
    stream = _json_out or sys.stdout
    stream.write(json.dumps(_finite(obj), indent=None if one_line else 2,
                            allow_nan=False) + "\n")
    stream.flush()


@contextlib.contextmanager
def stdout_for_json(enabled: bool):
    global _json_out
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _json_out = os.fdopen(saved, "w")
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        _json_out.close()
        _json_out = None


def settle_interrupt(exc: BaseException) -> None:
    """Finalize, quietly, what a Ctrl-C left half-built (e.g. a progress bar interrupted
    in its constructor, whose finalizer then fails with a traceback after the command's
    one line): the interrupt's frames are dropped and collected now."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _unraisable: None
    try:
        exc.__traceback__ = None
        gc.collect()
    finally:
        sys.unraisablehook = hook


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``docker stop``, ``timeout``) raised where the work is, so the
    run cleans up exactly as for Ctrl-C."""


def interrupt_line(exc: KeyboardInterrupt) -> str:
    """The one line for Ctrl-C or SIGTERM. Under torchrun (``WORLD_SIZE`` > 1) SIGTERM is
    how the launcher stops the other ranks when one has failed: the line says so, and
    torchrun's report that follows names the rank that failed first."""
    if not isinstance(exc, Terminated):
        why = "interrupted"
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        why = ("terminated (SIGTERM: torchrun stops every rank when one fails; its report "
               "below names the rank that failed first)")
    else:
        why = "terminated (SIGTERM)"
    return (f"fp4sense: {why}; finished analysis entries stay cached, no partial output "
            "folder is left")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises :class:`Terminated` in the main thread (elsewhere, or
    where a handler cannot be set, nothing changes)."""
    def handler(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
