"""fp4sense's observers for llm-compressor: ``fp4sense_scale_search`` (weights) and
``fp4sense_input_clip`` (NVFP4 inputs).

``fp4sense_scale_search``:

It computes the NVFP4 global scale exactly as llm-compressor's min-max observer does
(shared across fused q/k/v and gate/up), then chooses each block scale with
:func:`fp4sense.numerics.scale_search.search_block_scales`, weighting the error by the layer's
calibration inputs (E[x^2] per input channel, gathered by a forward pre-hook) when a
calibration dataset is given, and by plain weight MSE otherwise.
"""

from __future__ import annotations

import math

import torch
from compressed_tensors.quantization import QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams
from llmcompressor.modifiers.utils.hooks import HooksMixin
from llmcompressor.observers.base import Observer, QParamsDict
from llmcompressor.observers.min_max import MemorylessMinMaxObserver, StaticMinMaxObserver

from fp4sense.numerics.formats import decode_scales
from fp4sense.numerics.input_clip import check_fraction, input_global_scale
from fp4sense.numerics.scale_search import search_block_scales
from fp4sense.numerics.schemes import INPUT_CLIP_OBSERVER, SCALE_SEARCH_OBSERVER

__all__ = ["InputClipObserver", "ScaleSearchObserver"]


@Observer.register(SCALE_SEARCH_OBSERVER)
class ScaleSearchObserver(MemorylessMinMaxObserver):
    """Min-max statistics for the global scale; searched FP4 block scales.

    observer_kwargs:
      ``steps``: [low, high] candidate offsets in scale steps (default: fp4sense's).
      ``use_activations``: weight the error by E[x^2] of the inputs (default True).
    """

    _stats_attrs = ["min_vals", "max_vals", "observed"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kw = self.args.observer_kwargs
        steps = kw.get("steps")
        self.steps = tuple(steps) if steps is not None else None
        self.use_activations = bool(kw.get("use_activations", True))
        self._sq_sum: torch.Tensor | None = None
        self._count = 0
        self._hook = None
        if self.args.num_bits != 4 or self.args.group_size not in (16, 32):
            raise ValueError(
                f"{SCALE_SEARCH_OBSERVER} is for NVFP4 / MXFP4 weights (4-bit float, "
                f"group 16 or 32), got num_bits={self.args.num_bits}, "
                f"group_size={self.args.group_size}"
            )

    @property
    def fmt(self) -> str:
        return "nvfp4" if self.args.strategy == QuantizationStrategy.TENSOR_GROUP else "mxfp4"

    def attach(self, module: torch.nn.Module) -> None:
        """Gather E[x^2] per input channel of ``module`` during calibration."""
        if not (self.is_weight_obs and self.use_activations and hasattr(module, "in_features")):
            return
        self.detach(module)

        def hook(mod, args):
            if HooksMixin._HOOKS_DISABLED and self._hook not in HooksMixin._HOOKS_KEEP_ENABLED:
                return
            x = args[0] if isinstance(args, tuple) else args
            if not isinstance(x, torch.Tensor):
                return
            x = x.detach().to(torch.float32)
            sq = x.square().sum(dim=tuple(range(x.dim() - 1)))
            self._sq_sum = sq if self._sq_sum is None else self._sq_sum + sq.to(self._sq_sum)
            self._count += math.prod(x.shape[:-1])

        self._hook = module.register_forward_pre_hook(hook)

    def detach(self, module: torch.nn.Module) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        super().update_statistics_from_observed(observed)
        self.observed = observed

    def _importance(self) -> torch.Tensor | None:
        if self._sq_sum is None or self._count == 0:
            return None
        imp = self._sq_sum / self._count
        if not bool(torch.isfinite(imp).all()) or bool((imp <= 0).all()):
            return None
        return imp

    @torch.no_grad()
    def get_qparams(self) -> QParamsDict:
        if not self.is_weight_obs:
            return super().get_qparams()
        global_scale = self.get_global_scale()
        # zero point (and its dtype) exactly as upstream; only the scale differs
        _, zero_point = calculate_qparams(
            self.min_vals, self.max_vals, self.args, global_scale=global_scale
        )
        weight = self.observed[0].flatten(-2)  # (1, rows, groups, size) -> (rows, in)
        stored = search_block_scales(
            weight, self.fmt, global_scale, self._importance(), self.steps
        )
        if self.fmt == "nvfp4":
            scale = stored.to(torch.float32)  # upstream's form: E4M3 values as float
        else:
            scale = decode_scales(stored, "mxfp4").to(weight.dtype)
        self.delete_statistics()
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}


@Observer.register(INPUT_CLIP_OBSERVER)
class InputClipObserver(StaticMinMaxObserver):
    """llm-compressor's ``static_minmax`` for an NVFP4 input, its tensor scale made from
    ``fraction`` of the calibration maximum (shared by a fused group, as upstream's):
    what an ``*_ACLIP`` scheme's plan chose for the unit
    (:mod:`fp4sense.numerics.input_clip`).

    observer_kwargs: ``fraction`` in (0, 1] (default 1: upstream's scale).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fraction = check_fraction(self.args.observer_kwargs.get("fraction", 1.0),
                                       f"{INPUT_CLIP_OBSERVER} observer_kwargs.fraction")
        if self.args.strategy != QuantizationStrategy.TENSOR_GROUP or self.is_weight_obs:
            raise ValueError(f"{INPUT_CLIP_OBSERVER} observes NVFP4 inputs (tensor_group "
                             f"input_activations), got {self.base_name} with strategy "
                             f"{self.args.strategy}; use it under input_activations only")

    def get_global_scale(self) -> torch.Tensor | None:
        stats = self.fusion_handler.get_fused_statistics()
        absmax = torch.stack([torch.max(s["max_vals"].max(), -s["min_vals"].min())
                              for s in stats]).max()
        return input_global_scale(absmax, self.fraction).to(absmax.device)
