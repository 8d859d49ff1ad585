"""Are two quantize outputs the same? ``python scripts/compare_checkpoints.py BEFORE AFTER``
compares every file of two checkpoint folders byte for byte; JSON files that differ are
compared again without their wall times (keys ending ``_s``; a report's ``seconds`` and
``total_seconds``), so a refactor can show that weights, plan, recipe and card are
unchanged and only wall times moved.
Exit status 0 when nothing but timings differs.

How issue 35's staged run was checked (each with ``--calib-windows 4 --windows 2 --no-eval``
unless said, once on the commit before and once after, into two roots):
A ``--budget 4.75``; B ``--budget 5 --gptq --select-plans 2 --menu
MXFP4,MXFP4_H32,FP8_DYNAMIC,BF16 --pin '.*down_proj=MXFP4_H32'``; C ``--budget 4.6
--distill 2 --distill-windows 2 --distill-holdout 1``; D ``--budget 4.75 --gptq
--gptq-scores --menu NVFP4,FP8_DYNAMIC,BF16``; E ``--budget 5 --eval-windows 2``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

#: wall times: ``*_s`` keys (timings, training, rows) and a report's ``seconds`` /
#: ``total_seconds``; nothing else is left out of the comparison
TIMING_KEYS = {"seconds", "total_seconds"}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items()
                if not (k.endswith("_s") or k in TIMING_KEYS)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def compare(before: Path, after: Path) -> tuple[list[str], list[str]]:
    """(files identical byte for byte, files that differ beyond timings)."""
    names = sorted({p.relative_to(before) for p in before.rglob("*") if p.is_file()}
                   | {p.relative_to(after) for p in after.rglob("*") if p.is_file()})
    same, different = [], []
    for name in names:
        a, b = before / name, after / name
        if a.is_file() and b.is_file() and _digest(a) == _digest(b):
            same.append(str(name))
        elif (a.is_file() and b.is_file() and name.suffix == ".json"
              and _untimed(json.loads(a.read_text())) == _untimed(json.loads(b.read_text()))):
            print(f"{name}: only timings differ")
        else:
            different.append(str(name))
    return same, different


if __name__ == "__main__":
    same, different = compare(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{len(same)} files identical byte for byte; differing beyond timings: "
          f"{', '.join(different) or 'none'}")
    sys.exit(1 if different else 0)
