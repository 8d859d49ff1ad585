"""What the benchmarks share: where results go, the menus, resumable records, the protocol
session (the bundled model, its calibration and evaluation windows, a cached estimate), a
judge of unit -> scheme assignments, peak memory, the command that reproduces a result,
and verify-vllm over written checkpoints.

The protocol (docs/protocol.md): SmolLM2-135M in float32 on the CPU, 512-token windows,
the estimate on the first 8 of 32 calibration windows, KL / PPL / top-1 on the first 16
evaluation windows of the held-out text, input scales and scale-search weights from the
calibration text.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from fp4sense import defaults

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

#: the three menus every table uses: an FP4 scheme, FP8 where it is not enough, BF16 last
MENUS = {"W4A4": ["NVFP4", "FP8_DYNAMIC", "BF16"],
         "weight-only": ["NVFP4A16", "FP8_DYNAMIC", "BF16"],
         "MX": ["MXFP4", "FP8_DYNAMIC", "BF16"]}
#: the same with block-Hadamard rotated FP4 schemes beside the plain one (SmolLM2's widths,
#: 576 and 1536, take 16-, 32- and 64-wide rotations, not 128: 576 = 64 x 9)
ROTATED_MENUS = {"W4A4+H": ["NVFP4", "NVFP4_H16", "NVFP4_H64", "FP8_DYNAMIC", "BF16"],
                 "MX+H": ["MXFP4", "MXFP4_H32", "MXFP4_H64", "FP8_DYNAMIC", "BF16"],
                 # each format's own block width only, searched twins spelled out
                 # (planned as given: one GPTQ rounding per scheme for --gptq-scores)
                 "W4A4+H16s": ["NVFP4_SEARCH", "NVFP4_H16_SEARCH", "FP8_DYNAMIC", "BF16"],
                 "MX+H32": ["MXFP4", "MXFP4_H32", "FP8_DYNAMIC", "BF16"]}
CALIB_WINDOWS, ESTIMATE_WINDOWS = defaults.CALIB_WINDOWS, defaults.ANALYSIS_WINDOWS
EVAL_WINDOWS, WINDOW_TOKENS = defaults.EVAL_WINDOWS, defaults.WINDOW_TOKENS


def menu(name: str) -> list[str]:
    """A menu by its name (``W4A4``, ``MX+H``, ...) or by its FP4 scheme (``NVFP4``: the
    name the plans benchmark's rows carry)."""
    every = {**MENUS, **ROTATED_MENUS}
    by_fp4 = {m[0]: m for m in MENUS.values()}
    if name in every:
        return list(every[name])
    if name in by_fp4:
        return list(by_fp4[name])
    raise SystemExit(f"unknown menu {name!r}; choose of {[*every, *by_fp4]}")


def plain_menu(name: str) -> str:
    """The name of the menu in MENUS whose FP4 scheme has the format and activations of
    menu ``name``'s first (a rotated menu's table is its plain menu's)."""
    from fp4sense.numerics.schemes import get_scheme

    def kind(scheme: str) -> tuple:
        s = get_scheme(scheme)
        return s.weight_format, s.activations

    return next(k for k, m in MENUS.items() if kind(m[0]) == kind(menu(name)[0]))


def searched(scheme_menu: list[str]) -> list[str]:
    """``scheme_menu`` with its FP4 scheme replaced by the searched-scale twin."""
    return [f"{s}_SEARCH" if i == 0 else s for i, s in enumerate(scheme_menu)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def command(name: str, argv: list[str] | None) -> str:
    """The command line that reproduces a result (run from the repository's root)."""
    return " ".join(["python -m bench", name, *map(shlex.quote, argv or [])])


def child(name: str, *args: str) -> list[str]:
    """The argv of another benchmark (or this one's ``--child`` mode) in a fresh process:
    run it with ``cwd=REPO``."""
    return [sys.executable, "-m", "bench", name, *args]


def peak_rss_gib() -> float:
    """This process's own peak resident memory (VmHWM), GiB. Not getrusage's ru_maxrss
    where /proc is there: Linux carries that over from the parent through fork and exec,
    so a child would report the peak of the parent that built its inputs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def relative(folder: Path) -> str:
    """A folder as the results record it: relative to bench/results (no machine path)."""
    folder = folder.resolve()
    return str(folder.relative_to(RESULTS)) if folder.is_relative_to(RESULTS) else folder.name


class Done(dict):
    """Resumable records: key -> item finished before, one JSON object a line in ``path``
    (a torn last line is skipped)."""

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(item) + "\n")
        return item


def verify_vllm(folders: list[Path]) -> tuple[dict[str, dict], str]:
    """``fp4sense verify-vllm --json`` over ``folders`` in one call (one vLLM process, an
    engine per checkpoint): folder name -> its verdict (verify-vllm's JSON: ``passed``,
    ``mean_abs_diff``, ...; a folder it stopped before is missing), and the tail of the
    command's output, to read when one is."""
    if not folders:
        return {}, ""
    exe = str(Path(sys.executable).parent / "fp4sense")
    proc = subprocess.run([exe, "verify-vllm", "--json", *map(str, folders)],
                          capture_output=True, text=True, env=os.environ.copy())
    try:
        found = json.loads(proc.stdout)
        verdicts = {Path(v["checkpoint"]).name: v
                    for v in (found if isinstance(found, list) else [found])}
    except (ValueError, KeyError, TypeError):  # stopped before any verdict
        verdicts = {}
    return verdicts, (proc.stdout + proc.stderr)[-400:]


def plain_oneshot(calib, tok) -> float:
    """Wall time of a plain llm-compressor NVFP4 oneshot of the bundled model (bf16, every
    linear but lm_head) on ``calib``, saved compressed: the time targets' baseline."""
    import tempfile

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from fp4sense.inputs.assets import ensure_model

    with tempfile.TemporaryDirectory(prefix="fp4sense-bench-") as tmp:
        t = time.perf_counter()
        plain = AutoModelForCausalLM.from_pretrained(ensure_model(log=lambda m: None),
                                                     dtype=torch.bfloat16)
        data = Dataset.from_dict({"input_ids": calib.tolist(),
                                  "attention_mask": torch.ones_like(calib).tolist()})
        oneshot(model=plain, dataset=data, num_calibration_samples=len(calib),
                max_seq_length=calib.shape[1], processor=tok,
                recipe=QuantizationModifier(targets=["Linear"], scheme="NVFP4",
                                            ignore=["lm_head"]))
        plain.save_pretrained(Path(tmp) / "uniform", save_compressed=True)
        return round(time.perf_counter() - t, 1)


class Session:
    """The protocol's model and windows: the bundled model in float32 on the CPU,
    ``CALIB_WINDOWS`` calibration windows and ``eval_windows`` of the held-out text."""

    def __init__(self, calib_windows: int = CALIB_WINDOWS, eval_windows: int = EVAL_WINDOWS):
        from fp4sense.api import BUNDLED_MODEL_NOTE, analysis_windows, load_model
        from fp4sense.inputs.texts import protocol_windows

        self.model, self.tok, _ = load_model(None)
        self.calib = analysis_windows(self.tok, None, calib_windows, WINDOW_TOKENS)
        self.evalw = protocol_windows(self.tok, "evaluation", eval_windows)
        self.caveat = BUNDLED_MODEL_NOTE
        self._calibrated = None  # (units, the calibration text's statistics)

    def estimate(self, schemes: list[str], cache_dir: Path | None, report: Path | None = None,
                 windows: int = ESTIMATE_WINDOWS):
        """The estimated grid of ``schemes`` on the first ``windows`` calibration windows
        (entries cached in ``cache_dir``), saved to ``report`` when given; the seconds it
        took come with it."""
        from fp4sense.diagnosis import analyze

        t = time.perf_counter()
        est = analyze(self.model, self.calib[:windows], schemes=schemes, views=["grid"],
                      modes=["estimated"], cache_dir=cache_dir, log=print)
        if report is not None:
            est.save(report)
        return est, round(time.perf_counter() - t, 1)

    def judge(self, units, windows=None, **kw) -> Judge:
        """A :class:`Judge` on the evaluation windows (or ``windows``), its input scales
        and scale-search weights from the calibration windows (one base pass over them,
        shared by this session's judges) unless ``kw`` gives ``stats``."""
        if "stats" not in kw:
            if self._calibrated is None or self._calibrated[0] is not units:
                first = Judge(self.model, units, self.evalw if windows is None else windows,
                              calibration=self.calib, **kw)
                self._calibrated = (units, first.inner.calibrated)
                return first
            kw = {**self._calibrated[1], **kw}
        return Judge(self.model, units, self.evalw if windows is None else windows, **kw)


class Judge:
    """Rows of unit -> scheme assignments: bits per weight, KL ± SE, PPL and top-1 from
    fp4sense's judge (:class:`fp4sense.planning.select.Judge`, the one ``quantize
    --select-plans`` measures with), each kept in ``done`` when given."""

    def __init__(self, model, units, windows, done: Done | None = None, **kw):
        from fp4sense.planning.select import Judge as Measure

        self.units, self.done = units, done
        self.by_name = units.by_name()
        self.total = sum(u.numel for u in units.units)
        self.inner = Measure(model, units, windows, **kw)

    def bits(self, assign: dict[str, str]) -> float:
        """Bits per weight of ``assign``, in theory (the plan's count)."""
        from fp4sense.planning.milp import unit_bits

        return sum(unit_bits(self.by_name[u], s) * self.by_name[u].numel
                   for u, s in assign.items()) / self.total

    def row(self, key: str, assign: dict[str, str], **extra) -> dict:
        """The measured row of ``assign`` (from ``done`` when it finished before)."""
        if self.done is not None and key in self.done:
            return self.done[key]
        t = time.perf_counter()
        item = {"key": key, "bits": self.bits(assign), **self.inner.measure(assign),
                **extra, "wall_s": round(time.perf_counter() - t, 1)}
        if self.done is not None:
            self.done.keep(item)
        if key:
            print(f"{key}: bits {item['bits']:.3f} KL {item['kl']:.4f}", flush=True)
        return item

    def kl(self, assign: dict[str, str]) -> float:
        """The KL of ``assign`` alone (not kept)."""
        return self.inner(assign)

    def base_ppl(self) -> float:
        return self.inner.base_ppl()

    def release(self) -> None:
        """Free the replay caches (the judge measures no more)."""
        self.inner.analysis.release_replay()
