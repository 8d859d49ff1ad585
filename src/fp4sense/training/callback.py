"""The stability monitor in a user's own transformers ``Trainer``: every ``every`` steps,
each unit's gradient noise-to-signal ratio under the recipe on a fixed probe batch (the
recipe's wgrad against the exact one at the present weights), loss spikes and divergence
from the logged losses, one line each; ``report()`` says from which step each unit's FP4
gradients stop helping (ratio above 1/√3)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback

from fp4sense.structure.units import find_units
from fp4sense.training.estimate import estimate_training
from fp4sense.training.trials import Monitor

__all__ = ["FP4TrainingMonitor"]


class FP4TrainingMonitor(TrainerCallback):
    """``Trainer(..., callbacks=[FP4TrainingMonitor(probe_ids)])``.

    :param probe: (n, T) token ids the ratios are measured on (a few held windows)
    :param recipe: the FP4 training recipe (nvfp4, mxfp4)
    :param every: steps between two measurements
    :param log: where the one-line events go (default: print)
    """

    def __init__(self, probe: torch.Tensor, recipe: str = "nvfp4", every: int = 50,
                 log: Callable[[str], None] = print):
        self.probe, self.recipe, self.every, self.log = probe, recipe, every, log
        self.monitor = Monitor()
        self.steps: list[int] = []
        self._units = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return
        if self._units is None:
            self._units = find_units(model, self.probe[:1, :16].to(model.device))
        was_training = model.training
        grads = {n: p.grad for n, p in model.named_parameters()}  # the step's, kept
        for e in estimate_training(model, self.probe.to(model.device), self._units,
                                   self.recipe, 1):
            self.monitor.nsr.setdefault(e.name, []).append(e.nsr)
        for n, p in model.named_parameters():
            p.grad = grads[n]
        model.train(was_training)
        self.steps.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            before = len(self.monitor.events)
            self.monitor.step(state.global_step, float(logs["loss"]))
            for event in self.monitor.events[before:]:
                self.log(f"fp4sense monitor: {event}")

    def report(self) -> dict:
        """``{"events": [...], "stop_helping": {unit: step}, "nsr": {unit: [...]}}``."""
        stop = {unit: self.steps[i] for unit, i in self.monitor.first_unhelpful().items()}
        return {"events": self.monitor.events, "stop_helping": stop, "nsr": self.monitor.nsr,
                "steps": self.steps}
