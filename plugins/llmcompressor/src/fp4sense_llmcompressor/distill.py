"""QuantizationAwareDistillationModifier: FP4 training (QAD) inside an llm-compressor recipe.

Placed after the quantization modifiers of a stage (``SensitivityGuidedModifier``, a
plain ``QuantizationModifier``, ``GPTQModifier``), it trains the weights to match the
unquantized model under the attached formats
(:func:`fp4sense.quantization.distill.distill`):

- with a ``GPTQModifier`` before it in the stage, after GPTQ (when the oneshot
  finalizes, before the checkpoint is saved): from GPTQ's rounded weights, under the
  scales GPTQ calibrated, quantizing with compressed-tensors' own ``forward_quantize``;
  the weights end on that grid, so compression stores the trained model exactly. The
  unquantized model's log-probs are taken at initialization, before GPTQ changes it;
- otherwise at initialization, before calibration: calibration and compression then run
  on the trained weights, every scale derived from them as usual.

Rotated linears (a plan's ``NVFP4_H16`` units) train as the checkpoint computes them,
``Q(x R) Q(W R)^T``: after GPTQ, compressed-tensors has fused the rotation into their
weights and rotates their inputs in a hook that runs before the training's own; before
calibration the rotation is not in the model yet, so the training applies the plan's
rotations itself (the plan of the stage's ``SensitivityGuidedModifier``), and the
oneshot rotates the trained weights afterwards. llm-compressor's QuIP / SpinQuant
transforms, which fp4sense does not compute, train after GPTQ only: before calibration
such a stage is refused.

Either way the checkpoint is the one a plain recipe writes::

    quant_stage:
      quant_modifiers:
        SensitivityGuidedModifier:
          plan: plan.json
        QuantizationAwareDistillationModifier:
          steps: 100
          lr: 5.0e-05
"""

from __future__ import annotations

import contextlib
from dataclasses import fields

import torch
from compressed_tensors.quantization import disable_quantization, enable_quantization
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from llmcompressor.core import State, active_session
from llmcompressor.modifiers import Modifier
from pydantic import PrivateAttr

from fp4sense.numerics.schemes import get_scheme, menu_name_of
from fp4sense.quantization.distill import (
    DistillError,
    DistillSettings,
    Frozen,
    base_pass,
    distill,
    trained_linears,
)
from fp4sense.structure.units import find_units, model_fingerprint
from fp4sense_llmcompressor.modifier import _calibration_windows

__all__ = ["QuantizationAwareDistillationModifier", "frozen_quantizers"]

_DEFAULT = {f.name: f.default for f in fields(DistillSettings)}


class QuantizationAwareDistillationModifier(Modifier):
    """Train the model under the schemes the stage's quantization modifiers attached.

    :param steps: optimizer steps (one calibration window each)
    :param lr: AdamW learning rate (cosine schedule to zero)
    :param lr_4bit: factor on ``lr`` for the linears with 4-bit weights (NVFP4, MXFP4,
        INT4), whose grid steps are several times FP8's
    :param seed: which calibration windows, and their order
    :param windows: calibration samples trained on (their base log-probs stay in memory)
    :param holdout: further calibration samples, not trained on, that choose the state
        the training ends on (the lowest KL on them, the starting state included)
    :param mode: ``end-to-end`` (the whole model's KL) or ``block`` (each decoder block in
        turn matches its unquantized output; ``steps`` per block)
    :param backward: the recipe of the trained linears' backward GEMMs (dgrad, wgrad):
        ``bf16`` (only the forward quantized), or ``nvfp4`` / ``mxfp4`` / ``mxfp8`` as FP4
        training quantizes their operands on Blackwell
    :param state_dir: where an interrupted run saves and resumes (optional)
    :param device: where training runs (default: the first CUDA device when there is one,
        else where the model is); the model goes back afterwards
    """

    # the settings' defaults are DistillSettings' own (one definition for every front door)
    steps: int
    lr: float = _DEFAULT["lr"]
    lr_4bit: float = _DEFAULT["lr_4bit"]
    seed: int = _DEFAULT["seed"]
    windows: int = _DEFAULT["windows"]
    holdout: int = _DEFAULT["holdout"]
    check_every: int = _DEFAULT["check_every"]
    rise: float = _DEFAULT["rise"]
    rescale_every: int = _DEFAULT["rescale_every"]
    save_every: int = _DEFAULT["save_every"]
    mode: str = _DEFAULT["mode"]
    backward: str = _DEFAULT["backward"]
    state_dir: str | None = None
    device: str | None = None
    # It trains on the calibration data, which it reads itself (``state.data.calib``),
    # and observes nothing during a calibration pass. llm-compressor's default pipeline
    # ("independent") gives every modifier that requires calibration data a sequential
    # pass of its own: for this one a whole forward pass through every layer that changes
    # nothing. Declared data-free, it gets the data-free pipeline (no forward pass).
    requires_calibration_data: bool = False

    _record: dict | None = PrivateAttr(None)
    _later: dict | None = PrivateAttr(None)  # what the training after GPTQ needs

    @property
    def record(self) -> dict | None:
        """What the training did (losses, curves, rollbacks), once it ran."""
        return self._record

    def on_initialize(self, state: State, **kwargs) -> bool:
        model = state.model
        settings = DistillSettings(
            steps=self.steps, lr=self.lr, lr_4bit=self.lr_4bit, seed=self.seed,
            windows=self.windows, holdout=self.holdout, check_every=self.check_every,
            rise=self.rise, rescale_every=self.rescale_every, save_every=self.save_every,
            mode=self.mode, backward=self.backward)
        settings.check()
        windows = _training_windows(state, self.windows + self.holdout, self.seed)
        units = find_units(model, windows[:1, :16])
        schemes = _attached_schemes(model, units)
        after_gptq = _after_gptq(self)
        if not after_gptq:  # the rotations enter the model when calibration starts
            transform = _transforming()
            if transform:
                raise DistillError(
                    "QuantizationAwareDistillationModifier: the stage transforms linears "
                    f"({transform}) when calibration starts, which fp4sense's training "
                    "cannot compute before; put a GPTQModifier before it (QAD then trains "
                    "after GPTQ, the transforms in the model), or use a plan's rotated "
                    "schemes (NVFP4_H16, MXFP4_H32, ...) instead")
            schemes.update(_planned_rotations())
        key = f"{model_fingerprint(model)}:{sorted(schemes.items())}:{after_gptq}"
        args = (model, units, schemes, windows, settings)
        with self._on_device(model):
            if after_gptq:  # the base model's outputs now, the training at finalize
                self._later = {"args": args, "key": key,
                               "base": base_pass(*args)}
            else:
                self._record = distill(*args, state_dir=self.state_dir, key=key)
        return True

    def on_finalize(self, state: State, **kwargs) -> bool:
        if self._later is None:
            return True
        later, self._later = self._later, None
        model, units, schemes, windows, settings = later["args"]
        frozen = frozen_quantizers(model, trained_linears(units, schemes))
        model.apply(disable_quantization)  # the training quantizes, with the same scales
        try:
            with self._on_device(model):
                self._record = distill(model, units, schemes, windows, settings,
                                       state_dir=self.state_dir, key=later["key"],
                                       base=later["base"], frozen=frozen)
        finally:
            model.apply(enable_quantization)
        return True

    @contextlib.contextmanager
    def _on_device(self, model: torch.nn.Module):
        """Run on ``device`` (default: the first GPU when there is one), then go home."""
        home = next(model.parameters()).device
        model.to(torch.device(self.device or ("cuda" if torch.cuda.is_available() else home)))
        try:
            yield
        finally:
            model.to(home)


def _after_gptq(modifier: Modifier) -> bool:
    """Whether a GPTQModifier comes before ``modifier`` in the recipe being applied."""
    mods = list(active_session().lifecycle.recipe.modifiers)
    before = mods[:next((i for i, m in enumerate(mods) if m is modifier), len(mods))]
    return any(type(m).__name__ == "GPTQModifier" for m in before)


def _modifiers():
    return active_session().lifecycle.recipe.modifiers


def _transforming() -> str | None:
    """The modifier of the recipe being applied that transforms linears when calibration
    starts with transforms fp4sense does not compute (llm-compressor's QuIP / SpinQuant
    modifiers), if any."""
    return next((type(m).__name__ for m in _modifiers()
                 if type(m).__name__ in ("QuIPModifier", "SpinQuantModifier")), None)


def _planned_rotations() -> dict[str, str]:
    """unit -> rotated scheme, for the units the stage's SensitivityGuidedModifier plans
    rotated (the schemes it attaches are the unrotated ones; it rotates at calibration)."""
    out: dict[str, str] = {}
    for m in _modifiers():
        plan = (getattr(m, "applied_plan", None)
                if type(m).__name__ == "SensitivityGuidedModifier" else None)
        if plan is not None:
            out.update({c.unit: c.scheme for c in plan.choices
                        if get_scheme(c.scheme).rotation})
    return out


def frozen_quantizers(model: torch.nn.Module, names) -> Frozen:
    """The linears ``names``' weight and input quantizers under the scales calibrated on
    them (compressed-tensors' ``forward_quantize``), for training after GPTQ."""
    modules = dict(model.named_modules())
    return Frozen(
        weights={m: _fixed(modules[m], "weight", "weights") for m in names},
        inputs={m: _fixed(modules[m], "input", "input_activations") for m in names
                if modules[m].quantization_scheme.input_activations is not None})


def _fixed(module: torch.nn.Module, base: str, field: str):
    """compressed-tensors' fake quantization of ``module``'s weight or input under the
    scales calibrated on it (the checkpoint's, for the weight)."""
    args = getattr(module.quantization_scheme, field)
    return lambda x: forward_quantize(module, x, base, args)


def _training_windows(state: State, n: int, seed: int) -> torch.Tensor:
    """``n`` calibration samples chosen by ``seed`` from all of them in a canonical order
    (llm-compressor's sampler shuffles without a seed: a recipe run again trains on the
    same windows only if the choice does not depend on its order)."""
    rows = _calibration_windows(state, 1 << 62, "QuantizationAwareDistillationModifier "
                                "trains on the calibration data")
    rows = rows[sorted(range(len(rows)), key=lambda i: rows[i].tolist())]
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:n]
    return rows[pick]


def _attached_schemes(model: torch.nn.Module, units) -> dict[str, str]:
    """unit -> menu scheme, from the schemes the quantization modifiers attached (a unit
    no modifier targets stays BF16, untouched)."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for unit in units.units:
        names = set()
        for m in unit.modules:
            attached = getattr(modules[m], "quantization_scheme", None)
            if attached is None:
                names.add("BF16")
                continue
            name = menu_name_of(attached)
            if name is None:
                raise DistillError(
                    f"QuantizationAwareDistillationModifier: {m} is quantized with a scheme "
                    f"fp4sense cannot train ({attached.weights}); use a scheme of fp4sense's "
                    "menu (`fp4sense schemes`) or drop the distillation")
            names.add(name)
        if len(names) > 1:
            raise DistillError(f"QuantizationAwareDistillationModifier: the linears of "
                               f"{unit.name} carry different schemes ({sorted(names)}); they "
                               "are one unit (fused in vLLM): give them one scheme")
        out[unit.name] = names.pop()
    if all(s == "BF16" for s in out.values()):
        raise DistillError("QuantizationAwareDistillationModifier: no quantization scheme is "
                           "attached; put it after the stage's quantization modifiers")
    return out
