"""Damage metrics (protocol.md): KL(base || quant), perplexity, top-1 agreement.

All are over next-token predictions of the evaluation windows: for a window of T tokens
the first T-1 positions predict the following token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

__all__ = [
    "Comparison",
    "compare_models",
    "implausible",
    "logits_of",
    "next_token_logprobs",
    "perplexity",
    "window_metrics",
]


@dataclass(frozen=True)
class Comparison:
    """Quantized model vs its base on the same windows (means over predicted tokens)."""

    kl: float
    kl_se: float  # standard error of the mean KL over windows
    ppl: float
    base_ppl: float
    top1: float
    tokens: int
    #: mean per-token NLL of the quantized model minus the base's, and its standard error
    #: over windows (a quantized model does not beat its base by more than noise)
    nll_diff: float = float("nan")
    nll_diff_se: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def logits_of(model, window: torch.Tensor) -> torch.Tensor:
    """float32 logits (T, vocab) of a (T,) token window."""
    out = model(input_ids=window.unsqueeze(0).to(model.device))
    return out.logits[0].to(torch.float32)


def next_token_logprobs(logits: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens < t) for t = 1..T-1, from a window's (T, vocab) logits."""
    log_probs = torch.log_softmax(logits[:-1].to(torch.float32), dim=-1)
    return log_probs.gather(-1, window[1:, None].to(log_probs.device))[:, 0]


def window_metrics(
    base_logits: torch.Tensor, quant_logits: torch.Tensor, window: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-token KL, NLLs and agreement for one window (positions 0..T-2)."""
    base_lp = torch.log_softmax(base_logits[:-1], dim=-1)
    quant_lp = torch.log_softmax(quant_logits[:-1], dim=-1)
    kl = (base_lp.exp() * (base_lp - quant_lp)).sum(-1)
    return {
        "kl": kl,
        "nll": -next_token_logprobs(quant_logits, window),
        "base_nll": -next_token_logprobs(base_logits, window),
        "agree": (base_lp.argmax(-1) == quant_lp.argmax(-1)).to(torch.float32),
    }


def perplexity(nll: torch.Tensor) -> float:
    return float(math.exp(nll.double().mean().item()))


@torch.no_grad()
def compare_models(
    base, quant, windows: torch.Tensor, desc: str = "evaluating"
) -> Comparison:
    """KL, PPL and top-1 agreement of ``quant`` against ``base`` over ``windows`` (n, T).

    ``base`` is the unquantized model, or its logits per window (from :func:`logits_of`)
    when several models are compared against the same base.
    """
    per_window_kl, per_window_diff = [], []
    parts: dict[str, list[torch.Tensor]] = {"kl": [], "nll": [], "base_nll": [], "agree": []}
    for i, window in enumerate(tqdm(windows, desc=desc, leave=False)):
        base_logits = base[i] if isinstance(base, (list, tuple)) else logits_of(base, window)
        m = window_metrics(base_logits, logits_of(quant, window), window)
        for key, value in m.items():
            parts[key].append(value.cpu())
        per_window_kl.append(m["kl"].mean().item())
        per_window_diff.append((m["nll"] - m["base_nll"]).double().mean().item())
    cat = {k: torch.cat(v) for k, v in parts.items()}
    return Comparison(
        kl=float(cat["kl"].double().mean()),
        kl_se=_se(per_window_kl),
        ppl=perplexity(cat["nll"]),
        base_ppl=perplexity(cat["base_nll"]),
        top1=float(cat["agree"].mean()),
        tokens=int(cat["kl"].numel()),
        nll_diff=float((cat["nll"].double() - cat["base_nll"].double()).mean()),
        nll_diff_se=_se(per_window_diff),
    )


def _se(per_window: list[float]) -> float:
    """Standard error of the mean over windows (NaN for one window)."""
    values = torch.tensor(per_window, dtype=torch.float64)
    return float(values.std(unbiased=True) / math.sqrt(len(values))) if len(values) > 1 \
        else float("nan")


def implausible(base_ppl: float, vocab_size: int | None, nll_diff: float | None = None,
                nll_diff_se: float | None = None) -> str | None:
    """One warning line when the figures on these windows cannot be trusted as they
    stand: the base model's perplexity above its vocabulary size (worse than guessing
    uniformly), or a quantized model better than its base by more than noise (mean NLL
    lower by over two standard errors); None when they look plausible."""
    causes = ("likely causes: windows without the BOS token the model expects "
              "(--raw-windows), a chat model fed raw text, or a broken conversion")
    if vocab_size and math.isfinite(base_ppl) and base_ppl > vocab_size:
        return (f"warning: the base model's perplexity on these windows is {base_ppl:,.0f}, "
                f"above its vocabulary size ({vocab_size:,}): worse than guessing; {causes}")
    if nll_diff is not None and nll_diff_se is not None and math.isfinite(nll_diff_se) \
            and nll_diff < -2 * nll_diff_se:
        return (f"warning: the quantized model scores better than its base on these windows "
                f"(mean NLL {nll_diff:+.4f} ± {nll_diff_se:.4f} per token), which "
                f"quantization should not do; {causes}")
    return None
