"""The estimated mode: one forward + backward per window scores every linear under every
scheme (a Fisher-weighted output error), in memory or streamed one block at a time.

Score of linear ``m`` under scheme ``s`` on a window: ``0.5 * sum(g^2 * dy^2) / tokens``,
with ``dy`` the change of the linear's output when its weight (and input, for W4A4) is
fake-quantized and ``g`` the gradient of the log-probability of a token sampled from the
model's own next-token distribution (a one-sample Fisher estimate; the sample of window
``i`` comes from a generator seeded with ``(seed, i)``, so a window's score does not
depend on which rank or in which order it is computed).

``in_memory`` runs one backward through the whole model per window. ``streamed`` keeps
only each block's input (on the CPU), then sweeps from the last block to the first:
load one block, recompute its forward from the saved input, backpropagate the gradient
that arrived from above, score its linears, pass the gradient on. Same numbers (float32:
equal to rounding, tested), one block's weights at a time — models larger than memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
from tqdm.auto import tqdm

from fp4sense.diagnosis.blockio import (
    hidden,
    hidden_input,
    moved,
    no_cache,
    with_hidden,
    with_hidden_input,
)
from fp4sense.numerics.fakequant import activation_quantizer, input_absmax

__all__ = ["estimate", "streamed_input_bytes", "window_generator"]

Scores = dict[tuple[str, str], list[float]]


def window_generator(seed: int, window: int, device: torch.device) -> torch.Generator:
    """The sampling generator of one window (independent of rank and order)."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + window)


def streamed_input_bytes(model, n_windows: int, window_tokens: int, n_blocks: int) -> int:
    """What the streamed estimate keeps on the CPU: every block's input for every window
    (hidden states in the model's dtype), plus one gradient per window in float32."""
    width = model.get_input_embeddings().embedding_dim
    itemsize = next(model.parameters()).element_size()
    return n_windows * window_tokens * width * (n_blocks * itemsize + 4)


class _Scorer:
    """Hooks on the linears: record each one's input and output on the forward, and on
    the backward score every feasible scheme for it from the gradient of its output."""

    def __init__(self, run, schemes: Sequence[str], context: bool):
        self.run = run
        self.schemes = schemes
        self.context = context
        self.unit_of = {m: u for u in run.units.units for m in u.modules}
        self.feasible = {(m, s) for m in run.units.linears() for s in schemes
                         if self.unit_of[m].why_infeasible(s) is None}
        self.acts = {(m, s): activation_quantizer(s, input_absmax(run.stats[m], s))
                     for m, s in self.feasible}
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.window: dict[tuple[str, str], float] = {}
        self.tokens = 1

    def _weight(self, name: str, scheme: str) -> torch.Tensor:
        unit = self.unit_of[name]
        return self.run._quantized_one(unit, scheme, unit.modules.index(name))

    def install(self, names: Sequence[str]) -> list:
        return [self.run.modules[m].register_forward_hook(self._forward(m)) for m in names]

    def _forward(self, name):
        def hook(module, args, output):
            self.inputs[name] = args[0].detach()
            self.outputs[name] = output.detach()
            if output.requires_grad:
                output.register_hook(self._backward(name, module))
        return hook

    def _backward(self, name, module):
        @torch.no_grad()
        def hook(grad):
            g2 = grad.float().pow(2)
            x, y = self.inputs.pop(name), self.outputs.pop(name)
            if self.context:  # the change is measured from the unquantized linear
                y = torch.nn.functional.linear(x, self.run.original[name], module.bias)
            for s in self.schemes:
                if (name, s) not in self.feasible:
                    continue
                act = self.acts[(name, s)]
                xq = act(x) if act is not None else x
                dy = torch.nn.functional.linear(xq, self._weight(name, s), module.bias) - y
                self.window[(name, s)] = float(0.5 * (g2 * dy.float().pow(2)).sum()
                                               / self.tokens)
        return hook

    def take(self, scores: Scores, j: int, names: Sequence[str] | None = None) -> None:
        """Move the window's scores (of ``names``, default all) into column ``j``."""
        for (m, s) in self.feasible:
            if names is None or m in names:
                scores[(m, s)][j] = self.window.get((m, s), 0.0)
        self.window.clear()
        self.inputs.clear()
        self.outputs.clear()


def _sampled_loss(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Sum of the log-probabilities of tokens sampled from the model's own predictions."""
    log_probs = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    sampled = torch.multinomial(log_probs.detach().exp(), 1, generator=gen)
    return log_probs.gather(-1, sampled).sum()


def estimate(run, schemes: Sequence[str], windows: Sequence[int], seed: int = 0,
             context=None, streamed: bool = False) -> Scores:
    """(linear, scheme) -> estimated KL contribution per window of ``windows`` (indices
    into the analysis windows, in that order)."""
    if run.stats is None:
        run.base_pass()  # input maxima for NVFP4 activations
    scorer = _Scorer(run, schemes, context is not None)
    scores: Scores = {k: [0.0] * len(windows) for k in scorer.feasible}
    was = [p.requires_grad for p in run.model.parameters()]
    run.model.requires_grad_(False)
    with ExitStack() as stack:
        if context:
            stack.enter_context(run.applied(context))
        try:
            (_streamed if streamed else _in_memory)(run, scorer, scores, windows, seed)
        finally:
            for p, flag in zip(run.model.parameters(), was, strict=True):
                p.requires_grad_(flag)
    run.block_forwards += (3 if streamed else 2) * len(windows) * run.units.n_blocks
    return scores


def _in_memory(run, scorer: _Scorer, scores: Scores, windows: Sequence[int], seed: int) -> None:
    embed = run.model.get_input_embeddings()
    handles = [embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True))]
    handles += scorer.install(run.units.linears())
    try:
        for j, i in enumerate(tqdm(windows, desc="estimating (forward + backward)",
                                   leave=False, disable=not run.progress)):
            with torch.enable_grad():
                logits = run.model(input_ids=run.windows[i][None], **no_cache(run.model)).logits
                scorer.tokens = logits.shape[1] - 1
                _sampled_loss(logits, window_generator(seed, i, run.device)).backward()
            if run.store is not None:
                run.store.release_all()
            scorer.take(scores, j)
    finally:
        for h in handles:
            h.remove()


def _streamed(run, scorer: _Scorer, scores: Scores, windows: Sequence[int], seed: int) -> None:
    blocks, n_blocks, device = run.blocks, run.units.n_blocks, run.device
    calls: list[list] = [[None] * len(windows) for _ in range(n_blocks)]  # (args, kwargs)
    last: list = [None] * len(windows)
    current = {"j": 0}
    memo: dict[int, object] = {}

    def keep_input(b):
        def hook(module, args, kwargs):
            calls[b][current["j"]] = moved((args, kwargs), torch.device("cpu"), memo)
        return hook

    def keep_output(module, args, output):
        last[current["j"]] = moved(output, torch.device("cpu"), {})

    # 1. forward without gradients: keep each block's input (and the last block's output)
    handles = [b.register_forward_pre_hook(keep_input(i), with_kwargs=True)
               for i, b in enumerate(blocks)]
    handles.append(blocks[n_blocks - 1].register_forward_hook(keep_output))
    try:
        with torch.no_grad():
            for j, i in enumerate(tqdm(windows, desc="estimating: forward", leave=False,
                                       disable=not run.progress)):
                current["j"] = j
                memo.clear()
                run.model(input_ids=run.windows[i][None], **no_cache(run.model))
    finally:
        for h in handles:
            h.remove()

    # 2. the head: gradient of the sampled log-likelihood at the last block's output
    grads: list = [None] * len(windows)
    for j, i in enumerate(windows):
        leaf = hidden(last[j]).to(device).requires_grad_(True)
        source = [[with_hidden(last[j], leaf)]] * n_blocks  # every block replays it
        with run.replayed(n_blocks, {"i": 0}, source), torch.enable_grad():
            logits = run.model(input_ids=run.windows[i][None], **no_cache(run.model)).logits
            _sampled_loss(logits, window_generator(seed, i, device)).backward()
        scorer.tokens = logits.shape[1] - 1
        grads[j] = leaf.grad.detach().to("cpu")
        last[j] = None

    # 3. backward sweep, last block first: recompute, backpropagate, score, pass it on
    names_of = _linears_by_block(run)
    handles = scorer.install(run.units.linears())
    try:
        for b in tqdm(range(n_blocks - 1, -1, -1), desc="estimating: backward sweep",
                      leave=False, disable=not run.progress):
            for j in range(len(windows)):
                memo.clear()
                args, kwargs = moved(calls[b][j], device, memo)
                x = hidden_input(args, kwargs).detach().requires_grad_(True)
                args, kwargs = with_hidden_input(args, kwargs, x)
                with torch.enable_grad():
                    out = blocks[b](*args, **kwargs)
                    hidden(out).backward(grads[j].to(device))
                grads[j] = x.grad.detach().to("cpu")
                scorer.take(scores, j, names_of[b])
                calls[b][j] = None
            if run.store is not None:
                run.store.release_all()
    finally:
        for h in handles:
            h.remove()


def _linears_by_block(run) -> list[set[str]]:
    out: list[set[str]] = [set() for _ in range(run.units.n_blocks)]
    for unit in run.units.units:
        out[unit.block].update(unit.modules)
    return out
