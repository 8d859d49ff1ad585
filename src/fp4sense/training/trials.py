"""Short FP4 training trials: a few optimizer steps from one start, with the same data
order and seeds, under different precision policies, each scored by its loss on
held-aside windows against the all-BF16 run's: paired by seed and window, ± an SE that
counts both the seeds and the text drawn (the windows).

- the measured sensitivity: one trial per unit or block with only it in FP4 (all three
  GEMMs as the recipe says), the rest BF16;
- the arms that validate a policy (``train-trial``): ``bf16``, ``all-fp4``,
  ``nvidia-rule`` (first / last blocks in BF16 at the policy's share) and ``policy``.

During a trial a monitor keeps each unit's gradient noise-to-signal ratio (the recipe's
wgrad against the exact one, on the step's batch), flags a loss spike (above 1.5 × the
mean of the steps before) or divergence (non-finite, or above 3 × the first loss), and
names the first step from which a unit's FP4 gradients stop helping (ratio above 1/√3).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from fp4sense.numerics.training import Recipe, get_recipe
from fp4sense.numerics.training_linear import apply_training_policy
from fp4sense.training.estimate import NSR_LIMIT, estimate_training

__all__ = ["Arm", "Difference", "Monitor", "TrialResult", "held_aside_losses",
           "paired_differences", "run_trials", "unit_policy"]

SPIKE = 1.5
DIVERGED = 3.0


@dataclass
class Arm:
    """One run of a trial: a name and its policy (linear name -> precision)."""

    name: str
    policy: Mapping[str, object]


@dataclass
class Monitor:
    """What a run's stability monitor saw."""

    losses: list[float] = field(default_factory=list)
    nsr: dict[str, list[float]] = field(default_factory=dict)  # unit -> per checked step
    events: list[str] = field(default_factory=list)

    def step(self, i: int, loss: float) -> None:
        before = self.losses[:]
        self.losses.append(loss)
        if not math.isfinite(loss) or (before and loss > DIVERGED * before[0]):
            self.events.append(f"step {i}: diverged (loss {loss:.4g}, first {before[0]:.4g})"
                               if before else f"step {i}: diverged (loss {loss})")
        elif len(before) >= 2 and loss > SPIKE * sum(before) / len(before):
            self.events.append(f"step {i}: loss spike {loss:.4g} (mean before "
                               f"{sum(before) / len(before):.4g})")

    def first_unhelpful(self) -> dict[str, int]:
        """unit -> the index of the first check its noise-to-signal ratio is above 1/√3."""
        out = {}
        for unit, ratios in self.nsr.items():
            first = next((i for i, r in enumerate(ratios) if r > NSR_LIMIT), None)
            if first is not None:
                out[unit] = first
        return out

    def stop_helping(self, every: int) -> dict[str, int]:
        """unit -> the first step its noise-to-signal ratio is above 1/√3 (checked every
        ``every`` steps from step 0)."""
        return {unit: i * every for unit, i in self.first_unhelpful().items()}


@dataclass
class TrialResult:
    """An arm's held-aside loss (mean over seeds) and SE over seeds, in BF16 and under the
    recipe's forward, each held-aside window's loss per seed (the recipe's forward), and
    its monitor of the first seed."""

    loss: float
    se: float
    loss_bf16: float
    se_bf16: float
    per_seed: list[float]
    curves: list[list[float]]
    monitor: Monitor
    per_window: list[list[float]] = field(default_factory=list)  # seed -> window -> loss

    def to_dict(self) -> dict:
        return {"loss": self.loss, "se": self.se, "loss_bf16": self.loss_bf16,
                "se_bf16": self.se_bf16, "per_seed": self.per_seed, "curves": self.curves,
                "events": self.monitor.events, "nsr": self.monitor.nsr,
                "per_window": self.per_window}

    @classmethod
    def from_dict(cls, d: Mapping) -> TrialResult:
        """:meth:`to_dict` read back (a cached arm): its monitor as the first seed's."""
        monitor = Monitor(list(d["curves"][0]) if d["curves"] else [], dict(d.get("nsr", {})),
                          list(d.get("events", [])))
        return cls(d["loss"], d["se"], d["loss_bf16"], d["se_bf16"], list(d["per_seed"]),
                   [list(c) for c in d["curves"]], monitor,
                   [list(w) for w in d.get("per_window", [])])  # cached before: none


def unit_policy(units, recipe: str | Recipe) -> dict[str, str]:
    """Every linear of ``units`` in ``recipe`` (all three GEMMs)."""
    name = get_recipe(recipe).name
    return {m: name for u in units for m in u.modules}


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@torch.no_grad()
def held_aside_losses(model, windows: torch.Tensor, batch: int = 4) -> list[float]:
    """Each window's mean next-token loss (windows of one length: their mean is the loss
    over all of them), ``batch`` windows a forward."""
    out = []
    for part in windows.split(batch):
        logits = model(input_ids=part).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), part[:, 1:],
                                                 reduction="none")
        out += loss.mean(dim=1).tolist()
    return out


def run_trials(model: torch.nn.Module, train: torch.Tensor, held: torch.Tensor,
               arms: list[Arm], steps: int, seeds: int = 2, lr: float = 1e-4,
               batch: int = 2, monitor_units=None, monitor_recipe: str | Recipe = "nvfp4",
               monitor_every: int = 0,
               progress: Callable[[int], None] | None = None) -> dict[str, TrialResult]:
    """Train each arm for ``steps`` AdamW steps from the model's present weights (restored
    after each run), on batches of ``batch`` windows of ``train`` in a seeded order, and
    score it on ``held``: the loss with the arm's own forward (its policy) and in BF16.
    Seeds change the data order and stochastic rounding; every arm sees the same ones."""
    start = copy.deepcopy(model.state_dict())
    results = {}
    for arm in arms:
        losses, bf16_losses, curves, windows, first_monitor = [], [], [], [], None
        for seed in range(seeds):
            monitor = Monitor()
            model.load_state_dict(start)
            g = torch.Generator(train.device).manual_seed(seed)
            apply_training_policy(model, arm.policy, default="bf16", generator=g)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
            for i in range(steps):
                pick = order[(torch.arange(batch) + i * batch) % len(train)]
                ids = train[pick]
                if monitor_units and monitor_every and i % monitor_every == 0:
                    for e in estimate_training(model, ids, monitor_units, monitor_recipe, 1):
                        monitor.nsr.setdefault(e.name, []).append(e.nsr)
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                monitor.step(i, loss.item())
                if progress:
                    progress(1)
            model.eval()
            windows.append(held_aside_losses(model, held))
            losses.append(sum(windows[-1]) / len(windows[-1]))
            apply_training_policy(model, {}, default="bf16")
            bf16 = held_aside_losses(model, held)
            bf16_losses.append(sum(bf16) / len(bf16))
            curves.append(monitor.losses)
            first_monitor = first_monitor or monitor
        mean, se = _mean_se(losses)
        mean_bf16, se_bf16 = _mean_se(bf16_losses)
        results[arm.name] = TrialResult(mean, se, mean_bf16, se_bf16, losses, curves,
                                        first_monitor, windows)
    model.load_state_dict(start)
    apply_training_policy(model, {}, default="bf16")
    return results


@dataclass
class Difference:
    """An arm's held-aside loss minus the base arm's, paired by seed and window. ``se``
    counts both the seeds (``se_seeds``: over the seeds' window means) and the text drawn
    (``se_text``: over the windows' seed means; None for trials cached without their
    windows), added in quadrature; ``per_window``: each window's seed-mean difference."""

    delta: float
    se: float
    se_seeds: float
    se_text: float | None = None
    per_window: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"delta": self.delta, "se": self.se, "se_seeds": self.se_seeds,
                "se_text": self.se_text, "per_window": self.per_window}


def paired_differences(results: dict[str, TrialResult], base: str = "bf16"
                       ) -> dict[str, Difference]:
    """arm -> its :class:`Difference` to ``base`` (the same data order, draws and held-aside
    windows on both sides)."""
    ref = results[base]
    out = {}
    for name, r in results.items():
        if name == base:
            continue
        delta, se_seeds = _mean_se([a - b for a, b in zip(r.per_seed, ref.per_seed,
                                                          strict=True)])
        if not (r.per_window and ref.per_window):
            out[name] = Difference(delta, se_seeds, se_seeds)
            continue
        by_seed = [[a - b for a, b in zip(x, y, strict=True)]
                   for x, y in zip(r.per_window, ref.per_window, strict=True)]
        per_window = [sum(col) / len(col) for col in zip(*by_seed, strict=True)]
        se_text = _mean_se(per_window)[1]
        out[name] = Difference(delta, math.hypot(se_seeds, se_text), se_seeds, se_text,
                               per_window)
    return out
