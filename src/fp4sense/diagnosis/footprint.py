"""What the analysis keeps in memory beside the weights, said before a run starts: the
fake-quantized weights kept between perturbations, the base model's log-probs, the
measured mode's replayed block outputs and the streamed estimate's block inputs."""

from __future__ import annotations

import torch

from fp4sense.structure.units import UnitMap

__all__ = ["BASE_LOGPROB_BYTES", "WEIGHT_CACHE_BYTES", "check_cache_memory",
           "weight_cache_bytes"]

#: Memory for fake-quantized weights kept between perturbations (at most; a streamed
#: run keeps one block's worth per scheme: :func:`weight_cache_bytes`).
WEIGHT_CACHE_BYTES = 1024 * 2**20
#: Memory for the base model's log-probs; beyond it they are recomputed from the cached
#: last block output (only the head runs) when needed.
BASE_LOGPROB_BYTES = 1024 * 2**20


def weight_cache_bytes(units: UnitMap, n_schemes: int, block_scoped: bool) -> int:
    """Memory for fake-quantized weights (kept in bf16: 2 bytes a weight): every unit's for
    each of ``n_schemes``, at most WEIGHT_CACHE_BYTES (the in-memory estimate reuses them
    all at every window; the measured runs reuse a unit's across the views and the kind's
    single linears). ``block_scoped`` (a streamed run): one block's for each scheme, all
    a streamed run needs (the estimate's backward sweep and every measured run take the
    blocks one at a time, each for all windows), so that cache stays flat in depth; a
    unit is quantized again in each measured run that perturbs it."""
    per_block: dict[int, int] = {}
    for u in units.units:
        per_block[u.block] = per_block.get(u.block, 0) + u.numel
    weights = max(per_block.values(), default=0) if block_scoped else sum(per_block.values())
    return min(WEIGHT_CACHE_BYTES, 2 * max(n_schemes, 1) * weights)


def check_cache_memory(model, windows: torch.Tensor, units: UnitMap, modes, views,
                       streamed: bool, log, weights: int) -> None:
    """What the run's caches will keep, said before it starts and refused when it will
    not fit: the measured mode replays every block's output of every window (twice with
    the block view: the base model's and the quantized model's), the streamed estimate
    keeps every block's input. The fake-quantized weights kept (``weights`` bytes, from
    :func:`weight_cache_bytes`) come on top."""
    from fp4sense.diagnosis.estimate import streamed_input_bytes
    from fp4sense.runtime.memory import check_fits

    n, tokens = len(windows), windows.shape[1]
    embed = model.get_input_embeddings()  # the hidden size and vocabulary of any decoder
    hidden, vocab = embed.embedding_dim, embed.num_embeddings
    itemsize = next(model.parameters()).element_size()
    need, parts = 0, []
    if "measured" in modes:
        copies = 2 if "block" in views else 1
        # + the first block's inputs and the outputs a run carries from block to block
        replay = ((copies * units.n_blocks + 2) * n * tokens * hidden * itemsize
                  + min(n * tokens * vocab * 4, BASE_LOGPROB_BYTES))
        need += replay
        parts.append(f"measured replay {replay / 2**30:.2f} GiB")
    if "estimated" in modes and streamed:
        from fp4sense.runtime import distributed

        mine = len(distributed.shard(list(range(n))))
        kept = streamed_input_bytes(model, mine, tokens, units.n_blocks)
        need = max(need, kept)  # the measured caches are released before the estimate
        parts.append(f"streamed estimate {kept / 2**30:.2f} GiB")
    if parts:
        need += weights
        parts.append(f"quantized weights {weights / 2**30:.2f} GiB")
        check_fits(need, f"analysis caches ({', '.join(parts)}; {n} windows x "
                   f"{units.n_blocks} blocks)", "lower --analysis-windows or --tokens (or "
                   "share the estimate's windows across more ranks with torchrun)", log)
