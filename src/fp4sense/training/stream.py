"""One training step's forward and backward one decoder block at a time: how the estimate
and the gradient stakes run on a model loaded with ``low_memory`` (its blocks read from
the model's own files when they run, :class:`~fp4sense.structure.offload.BlockStore`).

1. a forward without gradients keeps each block's call (its hidden input, the masks and
   rotary embeddings) on the CPU, and the last block's output;
2. the head (final norm, LM head, the loss) runs with gradients on that output, every
   block replaying its kept result: the gradient at the last block's output;
3. the blocks run again from the last, each recomputed with gradients from its kept call
   and given the gradient of its output; the gradient of its input goes to the block
   before (``on_block(i)`` after block ``i``'s backward, before it is dropped);
4. the layers before the first block (the embeddings, Gemma's scaling) get theirs.

The parameters' gradients are those ``model(...).loss.backward()`` gives (tested bit for
bit on every family): the same operations on the same inputs. Memory: one block's weights
and activations, and the blocks' inputs (n·T·hidden each)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4sense.diagnosis.blockio import (
    hidden,
    hidden_input,
    moved,
    no_cache,
    uncached,
    with_hidden,
    with_hidden_input,
)
from fp4sense.validate import InputError

__all__ = ["stepped_blocks", "streamed_backward"]

_CPU = torch.device("cpu")


class _Reached(Exception):
    """The forward reached the first block (step 4 stops there)."""


def streamed_backward(model: torch.nn.Module, blocks_path: str, windows: torch.Tensor,
                      on_block: Callable[[int], None] | None = None) -> float:
    """The training loss of ``windows`` (n, T) token ids, as one batch, and its gradients
    on the model's parameters, computed one block at a time (see the module); returns
    the loss. ``model.fp4sense_blocks`` (a low-memory model's store), where there is one,
    drops each block's weights once ``on_block`` has seen them."""
    if getattr(model.config, "output_router_logits", False):
        raise InputError("the router's auxiliary loss (output_router_logits) needs every "
                         "block's router logits in one graph: it cannot be computed one "
                         "block at a time; run without --low-memory")
    blocks = model.get_submodule(blocks_path)
    store = getattr(model, "fp4sense_blocks", None)
    calls, last = _kept_calls(model, blocks, windows)
    leaf = hidden(last).to(windows.device).requires_grad_(True)
    with _replaying(blocks, with_hidden(moved(last, windows.device, {}), leaf)), \
            torch.enable_grad():
        loss = model(input_ids=windows, labels=windows, **no_cache(model)).loss
        loss.backward()
    grad = leaf.grad
    for b in range(len(blocks) - 1, -1, -1):
        args, kwargs = uncached(*moved(calls[b], windows.device, {}))
        x = hidden_input(args, kwargs).detach().requires_grad_(True)
        args, kwargs = with_hidden_input(args, kwargs, x)
        with torch.enable_grad():
            hidden(blocks[b](*args, **kwargs)).backward(grad)
        grad, calls[b] = x.grad, None
        if on_block is not None:
            on_block(b)
        if store is not None:
            store.release_all()
    _embedding_backward(model, blocks[0], windows, grad)
    return float(loss.detach())


def _kept_calls(model, blocks, windows) -> tuple[list, object]:
    """Step 1: each block's (args, kwargs) on the CPU, and the last block's output."""
    calls: list = [None] * len(blocks)
    kept = {}
    memo: dict = {}  # a tensor every block gets (rotary embeddings, masks) kept once

    def keep_input(i):
        def hook(module, args, kwargs):
            calls[i] = moved((args, kwargs), _CPU, memo)
            memo.pop(id(hidden_input(args, kwargs)), None)  # its own: not held on the device
        return hook

    def keep_output(module, args, output):
        kept["last"] = moved(output, _CPU, {})

    handles = [b.register_forward_pre_hook(keep_input(i), with_kwargs=True)
               for i, b in enumerate(blocks)]
    handles.append(blocks[len(blocks) - 1].register_forward_hook(keep_output))
    try:
        with torch.no_grad():
            model(input_ids=windows, **no_cache(model))
    finally:
        for h in handles:
            h.remove()
    return calls, kept["last"]


@contextmanager
def _replaying(blocks, output):
    """Every block returns ``output`` instead of computing (and, offloaded, is not read)."""
    patched = [(b, b.__dict__.get("forward")) for b in blocks]
    for b, _ in patched:
        b.forward = lambda *args, **kwargs: output
    try:
        yield
    finally:
        for b, own in patched:
            if own is None:
                del b.forward
            else:
                b.forward = own


def _embedding_backward(model, first_block, windows, grad) -> None:
    """Step 4: the gradient at the first block's input, through what computed it."""
    reached = {}

    def stop(module, args, kwargs):
        reached["x"] = hidden_input(args, kwargs)
        raise _Reached

    handle = first_block.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
    try:
        with torch.enable_grad():
            model(input_ids=windows, **no_cache(model))
    except _Reached:
        pass
    finally:
        handle.remove()
    if reached["x"].requires_grad:
        reached["x"].backward(grad)


@contextmanager
def stepped_blocks(model: torch.nn.Module, step: Callable[[torch.Tensor, torch.Tensor],
                   torch.Tensor]) -> Iterator[Callable[[int], None]]:
    """For a low-memory model's optimizer step: an ``on_block`` for
    :func:`streamed_backward` that writes block ``i``'s stepped parameters,
    ``step(param, grad)``, to a temporary folder (its gradients then cleared), and has the
    block store read them from there until the context ends: the forwards inside see the
    stepped model, one block in memory at a time. Disk: one copy of the blocks' weights."""
    store = model.fp4sense_blocks
    blocks = store.blocks
    before = dict(store.overrides)
    with tempfile.TemporaryDirectory(prefix="fp4sense-step-") as folder:
        def on_block(i: int) -> None:
            stepped = {}
            for name, param in blocks[i].named_parameters():
                if param.grad is not None:
                    with torch.no_grad():
                        stepped[f"{store.prefix}.{i}.{name}"] = step(
                            param, param.grad).to(_CPU).contiguous()
                    param.grad = None
            file = Path(folder) / f"block_{i}.safetensors"
            save_file(stepped, file)
            for full in stepped:
                store.overrides[full] = partial(_read, file, full, store.device)
        try:
            yield on_block
        finally:
            store.overrides.clear()
            store.overrides.update(before)


def _read(file: Path, key: str, device: torch.device) -> torch.Tensor:
    with safe_open(str(file), "pt", device=str(device)) as fh:
        return fh.get_tensor(key)
