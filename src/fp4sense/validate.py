"""Checks at the edge: every flag typed and ranged, every path checked, before any work.

The parser types below turn a bad value into argparse's one-line usage error (exit 2)
naming the flag; the path checks raise :class:`InputError` (exit 1) naming the path and
the fix. Nothing is computed when the output cannot be written.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import warnings
from pathlib import Path

__all__ = ["EXIT_ASSET_ERROR", "EXIT_HUB_ERROR", "EXIT_USER_ERROR", "InputError", "UserError",
           "block_list", "bounded_float", "bounded_int", "device_name", "non_empty",
           "non_negative_int", "positive_float", "positive_int", "non_negative_float",
           "read_json", "register_unique", "RegistryError", "renamed_keywords", "set_aside"]


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


def bounded_int(least: int, most: int, why: str):
    """argparse type: a whole number from ``least`` to ``most`` (``why``: what a larger
    value would mean, for the message)."""
    def parse(value: str) -> int:
        n = _whole(value, least)
        if n > most:
            raise argparse.ArgumentTypeError(f"{value!r}: at most {most} ({why})")
        return n
    parse.__name__ = f"whole number {least}..{most}"
    parse.bounded = True  # a number: the Python API's keyword is checked with it too
    return parse


def bounded_float(most: float, why: str):
    """argparse type: a finite number > 0 and at most ``most`` (``why``: what a larger
    value would mean, for the message)."""
    def parse(value: str) -> float:
        x = positive_float(value)
        if x > most:
            raise argparse.ArgumentTypeError(f"{value!r}: at most {most:g} ({why})")
        return x
    parse.__name__ = f"number up to {most:g}"
    parse.bounded = True
    return parse


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


def set_aside(path: Path, exc: BaseException, what: str, then: str, log) -> None:
    """A resume file an earlier run left that fails to read: renamed ``NAME.damaged``
    (kept for inspection, never read again), said in one line naming it, the error and
    what the run does instead (``then``)."""
    aside = path.with_name(path.name + ".damaged")
    path.replace(aside)
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    log(f"note: {what} {path} could not be read ({type(exc).__name__}"
        f"{': ' + first if first else ''}); moved to {aside.name}, {then}")


class RegistryError(UserError, ValueError):
    """A name registered twice (a format, a view, a rendering): names both registrants."""


#: (registry, name) -> who registered it (module.qualname)
_REGISTRANTS: dict[tuple[int, str], str] = {}


def register_unique(table: dict, name: str, value, registrant, what: str) -> None:
    """Put ``value`` in the registry ``table`` under ``name``, refusing a name already
    there (as compressed-tensors' RegistryMixin does) in one line naming both
    registrants; ``registrant``: the class or function that registers it."""
    who = (f"{getattr(registrant, '__module__', '?')}."
           f"{getattr(registrant, '__qualname__', repr(registrant))}")
    key = (id(table), name)
    if name in table:
        raise RegistryError(f"{what} {name!r} is registered twice: by "
                            f"{_REGISTRANTS.get(key, 'fp4sense')} and by {who}; give the "
                            "new one another name")
    table[name] = value
    _REGISTRANTS[key] = who


def renamed_keywords(**old_to_new: str):
    """A decorator: the function still takes each keyword under its name before 0.6.0,
    with a FutureWarning naming the new one (the old names go in 0.7.0)."""
    def wrap(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise InputError(f"{function.__name__}: give {new}= only ({old}= is "
                                         "its name before 0.6.0)")
                    warnings.warn(f"{function.__name__}({old}=) is now {new}= (the old name "
                                  "goes in 0.7.0)", FutureWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return call
    return wrap


def read_json(path: Path, what: str, fix: str):
    """A JSON file fp4sense reads back (plan.json, a report, a config): its content, or
    one :class:`InputError` naming the file, what it is, the parser's complaint and
    ``fix``."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise InputError(f"{path}: the {what} cannot be read ({first}); {fix}") from None
