"""An analysis run in stages (``analyze`` builds one): ``measure`` (the isolation runs of
every view's targets), ``estimate`` (the Fisher pass, every linear at once), ``stats``
(the base pass's input statistics and perplexity) and ``report`` (the
:class:`~fp4sense.diagnosis.results.SensitivityReport`). Each stage reads and fills the
cache, so a run resumes; under torchrun the ranks share the measured runs and the
estimate's windows."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from fp4sense.diagnosis.cache import EntryCache
from fp4sense.diagnosis.engine import Analysis
from fp4sense.diagnosis.results import Entry, SensitivityReport
from fp4sense.diagnosis.stats import correlations, mean_se
from fp4sense.numerics.schemes import get_scheme
from fp4sense.runtime import distributed
from fp4sense.structure.units import UnitMap, model_name

__all__ = ["ViewsRun"]


@dataclass
class ViewsRun:
    """The views of one analysis, computed stage by stage (call it to run them all)."""

    run: Analysis  # the engine: replay, the estimate, the base pass
    model: torch.nn.Module
    windows: torch.Tensor
    units: UnitMap
    cache: EntryCache
    schemes: list[str]
    views: Sequence[str]  # the --views options asked for
    modes: Sequence[str]  # measured, estimated
    grid_blocks: list[int] | None
    text: dict | None  # how the report names its text
    context: dict[str, str] | None  # unit -> scheme: estimate in the context of a plan
    fingerprint: str
    key: str  # the cache key
    t0: float  # when the analysis started
    log: Callable[[str], None]
    report_views: dict  # name -> ReportView, the registry the views are drawn from
    entries: list[Entry] = field(default_factory=list)
    cost: dict = field(default_factory=lambda: {
        "measured_block_forwards": 0, "naive_block_forwards": 0, "cached_entries": 0,
        "seconds": {}})

    def __post_init__(self) -> None:
        self.skipped = [{"unit": u.name, "scheme": s, "reason": u.why_infeasible(s)}
                        for u in self.units.units for s in self.schemes
                        if u.why_infeasible(s)]
        self.view_parts = [p.name for p in self.report_views.values()
                           if p.option in self.views]

    def __call__(self) -> SensitivityReport:
        if "measured" in self.modes:
            self.measure()
        if "estimated" in self.modes:
            self.estimate()
        return self.report(self.stats())

    def measure(self) -> None:
        """Every view's targets run fake-quantized, one target at a time (cached)."""
        run, units, cache, schemes, windows = (self.run, self.units, self.cache, self.schemes,
                                               self.windows)
        entries, cost, view_parts, report_views = (self.entries, self.cost, self.view_parts,
                                                   self.report_views)
        jobs = []
        for scheme in schemes:  # scheme outermost: protect reuses that scheme's outputs
            for part in view_parts:
                for target, members in report_views[part].targets(units, self.grid_blocks):
                    pert = {m: (u, scheme) for u, mods in members for m in mods
                            if u.why_infeasible(scheme) is None}
                    if pert:
                        jobs.append((part, scheme, target, pert))
        t = time.perf_counter()
        mine = distributed.shard(list(range(len(jobs))))
        bar = tqdm(mine, desc="measuring", disable=not run.progress, unit="run")
        results: dict[int, tuple[dict, bool]] = {}
        for n in bar:
            part, scheme, target, pert = jobs[n]
            bar.set_postfix_str(f"{part} {scheme} {target}"[:40])
            k = f"measured|{part}|{scheme}|{target}"
            hit = cache.get(k)
            if hit is None:
                result = report_views[part].measure(run, scheme, target, pert)
                cache.put(k, result)  # every rank appends its own, under a file lock
            results[n] = (hit if hit is not None else result, hit is not None)
        shares = distributed.gather((results, run.block_forwards))
        for share, _ in shares:
            results.update(share)
        for n, (part, scheme, target, _) in enumerate(jobs):
            result, was_cached = results[n]
            if was_cached:
                cost["cached_entries"] += 1
            else:
                cost["naive_block_forwards"] += len(windows) * units.n_blocks
            entries.append(Entry(part, scheme, target, "measured", **{
                f: result[f] for f in ("kl", "kl_se", "dppl", "dppl_se", "top1", "top1_se",
                                       "block_forwards")}))
        cost["seconds"]["measured"] = round(time.perf_counter() - t, 2)
        block_forwards = sum(forwards for _, forwards in shares)
        if block_forwards:  # the naive way needs the base model's pass too
            cost["naive_block_forwards"] += len(windows) * units.n_blocks
        cost["measured_block_forwards"] = block_forwards

    def estimate(self) -> None:
        """One forward + backward per window scores every (linear, scheme); a target's
        score is the sum of its linears' (cached)."""
        run, units, cache, schemes, windows = (self.run, self.units, self.cache, self.schemes,
                                               self.windows)
        entries, cost, view_parts, report_views = (self.entries, self.cost, self.view_parts,
                                                   self.report_views)
        context = self.context
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
            mine = distributed.shard(list(range(len(windows))))
            shares = distributed.gather(run.estimate(schemes, context=pert, windows=mine))
            raw = {key_: distributed.unshard([s[key_] for s in shares], len(windows))
                   for key_ in shares[0]}
            item = {"scores": {f"{m}|{s}": v for (m, s), v in raw.items()}}
            if distributed.is_main():
                cache.put(k, item)
            else:
                cache.items[k] = {"key": k, **item}
        else:
            raw = {tuple(key_.split("|")): v for key_, v in hit["scores"].items()}
            cost["cached_entries"] += 1
        cost["seconds"]["estimated"] = round(time.perf_counter() - t, 2)
        cost["estimated_forward_backward_passes"] = len(windows)
        for part in ["grid", *[p for p in view_parts if p != "grid"]]:
            for scheme in schemes:
                for target, members in report_views[part].targets(units, None):
                    per_window = [raw[(m, scheme)] for u, mods in members for m in mods
                                  if (m, scheme) in raw]
                    if not per_window:
                        continue
                    summed = np.sum(np.asarray(per_window), axis=0).tolist()
                    kl, se = mean_se(summed)
                    entries.append(Entry(part, scheme, target, "estimated", kl, se))

    def stats(self) -> dict:
        """The base pass's input statistics, perplexity and routing (cached)."""
        run, cache = self.run, self.cache
        if run.stats is None:
            cached_stats = cache.get("stats")
            if cached_stats is None:
                run.base_pass()
        if run.stats is not None and _newer(run.stats, cache.get("stats")):
            item = {"stats": run.stats, "base_ppl": run.base_ppl(), "routing": run.routing}
            if distributed.is_main():
                cache.put("stats", item)
            else:
                cache.items["stats"] = {"key": "stats", **item}
        return cache.get("stats")

    def report(self, stats_item: dict) -> SensitivityReport:
        """The report of every entry, with the estimate's rank correlations."""
        model, fingerprint, text, windows, key = (self.model, self.fingerprint, self.text,
                                                  self.windows, self.key)
        schemes, units, entries, skipped, cost, t0 = (self.schemes, self.units, self.entries,
                                                      self.skipped, self.cost, self.t0)
        report = SensitivityReport(
            model=model_name(model), model_fingerprint=fingerprint,
            text={**(text or {}), "windows": int(windows.shape[0]),
                  "window_tokens": int(windows.shape[1]), "cache_key": key},
            schemes=list(schemes), units=units, entries=entries,
            base_ppl=stats_item["base_ppl"], activation_stats=stats_item["stats"],
            routing=stats_item.get("routing", {}), skipped=skipped, cost=cost,
        )
        cost["total_seconds"] = round(time.perf_counter() - t0, 2)
        report.correlations = correlations(report)
        return report


def _newer(stats: dict, cached: dict | None) -> bool:
    """Whether this run's statistics hold what the cached ones lack (none cached, or an
    ``*_ACLIP`` scheme's choices an earlier run of other schemes did not make)."""
    if cached is None:
        return True
    old = cached.get("stats", {})
    return any(not set(v) <= set(old.get(m, {})) for m, v in stats.items())
