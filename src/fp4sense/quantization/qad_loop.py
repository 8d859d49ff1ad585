"""QAD's training loop: AdamW on the straight-through weights, the stability checks
(roll back to the best state and halve the learning rate), and the saved state that lets
an interrupted run resume where it stopped (see :mod:`fp4sense.quantization.distill`)."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fp4sense.quantization.distill_settings import DistillError
from fp4sense.validate import set_aside

__all__ = ["STATE_FILE", "train"]

STATE_FILE = "distill-state.pt"


def _kl(model, window, teacher) -> torch.Tensor:
    student = torch.log_softmax(model(input_ids=window[None]).logits[0].float(), -1)
    base = teacher.to(student.device).float()
    return (base.exp() * (base - student)).sum(-1).mean()


@torch.no_grad()
def _mean_loss(loss, data, teacher, quantizer, n: int = 4) -> float:
    quantizer.refresh(search=True)
    pairs = list(zip(data[:n], teacher[:n], strict=False))
    return sum(float(loss(w, t)) for w, t in pairs) / len(pairs)


@torch.no_grad()
def _held_loss(loss, held, quantizer) -> float:
    """Mean loss on the held-out windows under the scales in use (no new search)."""
    quantizer.refresh(search=False)
    return sum(float(loss(w, t)) for w, t in zip(*held, strict=True)) / len(held[0])


def train(model, data, teacher, params, quantizer, st, state_dir: Path | None, key: str,
          progress: bool, log, held: tuple | None = None,
          lr_scales: list[float] | None = None, loss=None, label: str = "KL",
          desc: str = "distill") -> dict:
    """Train ``params``; with ``held`` (windows, their base log-probs) every checked state
    is judged on those windows too and the run ends on the lowest there (the starting
    state included), so it never ends worse on them than it began. ``lr_scales``
    (parallel to ``params``) multiply the learning rate per tensor. ``loss(item,
    target)`` (default: ``model``'s KL to the base log-probs of a window) is what
    trains, judged and said as ``label``; block-wise QAD trains a block's output error."""
    if loss is None:
        def loss(window, target):
            return _kl(model, window, target)
    gen = torch.Generator().manual_seed(st.seed)
    order = _Order(gen, len(data))  # drawn as the steps reach it: no up-front list
    lr = st.lr
    hist: dict = {"step": [], "loss": [], "grad_norm": [], "lr": []}
    rollbacks: list[dict] = []
    best: tuple[float, int, list[torch.Tensor]] | None = None
    step = 0
    saved = _load_state(state_dir, key, st, log) if state_dir else None
    loss_before = _mean_loss(loss, data, teacher, quantizer)
    chosen: tuple[float, int, list[torch.Tensor]] | None = None  # lowest held-out KL
    held_before = _held_loss(loss, held, quantizer) if held is not None else None
    if held is not None:
        chosen = (held_before, 0, [p.detach().clone() for p in params])
    if saved is not None:
        for p, v in zip(params, saved["params"], strict=True):
            p.data.copy_(v)
        step, lr, hist, rollbacks = saved["step"], saved["lr"], saved["hist"], saved["rollbacks"]
        best, quantizer.scales = saved["best"], saved["scales"]
        chosen = saved.get("chosen", chosen)
        log(f"{desc}: resumed at step {step} of {st.steps} from {state_dir / STATE_FILE}")
    groups = _groups(params, lr_scales)
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    if saved is not None:
        opt.load_state_dict(saved["opt"])
    bar = tqdm(total=st.steps, initial=step, desc=desc, disable=not progress, leave=False)
    window_losses: list[float] = []
    start: tuple[int, list[torch.Tensor]] | None = None  # the state a check window began at
    while step < st.steps:
        if not window_losses:  # a window's losses judge the state it began with
            start = (step, [p.detach().clone() for p in params])
        quantizer.refresh(search=step % st.rescale_every == 0)
        now = lr * 0.5 * (1 + math.cos(math.pi * step / st.steps))  # the base learning rate
        for group in opt.param_groups:
            group["lr"] = group["scale"] * now
        opt.zero_grad(set_to_none=True)
        i = order[step]
        value_t = loss(data[i], teacher[i])
        value_t.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        value = float(value_t.detach())
        if math.isfinite(value) and math.isfinite(norm):
            opt.step()
        step += 1
        for k, v in zip(hist, (step, value, norm, now), strict=True):
            hist[k].append(v)
        window_losses.append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", lr=f"{now:.1e}")
        diverged = not (math.isfinite(value) and math.isfinite(norm))
        if len(window_losses) == st.check_every or diverged or step == st.steps:
            mean = sum(window_losses) / len(window_losses)
            window_losses = []
            rolled = diverged or (best is not None and mean >= best[0]
                                  and mean > st.rise * best[0])
            if not diverged and (best is None or mean < best[0]):
                best = (mean, *start)
            if held is not None and not rolled:  # judge the state reached now
                h = _held_loss(loss, held, quantizer)
                if h < chosen[0]:
                    chosen = (h, step, [p.detach().clone() for p in params])
            if rolled:
                if best is None:
                    raise DistillError(f"the distillation loss was not finite at step {step} "
                                       f"(learning rate {lr:g}); lower --distill-lr")
                for p, v in zip(params, best[2], strict=True):
                    p.data.copy_(v)
                lr /= 2
                opt = torch.optim.AdamW(_groups(params, lr_scales), lr=lr, weight_decay=0.0)
                what = "was not finite" if diverged else f"rose to {mean:.4f}"
                rollbacks.append({"step": step, "to_step": best[1], "lr": lr,
                                  "why": what})
                log(f"{desc}: the loss {what} at step {step} (best {best[0]:.4f} at step "
                    f"{best[1]}): rolled back to step {best[1]}, learning rate now {lr:g}")
        if state_dir is not None and (step % st.save_every == 0 or step == st.steps):
            _save_state(state_dir, key, st, params, opt, step, lr, hist, rollbacks, best,
                        quantizer.scales, chosen)
    bar.close()
    loss_after, extra = _end_state(loss, data, teacher, quantizer, params, held, held_before,
                                   chosen, best, step, desc, label, log)
    log(f"{desc}: {st.steps} steps, {label} on the first training windows {loss_before:.4f} -> "
        f"{loss_after:.4f}" + (f", {len(rollbacks)} rollback(s)" if rollbacks else ""))
    return {"steps": st.steps, "loss_before": loss_before, "loss_after": loss_after,
            "rollbacks": rollbacks, "history": hist, **extra}


def _end_state(loss, data, teacher, quantizer, params, held, held_before, chosen, best,
               step: int, desc: str, label: str, log) -> tuple[float, dict]:
    """End on the state the held-out windows judge best (with ``held``), else on the
    better of the last and the best training state; (its loss on the training windows,
    the held-out record)."""
    extra: dict = {}
    if held is not None:  # end on the state the held-out windows judge best
        for p, v in zip(params, chosen[2], strict=True):
            p.data.copy_(v)
    loss_after = _mean_loss(loss, data, teacher, quantizer)
    if held is not None:
        extra["holdout"] = {"windows": len(held[0]), "before": held_before,
                            "after": _held_loss(loss, held, quantizer), "step": chosen[1]}
        log(f"{desc}: ended on the state of step {chosen[1]}, the lowest {label} on "
            f"{len(held[0])} held-out windows ({held_before:.4f} -> "
            f"{extra['holdout']['after']:.4f})")
    elif best is not None and best[1] != step:  # end on the better of the last and best
        last = [p.detach().clone() for p in params]
        for p, v in zip(params, best[2], strict=True):
            p.data.copy_(v)
        at_best = _mean_loss(loss, data, teacher, quantizer)
        if at_best < loss_after:
            loss_after = at_best
            log(f"{desc}: ended on the state of step {best[1]} (lower {label} than the last)")
        else:
            for p, v in zip(params, last, strict=True):
                p.data.copy_(v)
            quantizer.refresh(search=True)
    return loss_after, extra


class _Order:
    """Step -> training window: one random permutation of the windows per pass, drawn
    from ``gen`` as the steps reach it (the same order an up-front list gave, without
    building one for every step first: a huge step count starts at once)."""

    def __init__(self, gen: torch.Generator, n: int):
        self.gen, self.n, self.drawn = gen, n, []

    def __getitem__(self, step: int) -> int:
        while len(self.drawn) <= step:
            self.drawn += [int(i) for i in torch.randperm(self.n, generator=self.gen)]
        return self.drawn[step]


def _groups(params, lr_scales) -> list[dict]:
    """AdamW parameter groups, one per learning-rate factor (``scale``)."""
    scales = lr_scales or [1.0] * len(params)
    return [{"params": [p for p, s in zip(params, scales, strict=True) if s == scale],
             "scale": scale} for scale in sorted(set(scales))]


def _save_state(state_dir: Path, key, st, params, opt, step, lr, hist, rollbacks, best,
                scales, chosen):
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save({"key": key, "settings": asdict(st), "step": step, "lr": lr, "hist": hist,
                "rollbacks": rollbacks, "best": best, "scales": scales, "opt": opt.state_dict(),
                "chosen": chosen,
                "params": [p.detach() for p in params]}, tmp)
    tmp.replace(state_dir / STATE_FILE)  # a state is whole or absent


def _load_state(state_dir: Path, key: str, st, log=print) -> dict | None:
    """The saved state of this very training, or None. Read with ``weights_only=True``
    (tensors and plain containers: never code from a file someone else could have put
    there); a file that fails to read is named, set aside and the run starts clean."""
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
        if not isinstance(saved, dict):
            raise ValueError(f"holds a {type(saved).__name__}, not a state")
    except Exception as exc:  # noqa: BLE001 - whatever the file holds, it is not used
        set_aside(path, exc, "the saved training state", "training starts from the "
                  "beginning", log)
        return None
    return saved if saved.get("key") == key and saved.get("settings") == asdict(st) else None

