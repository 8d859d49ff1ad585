"""The analysis engine: the unquantized model's block outputs replayed under each
perturbation (measured), and one forward + backward per window scoring every linear
(estimated). Views decide what to perturb (:mod:`fp4sense.diagnosis.views`).

A measured run walks the blocks, not the windows: from its first perturbed block on,
each block runs every window (with the base pass's arguments) before the next starts, so
an offloaded block is read, and its weights quantized, once per run."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fp4sense.diagnosis import blockio
from fp4sense.diagnosis.cache import EntryCache
from fp4sense.diagnosis.clips import choose_input_clips
from fp4sense.diagnosis.footprint import BASE_LOGPROB_BYTES, WEIGHT_CACHE_BYTES
from fp4sense.diagnosis.stats import InputStats, mean_se
from fp4sense.inputs.models import quantization_dtypes
from fp4sense.numerics.fakequant import activation_quantizer, input_absmax
from fp4sense.numerics.metrics import window_metrics
from fp4sense.numerics.schemes import get_scheme
from fp4sense.runtime.memory import mapped_allocations
from fp4sense.structure.experts import expert_hooks
from fp4sense.structure.offload import BlockStore, Originals
from fp4sense.structure.units import Unit, UnitMap, quantize_unit

__all__ = ["Analysis", "Perturbation"]

Perturbation = dict[str, tuple[Unit, str]]  # linear name -> (its unit, scheme)


class Analysis:
    """Holds the model, the windows, the block-output cache and the entry cache."""

    def __init__(self, model, windows: torch.Tensor, units: UnitMap, cache: EntryCache,
                 progress: bool, offload_dir: Path | None = None,
                 device: torch.device | None = None, rounded=None):
        self.model = model
        self.rounded = rounded  # given quantized weights (quantization.rounded.RoundedWeights)
        # everything computes where the model is (offloaded blocks are loaded there)
        self.device = torch.device(device) if device is not None else next(
            model.parameters()).device
        self.windows = windows.to(self.device)
        self.units = units
        self.cache = cache
        self.progress = progress
        self.blocks = model.get_submodule(units.blocks_path)
        self.modules = dict(model.named_modules())
        self.block_out: list[list] = []  # [block][window] -> the block's base output
        #: [block][window] -> the block's (args, kwargs) in the base pass, its hidden input
        #: left out (the previous block's output; the first block's is ``first_in``)
        self.calls: list[list] = []
        self.first_in: list[torch.Tensor] = []
        self.base_lp: list[torch.Tensor] = []
        self.stats: dict[str, dict] | None = None
        #: linear -> E[x^2] per input channel over the windows (weights the scale search)
        self.importance: dict[str, torch.Tensor] = {}
        self.base_ppl_value = float("nan")
        self.block_forwards = 0
        self.routing: dict[str, list[int]] = {}  # MoE unit -> tokens routed to each expert
        self.rotations: tuple[int, ...] = ()  # the rotated schemes' widths (their input maxima)
        self.clips: tuple[int, ...] = ()  # the inputs whose tensor scale *_ACLIP chooses
        # the unquantized weights (perturbations swap .data and put these back)
        attached = getattr(model, "fp4sense_blocks", None)  # load_model(low_memory=True)
        if attached is not None:
            self.store = attached
            self.store.device = self.device
            self.original = Originals(self.modules, self.store)
            model.to(self.device)
        elif offload_dir is None:
            self.store = None
            self.original = {m: self.modules[m].weight.data for m in units.linears()}
        else:
            self.store = BlockStore(model, units.blocks_path, offload_dir, self.device)
            self.original = Originals(self.modules, self.store)
            model.to(self.device)  # the blocks are empty now: the rest moves
        self.weight_dtype, self.stored_dtype = quantization_dtypes(model)
        self.qweights: OrderedDict[tuple, list] = OrderedDict()  # (unit, scheme[, index])
        self.qweight_bytes = 0
        self.qweight_limit = WEIGHT_CACHE_BYTES
        self.quant_out: tuple[str, list[list], dict] | None = None

    def quantized(self, unit: Unit, scheme: str) -> list[torch.Tensor]:
        """The unit's fake-quantized weights, in the model's dtype (last used kept)."""
        return [w.to(self.original[m].dtype)
                for w, m in zip(self._kept(unit, scheme), unit.modules, strict=True)]

    def _quantized_one(self, unit: Unit, scheme: str, index: int) -> torch.Tensor:
        """One of the unit's fake-quantized weights, alone unless the unit's are kept."""
        whole = (unit, scheme) in self.qweights
        return self._kept(unit, scheme, None if whole else index)[index].to(
            self.original[unit.modules[index]].dtype)

    def _kept(self, unit: Unit, scheme: str, only: int | None = None) -> list:
        """The unit's quantized weights, in bf16 or given (``only``: that one; None others)."""
        key = (unit, scheme) if only is None else (unit, scheme, only)
        kept = self.qweights.get(key)
        if kept is not None:
            self.qweights.move_to_end(key)
            return kept
        ws = self.rounded.unit(unit, scheme, only, self.device) if self.rounded else None
        if ws is None:  # not given: rounded to nearest
            group = next(p for p in unit.scale_groups if only is None or only in p)
            turn = get_scheme(scheme).rotation  # a rotated scheme: its input's E[x^2]
            imps = [self.importance.get(m if turn is None else (m, turn)) for m in unit.modules]
            # streamed: the temporaries leave memory when freed (a block's worth at a time)
            with mapped_allocations() if self.store is not None else nullcontext():
                # kept in bf16, what transformers and vLLM dequantize them to
                ws = quantize_unit(scheme, unit, [self.original[m] if only is None or i in group
                                                  else None for i, m in enumerate(unit.modules)],
                                   importance=imps if any(i is not None for i in imps) else None,
                                   out_dtype=torch.bfloat16, only=only, dtype=self.weight_dtype,
                                   scale_dtype=self.stored_dtype)
        size = _nbytes(ws)
        if size <= self.qweight_limit:  # the least recently used make room
            while self.qweights and self.qweight_bytes + size > self.qweight_limit:
                _, old = self.qweights.popitem(last=False)
                self.qweight_bytes -= _nbytes(old)
            self.qweights[key] = ws
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
        experts = {m for u in self.units.units if u.experts for m in u.modules}
        stats = InputStats(self.units.linears(), self.rotations, unrotated=experts)
        self.calls = [[None] * n for _ in range(self.units.n_blocks)]
        self.first_in = [None] * n
        current = {"i": 0}
        memo: dict = {}  # one window's tensors shared by the blocks' calls (masks, rotary)

        def block_hook(index):
            def hook(module, args, output):
                self.block_out[index][current["i"]] = output
            return hook

        def call_hook(index):
            def hook(module, args, kwargs):
                if index == 0:
                    self.first_in[current["i"]] = blockio.hidden_input(args, kwargs).detach()
                args, kwargs = blockio.with_hidden_input(args, kwargs, None)
                self.calls[index][current["i"]] = blockio.moved(
                    blockio.uncached(args, kwargs), self.device, memo)
            return hook

        def stat_hook(name):
            def hook(module, args):
                stats.add(name, args[0])
            return hook

        handles = [b.register_forward_hook(block_hook(i)) for i, b in enumerate(self.blocks)]
        handles += [b.register_forward_pre_hook(call_hook(i), with_kwargs=True)
                    for i, b in enumerate(self.blocks)]
        handles += [self.modules[m].register_forward_pre_hook(stat_hook(m)) for m in stats.acc
                    if m not in experts]
        expert_handles, self.routing = expert_hooks(self.modules, self.units, stat_hook)
        handles += expert_handles
        try:
            for i, window in enumerate(tqdm(self.windows, desc="base model", leave=False,
                                            disable=not self.progress)):
                current["i"] = i
                memo.clear()
                logits = self.model(input_ids=window[None], **blockio.no_cache(self.model)
                                    ).logits[0].float()
                keep = (i + 1) * logits.numel() * 4 <= BASE_LOGPROB_BYTES
                log_probs = torch.log_softmax(logits, dim=-1)
                nll.append(-float(log_probs[:-1].gather(-1, window[1:, None]).double().mean()))
                self.base_lp.append(log_probs if keep else None)
        finally:
            for h in handles:
                h.remove()
        self.block_forwards += n * self.units.n_blocks
        self.base_ppl_value = math.exp(float(np.mean(nll)))
        self.stats, self.importance = stats.finish()
        if self.clips:  # the *_ACLIP schemes' fractions, one more pass
            for m, chosen in choose_input_clips(self, self.clips).items():
                self.stats[m].update(chosen)

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
                qws = (self.quantized(unit, scheme) if self.store is None
                       else [None] * len(mods))
                for name, mod, qw in zip(unit.modules, mods, qws, strict=True):
                    if name not in names:
                        continue
                    if self.store is not None:  # quantized when its block is loaded
                        self.store.overrides[f"{name}.weight"] = partial(
                            self._quantized_one, unit, scheme, unit.modules.index(name))
                        overridden.append(f"{name}.weight")
                    else:
                        saved.append((mod, mod.weight.data))
                        mod.weight.data = qw
                    quantize_input = activation_quantizer(
                        scheme, input_absmax(self.stats[name], scheme) if self.stats else None)
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
        ``current["i"]`` instead of computing it. Re-entrant: a replay inside another (the
        base log-probs of a window not stored, inside a measured run) gives the blocks back
        their outer replay, not the class's forward."""
        patched = []
        for index in range(start):
            block = self.blocks[index]

            def lookup(*args, _index=index, **kwargs):
                return source[_index][current["i"]]

            patched.append((block, block.__dict__.get("forward")))
            block.forward = lookup
        try:
            yield
        finally:
            for block, before in reversed(patched):
                if before is None:
                    del block.forward  # back to the class's forward
                else:
                    block.forward = before

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
        source = source or self.block_out
        n, n_blocks = len(self.windows), self.units.n_blocks
        outs = list(source[start - 1]) if start else list(self.first_in)
        with self.applied(perturbation):
            for b in range(start, n_blocks):  # block-major: each block loaded once
                with self.store.held(b) if self.store is not None else nullcontext():
                    for i in range(n):
                        x = blockio.hidden(outs[i]) if b else self.first_in[i]
                        args, kwargs = blockio.with_hidden_input(*self.calls[b][i], x)
                        outs[i] = self.blocks[b](*args, **kwargs)
                if capture is not None:
                    capture[b][:] = outs
        if capture is not None:
            for b in range(start):
                capture[b][:] = source[b]
        current = {"i": 0}
        per: dict[str, list[float]] = {"kl": [], "dnll": [], "agree": [], "nll": [],
                                       "base_nll": []}
        with self.replayed(n_blocks, current, [outs] * n_blocks):  # the head on the last
            for i, window in enumerate(self.windows):
                current["i"] = i
                logits = self.model(input_ids=window[None], **blockio.no_cache(self.model)
                                    ).logits[0].float()
                m = window_metrics(self.base_logprobs(i), logits, window)
                per["kl"].append(float(m["kl"].double().mean()))
                per["nll"].append(float(m["nll"].double().mean()))
                per["base_nll"].append(float(m["base_nll"].double().mean()))
                per["dnll"].append(per["nll"][-1] - per["base_nll"][-1])
                per["agree"].append(float(m["agree"].mean()))
        forwards = n * (n_blocks - start)
        self.block_forwards += forwards
        kl, kl_se = mean_se(per["kl"])
        top1, top1_se = mean_se(per["agree"])
        ppl, base_ppl = math.exp(np.mean(per["nll"])), math.exp(np.mean(per["base_nll"]))
        _, dnll_se = mean_se(per["dnll"])
        return {"kl": kl, "kl_se": kl_se, "dppl": ppl - base_ppl, "dppl_se": ppl * dnll_se,
                "top1": top1, "top1_se": top1_se, "block_forwards": forwards}

    def release_replay(self) -> None:
        """Drop what measured runs replay (block outputs, base log-probs): the backward
        pass of the estimate needs the memory more."""
        self.block_out, self.base_lp, self.quant_out = [], [], None
        self.calls, self.first_in = [], []

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
                 context: Perturbation | None = None, windows: Sequence[int] | None = None,
                 streamed: bool | None = None) -> dict[tuple[str, str], list]:
        """(linear, scheme) -> per-window estimated KL contribution (for ``windows``,
        default all); with ``context``, at the model where that perturbation is applied (a
        plan's other units quantized). ``streamed`` (default: when blocks are offloaded)
        holds one block's weights at a time (:mod:`fp4sense.diagnosis.estimate`)."""
        from fp4sense.diagnosis.estimate import estimate

        if windows is None:
            windows = range(len(self.windows))
        if streamed is None:
            streamed = self.store is not None
        return estimate(self, schemes, list(windows), seed, context, streamed)


def _nbytes(tensors) -> int:
    return sum(w.numel() * w.element_size() for w in tensors if w is not None)

