"""Block-wise QAD: each decoder block in turn trained to reproduce the unquantized
block's output, as llm-compressor's sequential pipeline walks blocks.

The base pass (:func:`record_blocks`) keeps, per window, the first block's input and
every block's call (masks, rotary embeddings) and output (bf16, on the CPU). Training
then walks the blocks in order (:func:`train_blocks`): block ``b`` gets the output of
the blocks before it *as quantized and trained*, so it learns to correct the error that
reaches it, and its loss is the squared error of its output against the base block's
output on the base model's input, relative to that output's mean square. Each block
trains ``steps`` steps with the end-to-end loop's stability checks, held-out windows and
saved state (:func:`fp4sense.quantization.qad_loop.train`, one state folder per block,
so an interrupted run resumes in the block it stopped in). A step costs one block's
forward and backward, not the whole model's and its vocabulary head, so a block can take
many steps for the cost of a few end-to-end ones; its memory is every block's output for
every window (:func:`targets_bytes`).

The run is judged as a whole at the end: the model's KL to the base next-token
distributions on the held-out windows (the first training windows when none are held
out), before and after; a run that raised it keeps the weights it started from, and
says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fp4sense.diagnosis.blockio import hidden, hidden_input, moved, uncached, with_hidden_input
from fp4sense.quantization.qad_loop import _held_loss, _kl, _mean_loss, train

__all__ = ["BlockTargets", "record_blocks", "targets_bytes", "train_blocks"]


@dataclass
class BlockTargets:
    """Per window: the first block's input, and per block its call (its hidden input
    left out) and its base output (bf16, on the CPU)."""

    first_in: list[torch.Tensor] = field(default_factory=list)
    calls: list[list] = field(default_factory=list)  # [block][window] -> (args, kwargs)
    out: list[list[torch.Tensor]] = field(default_factory=list)  # [block][window]


def targets_bytes(model: torch.nn.Module, n_blocks: int, n_windows: int,
                  window_tokens: int) -> int:
    """What :class:`BlockTargets` holds: every block's output for every window, in bf16."""
    width = model.get_input_embeddings().embedding_dim
    return n_blocks * n_windows * window_tokens * width * 2


@contextlib.contextmanager
def record_blocks(blocks: torch.nn.ModuleList, n_windows: int, current: dict):
    """While the base model runs window ``current["i"]``, keep what block-wise training
    replays (yields the :class:`BlockTargets` being filled)."""
    got = BlockTargets(first_in=[None] * n_windows,
                       calls=[[None] * n_windows for _ in blocks],
                       out=[[None] * n_windows for _ in blocks])
    memo: dict = {}  # one window's tensors shared by the blocks' calls (masks, rotary)

    def call_hook(index):
        def hook(module, args, kwargs):
            i = current["i"]
            if index == 0:
                memo.clear()
                got.first_in[i] = hidden_input(args, kwargs).detach().clone()
            device = hidden_input(args, kwargs).device
            args, kwargs = with_hidden_input(args, kwargs, None)
            got.calls[index][i] = moved(uncached(args, kwargs), device, memo)
        return hook

    def out_hook(index):
        def hook(module, args, output):
            got.out[index][current["i"]] = hidden(output).detach().to("cpu", torch.bfloat16)
        return hook

    handles = [b.register_forward_pre_hook(call_hook(i), with_kwargs=True)
               for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(out_hook(i)) for i, b in enumerate(blocks)]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _block_loss(block: torch.nn.Module, item, target: torch.Tensor) -> torch.Tensor:
    """Squared error of the block's output against the base output, relative to the
    base output's mean square."""
    x, call = item
    out = _run(block, call, x).float()
    base = target.to(out.device).float()
    return (out - base).square().mean() / base.square().mean().clamp_min(1e-12)


def train_blocks(model, units, trained, targets: BlockTargets, data, teacher,
                 params_of: dict, lr_scale_of: dict, quantizer_of, whole_quantizer, settings,
                 state_dir: Path | None, key: str, progress: bool, log) -> dict:
    """Train block by block (see the module's docstring).

    :param trained: (unit, scheme) of every trained unit
    :param params_of: linear name -> its straight-through master weight
    :param lr_scale_of: linear name -> its learning-rate factor
    :param quantizer_of: the units of one block -> a quantizer refreshing their weights
    :param whole_quantizer: refreshes every trained linear (the whole model's checks)
    :param data: (n, T) window ids, the last ``settings.holdout`` held out; ``teacher``
        their base log-probs
    """
    blocks = model.get_submodule(units.blocks_path)
    n = len(data) - settings.holdout
    judged = ((data[n:], teacher[n:]) if settings.holdout else (data[:4], teacher[:4]))
    names = list(params_of)
    start = [params_of[m].detach().clone() for m in names]

    def model_kl(search: bool) -> float:
        whole_quantizer.refresh(search=search)
        return _held_loss(lambda w, t: _kl(model, w, t), judged, _Kept())

    kl_before = _mean_loss(lambda w, t: _kl(model, w, t), data[:n], teacher[:n],
                           whole_quantizer)
    judged_before = model_kl(search=False)
    x = [t.clone() for t in targets.first_in]  # the quantized model's input to each block
    per_block, rollbacks, hist = [], [], {"step": [], "loss": [], "grad_norm": [], "lr": [],
                                          "block": []}
    by_block: dict[int, list] = {}
    for unit, scheme in trained:
        by_block.setdefault(unit.block, []).append((unit, scheme))
    bar = tqdm(total=units.n_blocks, desc="distill (block-wise)", disable=not progress)
    for b, block in enumerate(blocks):
        mine = by_block.get(b, [])
        items = [(x[i], targets.calls[b][i]) for i in range(len(data))]
        quantizer = quantizer_of(mine)
        if mine:
            linears = [m for u, _ in mine for m in u.modules]
            record = train(
                block, items[:n], targets.out[b][:n], [params_of[m] for m in linears],
                quantizer, settings,
                state_dir / f"block-{b:03d}" if state_dir is not None else None,
                f"{key}:block {b}", False, log,
                (items[n:], targets.out[b][n:]) if settings.holdout else None,
                [lr_scale_of[m] for m in linears],
                loss=lambda item, target, block=block: _block_loss(block, item, target),
                label="relative output error", desc=f"distill, block {b}")
            offset = b * settings.steps
            for k in ("step", "loss", "grad_norm", "lr"):
                hist[k] += [v + offset if k == "step" else v for v in record["history"][k]]
            hist["block"] += [b] * len(record["history"]["step"])
            rollbacks += [{**r, "block": b, "step": r["step"] + offset,
                           "to_step": r["to_step"] + offset} for r in record["rollbacks"]]
            per_block.append({"block": b, "loss_before": record["loss_before"],
                              "loss_after": record["loss_after"],
                              "holdout": record.get("holdout")})
            bar.set_postfix(error=f"{record['loss_after']:.4f}")
        with torch.no_grad():  # what the next block receives: this block, quantized
            quantizer.refresh(search=False)
            x = [_run(block, targets.calls[b][i], x[i]) for i in range(len(data))]
        bar.update(1)
    bar.close()
    judged_after = model_kl(search=True)
    kept = judged_after <= judged_before
    if not kept:  # the model as a whole got worse where it was judged: back to the start
        for m, v in zip(names, start, strict=True):
            params_of[m].data.copy_(v)
        log(f"distill (block-wise): the KL on the {len(judged[0])} "
            f"{'held-out' if settings.holdout else 'first training'} windows rose "
            f"({judged_before:.4f} -> {judged_after:.4f}): kept the weights it started from")
        judged_after = model_kl(search=True)
    kl_after = _mean_loss(lambda w, t: _kl(model, w, t), data[:n], teacher[:n],
                          whole_quantizer)
    log(f"distill (block-wise): {units.n_blocks} blocks x {settings.steps} steps, KL on the "
        f"first training windows {kl_before:.4f} -> {kl_after:.4f}")
    extra = {}
    if settings.holdout:
        extra["holdout"] = {"windows": settings.holdout, "before": judged_before,
                            "after": judged_after, "step": settings.steps if kept else 0}
    return {"steps": settings.steps, "loss_before": kl_before, "loss_after": kl_after,
            "rollbacks": rollbacks, "history": hist, "blocks": per_block,
            "kept_training": kept, **extra}


def _run(block: torch.nn.Module, call: tuple, x: torch.Tensor) -> torch.Tensor:
    """The block's hidden-state output for input ``x`` in the recorded ``call``."""
    args, kwargs = with_hidden_input(*call, x)
    return hidden(block(*args, **kwargs))


class _Kept:
    """A quantizer whose refresh does nothing (the caller refreshed already)."""

    def refresh(self, search: bool) -> None:
        pass
