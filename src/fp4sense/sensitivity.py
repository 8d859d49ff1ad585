"""Measured and estimated FP4 sensitivity of a model's units, in views -> SensitivityReport.

*Measured*: the real damage when only the perturbed units run fake-quantized
(:mod:`fp4sense.fakequant`), as KL(base || quantized), ΔPPL and top-1 agreement on the
analysis windows, each with its standard error over windows. The unquantized model's
output of every block is cached once per window; a perturbation whose first changed
block is ``b`` replays the cached output for blocks ``< b`` (the block's own forward is
swapped for a lookup, so the model's own forward still builds masks and position
embeddings) and computes only blocks ``b..L-1``.

*Estimated*: one forward + backward per window scores every (linear, scheme) at once by
the diagonal Fisher form of the output error, ``½ Σ (g ⊙ ΔY)²`` per predicted token,
where ``g`` is the gradient of the log-likelihood of tokens sampled from the base model
(the Fisher of KL(base || ·)) at the linear's output and ``ΔY`` the change of that output
when weights (and, for W4A4 / W8A8, inputs) are fake-quantized. Units and views sum
their linears' scores.

Views: ``component`` (one kind in every block, fused groups and their single linears),
``block_isolate`` (one block quantized), ``block_protect`` (all blocks but one),
``model`` (everything; the uniform baseline), ``grid`` (every unit alone).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from tqdm.auto import tqdm

from fp4sense import __version__
from fp4sense.fakequant import activation_quantizer, quantize_weights
from fp4sense.metrics import window_metrics
from fp4sense.schemes import get_scheme
from fp4sense.units import Unit, UnitMap, find_units, model_fingerprint, model_name

__all__ = [
    "MODES",
    "REPORT_VERSION",
    "VIEWS",
    "Entry",
    "ReportError",
    "SensitivityReport",
    "analyze",
    "check_request",
]

#: Version of the sensitivity.json layout (bump when a field changes meaning).
REPORT_VERSION = 1
#: Bump when a change of the computation makes cached entries stale.
CACHE_VERSION = 1
VIEWS = ("component", "block", "grid")
MODES = ("measured", "estimated")
#: Report views each CLI view expands to.
_VIEW_PARTS = {"component": ("component",), "block": ("model", "block_isolate",
                                                       "block_protect"), "grid": ("grid",)}
#: Memory for fake-quantized weights kept between perturbations.
WEIGHT_CACHE_BYTES = 1024 * 2**20
#: Memory for the base model's log-probs; beyond it they are recomputed from the cached
#: last block output (only the head runs) when needed.
BASE_LOGPROB_BYTES = 1024 * 2**20


class ReportError(ValueError):
    """A sensitivity report that cannot be used here (other model, version, schemes)."""


@dataclass(frozen=True)
class Entry:
    """Damage of one perturbation: ``view`` / ``target`` quantized with ``scheme``."""

    view: str
    scheme: str
    target: str
    mode: str
    kl: float
    kl_se: float
    dppl: float | None = None
    dppl_se: float | None = None
    top1: float | None = None
    top1_se: float | None = None
    block_forwards: int = 0

    @property
    def key(self) -> str:
        return f"{self.mode}|{self.view}|{self.scheme}|{self.target}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SensitivityReport:
    """Everything an analysis found; the planner and the recipe modifier read it."""

    model: str
    model_fingerprint: str
    text: dict
    schemes: list[str]
    units: UnitMap
    entries: list[Entry]
    base_ppl: float
    activation_stats: dict[str, dict] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    cost: dict = field(default_factory=dict)
    correlations: list[dict] = field(default_factory=list)
    version: int = REPORT_VERSION
    fp4sense_version: str = __version__

    # --- queries ----------------------------------------------------------------------
    def table(self, view: str, scheme: str, mode: str = "measured") -> dict[str, Entry]:
        """target -> entry for one view, scheme and mode."""
        return {e.target: e for e in self.entries
                if e.view == view and e.scheme == scheme and e.mode == mode}

    def unit_scores(self, scheme: str, mode: str = "measured") -> dict[str, float]:
        """unit name -> KL (measured) or estimate, from the grid view."""
        return {t: e.kl for t, e in self.table("grid", scheme, mode).items()}

    def views(self) -> list[tuple[str, str, str]]:
        return sorted({(e.view, e.scheme, e.mode) for e in self.entries})

    # --- files ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("units", "entries")}
        d["units"] = self.units.to_dict()
        d["entries"] = [e.to_dict() for e in self.entries]
        return {"version": self.version, **{k: v for k, v in d.items() if k != "version"}}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=True))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, model_fingerprint: str | None = None
             ) -> SensitivityReport:
        """Read a report; refuse another layout version or (when given) another model."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportError(f"{path}: not a readable sensitivity report ({exc})") from None
        version = d.get("version") if isinstance(d, dict) else None
        if version != REPORT_VERSION:
            raise ReportError(f"{path}: report layout version {version!r}, this fp4sense "
                              f"reads version {REPORT_VERSION}; run `fp4sense analyze` again")
        missing = [k for k in ("model", "model_fingerprint", "schemes", "units", "entries")
                   if k not in d]
        if missing:
            raise ReportError(f"{path}: not a complete sensitivity report (no "
                              f"{', '.join(missing)}); run `fp4sense analyze` again")
        if model_fingerprint is not None and d["model_fingerprint"] != model_fingerprint:
            raise ReportError(
                f"{path} was made for model {d['model']!r} (fingerprint "
                f"{d['model_fingerprint']}), not this one ({model_fingerprint}); analyze "
                "this model or pass its own report")
        try:
            entries = [Entry(**e) for e in d.pop("entries")]
            units = UnitMap.from_dict(d.pop("units"))
            d.pop("version")
            report = cls(units=units, entries=entries, version=version, **d)
        except (KeyError, TypeError, ValueError) as exc:
            kind = type(exc).__name__
            raise ReportError(f"{path}: not a sensitivity report fp4sense can read ({kind}: "
                              f"{exc}); run `fp4sense analyze` again") from None
        for e in report.entries:
            if not isinstance(e.kl, (int, float)) or isinstance(e.kl, bool) or \
                    not math.isfinite(e.kl) or e.kl < -KL_ROUNDING:
                raise ReportError(f"{path}: entry {e.view} / {e.target} / {e.scheme} has KL "
                                  f"{e.kl!r}; KL is a finite number >= 0: the file is damaged "
                                  "or edited, run `fp4sense analyze` again")
        return report


#: measured KL of an almost harmless change can come out a hair below zero in float32
KL_ROUNDING = 1e-6


# --- statistics -----------------------------------------------------------------------
def _mean_se(values: list[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return float(v.mean()), se


# --- cache ----------------------------------------------------------------------------
class _Cache:
    """Append-only JSON lines, one per finished entry; a torn last line is ignored."""

    def __init__(self, path: Path | None):
        self.path = path
        self.items: dict[str, dict] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                    self.items[item["key"]] = item
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def get(self, key: str) -> dict | None:
        return self.items.get(key)

    def put(self, key: str, value: dict) -> None:
        item = {"key": key, **value}
        self.items[key] = item
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a+") as fh:
                # a line torn by a killed run: end it, so this entry starts a line of its own
                fh.seek(0, os.SEEK_END)
                if fh.tell():
                    fh.seek(fh.tell() - 1)
                    if fh.read(1) != "\n":
                        fh.write("\n")
                fh.write(json.dumps(item) + "\n")


def cache_key(fingerprint: str, windows: torch.Tensor) -> str:
    """Cache identity: model weights, analysis tokens, and the computation's version."""
    h = hashlib.sha256()
    h.update(f"{CACHE_VERSION}|{fingerprint}|{tuple(windows.shape)}".encode())
    h.update(windows.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:20]


# --- the analysis ---------------------------------------------------------------------
Perturbation = dict[str, tuple[Unit, str]]  # linear name -> (its unit, scheme)


class _BlockStore:
    """Offloaded decoder blocks: each block's parameters live in a safetensors file and are
    loaded just before the block runs, then dropped (kept through a backward pass until
    :meth:`release_all`). Perturbations are overrides applied on load."""

    def __init__(self, model, blocks_path: str, folder: Path):
        from safetensors.torch import save_file

        self.blocks = model.get_submodule(blocks_path)
        self.prefix = blocks_path
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.overrides: dict[str, torch.Tensor] = {}
        self.loaded: set[int] = set()
        self.handles = []
        for i, block in enumerate(self.blocks):
            state = {n: p.data.contiguous() for n, p in block.named_parameters()}
            save_file(state, self.folder / f"block_{i}.safetensors")
            self.handles.append(block.register_forward_pre_hook(self._load_hook(i)))
            self.handles.append(block.register_forward_hook(self._drop_hook(i)))
            self._drop(i)

    def _file(self, i: int) -> Path:
        return self.folder / f"block_{i}.safetensors"

    def tensor(self, full_name: str) -> torch.Tensor:
        """One stored tensor by its model-level name (``model.layers.3.mlp.up_proj.weight``)."""
        from safetensors import safe_open

        index, _, rest = full_name[len(self.prefix) + 1:].partition(".")
        with safe_open(str(self._file(int(index))), "pt") as fh:
            return fh.get_tensor(rest)

    def _load(self, i: int) -> None:
        from safetensors.torch import load_file

        state = load_file(self._file(i))
        for name, param in self.blocks[i].named_parameters():
            full = f"{self.prefix}.{i}.{name}"
            param.data = self.overrides.get(full, state[name])
        self.loaded.add(i)

    def _drop(self, i: int) -> None:
        for param in self.blocks[i].parameters():
            param.data = torch.empty(0, dtype=param.dtype)
        self.loaded.discard(i)

    def _load_hook(self, i: int):
        def hook(module, args, kwargs=None):
            if "forward" not in vars(module):  # a replayed block needs no weights
                self._load(i)
        return hook

    def _drop_hook(self, i: int):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                self._drop(i)
        return hook

    def release_all(self) -> None:
        for i in list(self.loaded):
            self._drop(i)

    def close(self, restore: bool = True) -> None:
        """Remove the hooks; with ``restore``, give every block its weights back."""
        for h in self.handles:
            h.remove()
        if restore:
            for i in range(len(self.blocks)):
                self.overrides.clear()
                self._load(i)
        self.loaded.clear()


class _Originals(dict):
    """linear name -> unquantized weight, read from the block store when offloaded."""

    def __init__(self, modules: dict, store: _BlockStore | None):
        super().__init__()
        self.modules, self.store = modules, store

    def __missing__(self, name: str) -> torch.Tensor:
        if self.store is not None:
            return self.store.tensor(f"{name}.weight")
        return self.modules[name].weight.data


class _Analysis:
    """Holds the model, the windows, the block-output cache and the entry cache."""

    def __init__(self, model, windows: torch.Tensor, units: UnitMap, cache: _Cache,
                 progress: bool, offload_dir: Path | None = None):
        self.model = model
        self.windows = windows
        self.units = units
        self.cache = cache
        self.progress = progress
        self.blocks = model.get_submodule(units.blocks_path)
        self.modules = dict(model.named_modules())
        self.block_out: list[list] = []  # [block][window] -> the block's base output
        self.base_lp: list[torch.Tensor] = []
        self.stats: dict[str, dict] | None = None
        self.base_ppl_value = float("nan")
        self.block_forwards = 0
        # the unquantized weights (perturbations swap .data and put these back)
        if offload_dir is None:
            self.store = None
            self.original = {m: self.modules[m].weight.data for m in units.linears()}
        else:
            self.store = _BlockStore(model, units.blocks_path, offload_dir)
            self.original = _Originals(self.modules, self.store)
        self.qweights: dict[tuple[Unit, str], list[torch.Tensor]] = {}
        self.qweight_bytes = 0
        self.quant_out: tuple[str, list[list], dict] | None = None

    def quantized(self, unit: Unit, scheme: str) -> list[torch.Tensor]:
        """The unit's fake-quantized weights (kept while under WEIGHT_CACHE_BYTES)."""
        kept = self.qweights.get((unit, scheme))
        if kept is not None:
            return [w.to(self.original[m].dtype) for w, m in zip(kept, unit.modules,
                                                                  strict=True)]
        ws = quantize_weights(scheme, [self.original[m] for m in unit.modules])
        # quantized in bf16, so bf16 keeps them exactly at half the memory of float32
        compact = [w.to(torch.bfloat16) for w in ws]
        if all(torch.equal(c.to(w.dtype), w) for c, w in zip(compact, ws, strict=True)):
            ws_kept = compact
        else:  # pragma: no cover - a model whose weights are not bf16-derived
            ws_kept = ws
        size = sum(w.numel() * w.element_size() for w in ws_kept)
        if self.qweight_bytes + size <= WEIGHT_CACHE_BYTES:
            self.qweights[(unit, scheme)] = ws_kept
            self.qweight_bytes += size
        return ws

    # --- base pass: block outputs, base log-probs, activation statistics ---------------
    @torch.no_grad()
    def base_pass(self) -> None:
        if self.block_out:
            return
        n = len(self.windows)
        self.block_out = [[None] * n for _ in range(self.units.n_blocks)]
        self.base_lp = []
        nll: list[float] = []
        stats = {m: {"absmax": 0.0, "p999": []} for m in self.units.linears()}
        current = {"i": 0}

        def block_hook(index):
            def hook(module, args, output):
                self.block_out[index][current["i"]] = output
            return hook

        def stat_hook(name):
            def hook(module, args):
                x = args[0].detach().abs().float().reshape(-1)
                s = stats[name]
                s["absmax"] = max(s["absmax"], float(x.max()))
                k = max(1, int(round(0.001 * x.numel())))
                s["p999"].append(float(x.topk(k).values[-1]))
            return hook

        handles = [b.register_forward_hook(block_hook(i)) for i, b in enumerate(self.blocks)]
        handles += [self.modules[m].register_forward_pre_hook(stat_hook(m)) for m in stats]
        try:
            for i, window in enumerate(tqdm(self.windows, desc="base model", leave=False,
                                            disable=not self.progress)):
                current["i"] = i
                logits = self.model(input_ids=window[None]).logits[0].float()
                keep = (i + 1) * logits.numel() * 4 <= BASE_LOGPROB_BYTES
                log_probs = torch.log_softmax(logits, dim=-1)
                nll.append(-float(log_probs[:-1].gather(-1, window[1:, None]).double().mean()))
                self.base_lp.append(log_probs if keep else None)
        finally:
            for h in handles:
                h.remove()
        self.block_forwards += n * self.units.n_blocks
        self.base_ppl_value = math.exp(float(np.mean(nll)))
        self.stats = {}
        for m, s in stats.items():
            p999 = float(np.mean(s["p999"]))
            self.stats[m] = {"absmax": s["absmax"], "p999": p999,
                             "outlier_ratio": s["absmax"] / p999 if p999 > 0 else float("inf")}

    # --- perturbations ------------------------------------------------------------------
    @contextmanager
    def applied(self, perturbation: Perturbation):
        """Fake-quantize the named linears in place (and hook their inputs); undo after."""
        saved: list[tuple[torch.nn.Linear, torch.Tensor]] = []
        overridden: list[str] = []
        handles = []
        by_unit: dict[tuple[Unit, str], list[str]] = {}
        for name, (unit, scheme) in perturbation.items():
            by_unit.setdefault((unit, scheme), []).append(name)
        try:
            for (unit, scheme), names in by_unit.items():
                mods = [self.modules[m] for m in unit.modules]
                qws = self.quantized(unit, scheme)
                for name, mod, qw in zip(unit.modules, mods, qws, strict=True):
                    if name not in names:
                        continue
                    if self.store is not None:  # applied when the block is loaded
                        self.store.overrides[f"{name}.weight"] = qw
                        overridden.append(f"{name}.weight")
                    else:
                        saved.append((mod, mod.weight.data))
                        mod.weight.data = qw
                    quantize_input = activation_quantizer(
                        scheme, self.stats[name]["absmax"] if self.stats else None)
                    if quantize_input is not None:
                        handles.append(mod.register_forward_pre_hook(
                            lambda _m, args, q=quantize_input: (q(args[0]), *args[1:])))
            yield
        finally:
            for h in handles:
                h.remove()
            for mod, w in saved:
                mod.weight.data = w
            for key in overridden:
                self.store.overrides.pop(key, None)

    @contextmanager
    def replayed(self, start: int, current: dict, source: list[list]):
        """Blocks before ``start`` return their cached output in ``source`` for window
        ``current["i"]`` instead of computing it."""
        patched = []
        for index in range(start):
            block = self.blocks[index]

            def lookup(*args, _index=index, **kwargs):
                return source[_index][current["i"]]

            block.forward = lookup
            patched.append(block)
        try:
            yield
        finally:
            for block in patched:
                del block.forward  # back to the class's forward

    @contextmanager
    def captured(self, current: dict, into: list[list]):
        """Record every block's output per window into ``into``."""
        def hook(index):
            def record(module, args, output):
                into[index][current["i"]] = output
            return record

        handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(self.blocks)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def measure(self, perturbation: Perturbation, start: int | None = None,
                source: list[list] | None = None, capture: list[list] | None = None) -> dict:
        """Metrics of ``perturbation``. Blocks before ``start`` (default: the first
        perturbed block) replay ``source`` (default: the base model's outputs), which must
        be what those blocks compute under the perturbation. ``capture`` receives every
        block's output."""
        self.base_pass()
        if start is None:
            start = min(unit.block for unit, _ in perturbation.values())
        current = {"i": 0}
        per: dict[str, list[float]] = {"kl": [], "dnll": [], "agree": [], "nll": [],
                                       "base_nll": []}
        with ExitStack() as stack:
            stack.enter_context(self.applied(perturbation))
            stack.enter_context(self.replayed(start, current, source or self.block_out))
            if capture is not None:
                stack.enter_context(self.captured(current, capture))
            for i, window in enumerate(self.windows):
                current["i"] = i
                logits = self.model(input_ids=window[None]).logits[0].float()
                m = window_metrics(self.base_logprobs(i), logits, window)
                per["kl"].append(float(m["kl"].double().mean()))
                per["nll"].append(float(m["nll"].double().mean()))
                per["base_nll"].append(float(m["base_nll"].double().mean()))
                per["dnll"].append(per["nll"][-1] - per["base_nll"][-1])
                per["agree"].append(float(m["agree"].mean()))
        forwards = len(self.windows) * (self.units.n_blocks - start)
        self.block_forwards += forwards
        kl, kl_se = _mean_se(per["kl"])
        top1, top1_se = _mean_se(per["agree"])
        ppl, base_ppl = math.exp(np.mean(per["nll"])), math.exp(np.mean(per["base_nll"]))
        _, dnll_se = _mean_se(per["dnll"])
        return {"kl": kl, "kl_se": kl_se, "dppl": ppl - base_ppl, "dppl_se": ppl * dnll_se,
                "top1": top1, "top1_se": top1_se, "block_forwards": forwards}

    def release_replay(self) -> None:
        """Drop what measured runs replay (block outputs, base log-probs): the backward
        pass of the estimate needs the memory more."""
        self.block_out, self.base_lp, self.quant_out = [], [], None

    def quantized_outputs(self, scheme: str, perturbation: Perturbation) -> tuple[list, dict]:
        """Block outputs (and metrics) of the whole model quantized with ``scheme``: the
        blocks before ``b`` compute exactly this when all blocks but ``b`` are quantized."""
        if self.quant_out is None or self.quant_out[0] != scheme:
            self.quant_out = None  # free the previous scheme's outputs first
            outs = [[None] * len(self.windows) for _ in range(self.units.n_blocks)]
            result = self.measure(perturbation, capture=outs)
            self.quant_out = (scheme, outs, result)
        return self.quant_out[1], self.quant_out[2]

    @torch.no_grad()
    def base_logprobs(self, i: int) -> torch.Tensor:
        """The base model's log-probs of window ``i`` (stored, or from the cached last
        block output through the model's head)."""
        if self.base_lp[i] is not None:
            return self.base_lp[i]
        current = {"i": i}
        with self.replayed(self.units.n_blocks, current, self.block_out):
            logits = self.model(input_ids=self.windows[i][None]).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def base_ppl(self) -> float:
        """The unquantized model's perplexity on the windows (from the base pass)."""
        if self.stats is None:
            self.base_pass()
        return self.base_ppl_value

    # --- estimated pass -----------------------------------------------------------------
    def estimate(self, schemes: Sequence[str], seed: int = 0,
                 context: Perturbation | None = None) -> dict[tuple[str, str], list]:
        """(linear, scheme) -> per-window estimated KL contribution; with ``context``,
        at the model where that perturbation is applied (a plan's other units quantized)."""
        if self.stats is None:
            self.base_pass()  # input maxima for NVFP4 activations
        linears = self.units.linears()
        unit_of = {m: u for u in self.units.units for m in u.modules}
        feasible = {(m, s) for m in linears for s in schemes
                    if unit_of[m].why_infeasible(s) is None}
        scores: dict[tuple[str, str], list[float]] = {k: [] for k in feasible}
        acts = {(m, s): activation_quantizer(s, self.stats[m]["absmax"])
                for m, s in feasible}
        inputs: dict[str, torch.Tensor] = {}
        outputs: dict[str, torch.Tensor] = {}
        window_scores: dict[tuple[str, str], float] = {}
        norm = {"tokens": 1}

        def quantized_weight(name: str, scheme: str) -> torch.Tensor:
            unit = unit_of[name]
            return self.quantized(unit, scheme)[unit.modules.index(name)]

        def fwd_hook(name):
            def hook(module, args, output):
                inputs[name] = args[0].detach()
                outputs[name] = output.detach()
                if output.requires_grad:
                    output.register_hook(grad_hook(name, module))
            return hook

        def grad_hook(name, module):
            @torch.no_grad()
            def hook(grad):
                g2 = grad.float().pow(2)
                x, y = inputs.pop(name), outputs.pop(name)
                if context:  # the change is measured from the unquantized linear
                    y = torch.nn.functional.linear(x, self.original[name], module.bias)
                for s in schemes:
                    if (name, s) not in feasible:
                        continue
                    act = acts[(name, s)]
                    xq = act(x) if act is not None else x
                    dy = torch.nn.functional.linear(xq, quantized_weight(name, s),
                                                    module.bias) - y
                    window_scores[(name, s)] = float(
                        0.5 * (g2 * dy.float().pow(2)).sum() / norm["tokens"])
            return hook

        embed = self.model.get_input_embeddings()
        handles = [embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True))]
        handles += [self.modules[m].register_forward_hook(fwd_hook(m)) for m in linears]
        gen = torch.Generator().manual_seed(seed)
        was_training = [p.requires_grad for p in self.model.parameters()]
        self.model.requires_grad_(False)
        stack = ExitStack()
        try:
            if context:
                stack.enter_context(self.applied(context))
            for window in tqdm(self.windows, desc="estimating (forward + backward)",
                               leave=False, disable=not self.progress):
                window_scores.clear()
                with torch.enable_grad():
                    logits = self.model(input_ids=window[None]).logits[0, :-1].float()
                    log_probs = torch.log_softmax(logits, dim=-1)
                    sampled = torch.multinomial(log_probs.detach().exp(), 1, generator=gen)
                    norm["tokens"] = logits.shape[0]
                    log_probs.gather(-1, sampled).sum().backward()
                if self.store is not None:
                    self.store.release_all()
                for key in feasible:
                    scores[key].append(window_scores.get(key, 0.0))
                inputs.clear()
                outputs.clear()
        finally:
            stack.close()
            for h in handles:
                h.remove()
            for p, flag in zip(self.model.parameters(), was_training, strict=True):
                p.requires_grad_(flag)
        self.block_forwards += 2 * len(self.windows) * self.units.n_blocks
        return scores


# --- views ----------------------------------------------------------------------------
def _targets(view: str, units: UnitMap, blocks: Iterable[int] | None
             ) -> list[tuple[str, list[tuple[Unit, tuple[str, ...]]]]]:
    """(target, [(unit, linears of it to quantize)]) for each target of a view."""
    out = []
    if view == "component":
        for kind in units.kinds:
            members = units.of_kind(kind)
            out.append((kind, [(u, u.modules) for u in members]))
            if members[0].fused:  # the single linears of a fused group as well
                prefix = units.blocks_path
                for part in range(len(members[0].modules)):
                    rel = members[0].modules[part].split(".", prefix.count(".") + 2)[-1]
                    out.append((rel, [(u, (u.modules[part],)) for u in members]))
    elif view == "model":
        out.append(("all", [(u, u.modules) for u in units.units]))
    elif view == "block_isolate":
        for b in range(units.n_blocks):
            out.append((str(b), [(u, u.modules) for u in units.of_block(b)]))
    elif view == "block_protect":
        for b in range(units.n_blocks):
            out.append((str(b), [(u, u.modules) for u in units.units if u.block != b]))
    elif view == "grid":
        keep = set(blocks) if blocks is not None else None
        for u in units.units:
            if keep is None or u.block in keep:
                out.append((u.name, [(u, u.modules)]))
    else:  # pragma: no cover - checked by analyze()
        raise ValueError(view)
    return out


def check_request(schemes: Sequence[str], views: Sequence[str], modes: Sequence[str]) -> list[str]:
    names = [get_scheme(s).name for s in schemes]  # raises with the menu listed
    if not names or not views or not modes:
        raise ValueError("give at least one scheme, one view and one mode (e.g. --schemes "
                         "NVFP4 --views component)")
    for v in views:
        if v not in VIEWS:
            raise ValueError(f"unknown view {v!r}; choose from {', '.join(VIEWS)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    idle = [n for n in names if not get_scheme(n).quantizes]
    if idle:
        raise ValueError(f"{idle[0]} leaves a unit alone: its damage is zero; drop it from "
                         "--schemes")
    return names


def analyze(
    model,
    windows: torch.Tensor,
    schemes: Sequence[str] = ("NVFP4", "MXFP4"),
    views: Sequence[str] = ("component", "block"),
    modes: Sequence[str] = ("measured",),
    grid_blocks: Iterable[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    text: dict | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    context: dict[str, str] | None = None,
    offload_dir: str | os.PathLike | None = None,
) -> SensitivityReport:
    """Run the analysis; finished entries are cached under ``cache_dir`` (resumable).

    :param model: a Hugging Face causal LM in float32 on CPU (or any device).
    :param windows: (n, T) analysis token windows.
    :param grid_blocks: measure the grid for these blocks only (default: all).
    :param context: unit name -> scheme: estimate at the model quantized so (the
        planner's refinement round re-scores units in the context of a plan).
    :param offload_dir: keep only the running decoder block's weights in memory, the
        others in safetensors files in this folder (models larger than memory); the
        model gets its weights back at the end.
    """
    schemes = check_request(schemes, views, modes)
    t0 = time.perf_counter()
    units = find_units(model, windows[:1, :16])
    if grid_blocks is not None:
        grid_blocks = list(grid_blocks)
        absent = sorted(set(grid_blocks) - set(range(units.n_blocks)))
        if absent:
            raise ValueError(f"grid block(s) {', '.join(map(str, absent))} do not exist: the "
                             f"model has {units.n_blocks} decoder blocks (0–"
                             f"{units.n_blocks - 1})")
    fingerprint = model_fingerprint(model)
    key = cache_key(fingerprint, windows)
    cache = _Cache(Path(cache_dir) / f"{key}.jsonl" if cache_dir else None)
    if cache.items:
        log(f"resuming: {len(cache.items)} cached results ({cache.path})")
    run = _Analysis(model, windows, units, cache, progress,
                    Path(offload_dir) if offload_dir is not None else None)
    try:
        return _run_views(run, model, windows, units, cache, schemes, views, modes,
                          grid_blocks, text, context, fingerprint, key, t0)
    finally:
        if run.store is not None:
            run.store.close(restore=True)


def _run_views(run: _Analysis, model, windows, units, cache, schemes, views, modes,
               grid_blocks, text, context, fingerprint, key, t0) -> SensitivityReport:

    skipped = [{"unit": u.name, "scheme": s, "reason": u.why_infeasible(s)}
               for u in units.units for s in schemes if u.why_infeasible(s)]
    entries: list[Entry] = []
    view_parts = [p for v in views for p in _VIEW_PARTS[v]]
    cost = {"measured_block_forwards": 0, "naive_block_forwards": 0, "cached_entries": 0,
            "seconds": {}}

    if "measured" in modes:
        jobs = []
        for scheme in schemes:  # scheme outermost: protect reuses that scheme's outputs
            for part in view_parts:
                for target, members in _targets(part, units, grid_blocks):
                    pert = {m: (u, scheme) for u, mods in members for m in mods
                            if u.why_infeasible(scheme) is None}
                    if pert:
                        jobs.append((part, scheme, target, pert))
        t = time.perf_counter()
        bar = tqdm(jobs, desc="measuring", disable=not run.progress, unit="run")
        for part, scheme, target, pert in bar:
            bar.set_postfix_str(f"{part} {scheme} {target}"[:40])
            k = f"measured|{part}|{scheme}|{target}"
            hit = cache.get(k)
            if hit is not None:
                result = hit
                cost["cached_entries"] += 1
            elif part == "block_protect":
                # blocks before b compute what they compute in the fully quantized model
                b = int(target)
                everything = {m: (u, scheme) for u in units.units for m in u.modules
                              if u.why_infeasible(scheme) is None}
                source, _ = run.quantized_outputs(scheme, everything)
                result = run.measure(pert, start=b, source=source)
                cache.put(k, result)
            elif part == "model":
                _, result = run.quantized_outputs(scheme, pert)
                cache.put(k, result)
            else:
                result = run.measure(pert)
                cache.put(k, result)
            if hit is None:
                cost["naive_block_forwards"] += len(windows) * units.n_blocks
            entries.append(Entry(part, scheme, target, "measured", **{
                f: result[f] for f in ("kl", "kl_se", "dppl", "dppl_se", "top1", "top1_se",
                                       "block_forwards")}))
        cost["seconds"]["measured"] = round(time.perf_counter() - t, 2)
        if run.block_forwards:  # the naive way needs the base model's pass too
            cost["naive_block_forwards"] += len(windows) * units.n_blocks
        cost["measured_block_forwards"] = run.block_forwards

    if "estimated" in modes:
        run.release_replay()
        t = time.perf_counter()
        k = "estimated|linears|" + ",".join(schemes)
        pert = None
        if context:
            by_name = units.by_name()
            pert = {m: (by_name[u], s) for u, s in sorted(context.items())
                    if get_scheme(s).quantizes for m in by_name[u].modules}
            k += "|context=" + hashlib.sha256(json.dumps(sorted(context.items())).encode()
                                              ).hexdigest()[:12]
        hit = cache.get(k)
        if hit is None:
            raw = run.estimate(schemes, context=pert)
            cache.put(k, {"scores": {f"{m}|{s}": v for (m, s), v in raw.items()}})
        else:
            raw = {tuple(key_.split("|")): v for key_, v in hit["scores"].items()}
            cost["cached_entries"] += 1
        cost["seconds"]["estimated"] = round(time.perf_counter() - t, 2)
        cost["estimated_forward_backward_passes"] = len(windows)
        for part in ["grid", *[p for p in view_parts if p != "grid"]]:
            for scheme in schemes:
                for target, members in _targets(part, units, None):
                    per_window = [raw[(m, scheme)] for u, mods in members for m in mods
                                  if (m, scheme) in raw]
                    if not per_window:
                        continue
                    summed = np.sum(np.asarray(per_window), axis=0).tolist()
                    kl, se = _mean_se(summed)
                    entries.append(Entry(part, scheme, target, "estimated", kl, se))

    if run.stats is None:
        cached_stats = cache.get("stats")
        if cached_stats is None:
            run.base_pass()
    if run.stats is not None and cache.get("stats") is None:
        cache.put("stats", {"stats": run.stats, "base_ppl": run.base_ppl()})
    stats_item = cache.get("stats")
    report = SensitivityReport(
        model=model_name(model), model_fingerprint=fingerprint,
        text={**(text or {}), "windows": int(windows.shape[0]),
              "window_tokens": int(windows.shape[1]), "cache_key": key},
        schemes=list(schemes), units=units, entries=entries,
        base_ppl=stats_item["base_ppl"], activation_stats=stats_item["stats"],
        skipped=skipped, cost=cost,
    )
    cost["total_seconds"] = round(time.perf_counter() - t0, 2)
    report.correlations = correlations(report)
    return report


def correlations(report: SensitivityReport) -> list[dict]:
    """Spearman ρ between measured and estimated values wherever both exist."""
    out = []
    for view, scheme, mode in report.views():
        if mode != "measured":
            continue
        measured = report.table(view, scheme, "measured")
        estimated = report.table(view, scheme, "estimated")
        common = sorted(set(measured) & set(estimated))
        if len(common) >= 3:
            with warnings.catch_warnings():  # constant input: rho is undefined (nan)
                warnings.simplefilter("ignore", stats.ConstantInputWarning)
                rho = float(stats.spearmanr([measured[t].kl for t in common],
                                            [estimated[t].kl for t in common]).statistic)
            out.append({"view": view, "scheme": scheme, "n": len(common), "spearman": rho})
    return out
