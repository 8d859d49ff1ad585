"""A checkpoint's model card (README.md): Hugging Face metadata (huggingface_hub's
ModelCardData), what was done, the plan as a table and a picture, the measured figures,
and how to serve and reproduce it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from huggingface_hub import ModelCard, ModelCardData
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from fp4sense.inputs.assets import MODEL_BASE_ID, MODEL_LICENSE
from fp4sense.inputs.texts import PROTOCOL_EVAL_TEXT
from fp4sense.numerics.schemes import get_scheme
from fp4sense.reports.plots import pyplot, save_figure
from fp4sense.structure.lineage import hub_id_of
from fp4sense.structure.units import short_kind

__all__ = ["SCHEME_COLOURS", "plot_plan", "write_model_card"]

SCHEME_COLOURS = {"BF16": "#d9d9d9", "FP8_DYNAMIC": "#4c72b0", "INT8": "#55a868",
                  "NVFP4": "#dd8452", "NVFP4A16": "#f2b880", "MXFP4": "#c44e52",
                  "MXFP4A16": "#e8a0a2", "INT4": "#8172b3"}


def plot_plan(plan, path: Path) -> Path:
    """Unit kind × block map of a plan's schemes."""
    plt = pyplot()

    kinds: list[str] = []
    blocks = 0
    for c in plan.choices:
        block, _, kind = c.unit.partition(":")
        if kind not in kinds:
            kinds.append(kind)
        blocks = max(blocks, int(block) + 1)
    used = sorted({c.scheme for c in plan.choices})
    grid = np.full((len(kinds), blocks), np.nan)
    for c in plan.choices:
        block, _, kind = c.unit.partition(":")
        grid[kinds.index(kind), int(block)] = used.index(c.scheme)
    cmap = ListedColormap([SCHEME_COLOURS.get(s, "#999999") for s in used])
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * blocks), 1.4 + 0.45 * len(kinds)))
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(used) - 0.5,
              interpolation="nearest")
    ax.set_yticks(range(len(kinds)), [short_kind(k)
                                      for k in kinds])
    ax.set_xlabel("decoder block")
    ax.set_title(f"Plan: {plan.bits:.2f} bits per weight, predicted KL {plan.predicted_kl:.3f}")
    ax.legend(handles=[Patch(color=SCHEME_COLOURS.get(s, "#999999"), label=s) for s in used],
              loc="upper left", bbox_to_anchor=(1.01, 1))
    return save_figure(fig, path)


def _license(source: str, hub_id: str | None) -> dict:
    """The base model's license fields, where known: the bundled model's, a local folder's
    model card, or (for a model taken from the Hub) its card there; {} when unknown."""

    if hub_id == MODEL_BASE_ID:
        return {"license": MODEL_LICENSE}

    local = Path(source)
    try:
        if (local / "README.md").is_file():
            card = ModelCard.load(local / "README.md")
        elif hub_id and not local.exists():
            card = ModelCard.load(hub_id)  # the model itself came from there
        else:
            return {}
    except Exception:  # no card, offline, unparsable: the license stays unknown
        return {}
    meta = card.data.to_dict()
    if not isinstance(meta.get("license"), str):
        return {}
    # "other" licenses are named and linked; carry those too
    return {k: meta[k] for k in ("license", "license_name", "license_link") if k in meta}


def write_model_card(folder: Path, plan, evaluation: dict | None, *, source: str,
                     notes: list[str], gptq: bool = False, name: str | None = None,
                     hub_id: str | None = None) -> Path:
    """README.md of a checkpoint: Hugging Face card metadata, what was done, the plan
    (table and picture), measured figures, and how to serve it with vLLM.

    :param hub_id: the base model's Hub id (default: derived from ``source`` where that
        is certain, :func:`fp4sense.structure.lineage.hub_id_of`); it becomes ``base_model`` with
        ``base_model_relation: quantized``. Without one the card says how to add it.
    """

    folder = Path(folder)
    plot_plan(plan, folder / "plan.png")
    hub_id = hub_id or hub_id_of(source)
    used = set(plan.schemes())
    tags = ["fp4sense", "compressed-tensors", "llmcompressor", "vllm", "mixed-precision"]
    tags += [t for t, hit in (("fp4", any("FP4" in s for s in used)),
                              ("nvfp4", any(s.startswith("NVFP4") for s in used)),
                              ("mxfp4", any(s.startswith("MXFP4") for s in used)),
                              ("fp8", "FP8_DYNAMIC" in used)) if hit]
    meta = {"base_model": hub_id, "base_model_relation": "quantized" if hub_id else None,
            **_license(source, hub_id), "library_name": "transformers", "tags": tags,
            "pipeline_tag": "text-generation"}
    meta = {k: v for k, v in meta.items() if v is not None}
    name = name or folder.name
    # a local base model is named by its folder only: a card is for sharing, not for paths
    base_name = hub_id or Path(source).name
    by_scheme = plan.schemes()
    lines = [
        "---", ModelCardData(**meta).to_yaml(), "---", "",
        f"# {base_name}, FP4 mixed precision ({plan.bits:.2f} bits per weight)", "",
        f"Quantized with [fp4sense](https://pypi.org/project/fp4sense/) "
        f"{plan.fp4sense_version} and llm-compressor: each unit of the decoder (a fused "
        "q/k/v or gate/up group, or a single linear) got the scheme that an exact budgeted "
        f"plan chose from the menu {', '.join(plan.menu)}, minimizing the predicted damage "
        f"(the sum of the units' {plan.damage_source} FP4 sensitivities, KL) under "
        f"{_objective(plan.objective)}." + (" Weights were then rounded with GPTQ." if gptq
                                            else ""),
        "lm_head and the embeddings are not quantized. The checkpoint is a standard "
        "compressed-tensors checkpoint (`" + ("mixed-precision" if len(
            [s for s in used if get_scheme(s).quantizes]) > 1 else "single-format")
        + "`); loading it needs no fp4sense code.", "",
        *[f"> {n}" for n in notes], "",
        *([] if hub_id else [
            f"The base model's Hub id is not known (it was quantized from a local folder, "
            f"`{base_name}`), so this card does not link it. Add `base_model: ORG/NAME` and "
            "`base_model_relation: quantized` to the metadata above, or quantize with "
            "`--base-model-id ORG/NAME`.", ""]),
        "## Plan", "", "![plan](plan.png)", "",
        "| scheme | units | share of weights |", "|---|---|---|",
    ]
    total = sum(c.numel for c in plan.choices)
    for scheme, count in by_scheme.items():
        share = sum(c.numel for c in plan.choices if c.scheme == scheme) / total
        lines.append(f"| {scheme} | {count} | {share:.1%} |")
    lines += ["", f"Predicted KL (sum over units): {plan.predicted_kl:.4f}. Per unit: "
              "`plan.json`; sensitivities: `sensitivity.json`.", ""]
    lines += _experts_lines(folder, plan)
    lines += _rotation_lines(plan)
    lines += _training_lines(plan)
    if evaluation:
        e = evaluation
        lines += ["## Measured", "",
                  f"On {e['windows']} windows × {e['window_tokens']} tokens of "
                  f"{_text_name(e['text'])} "
                  f"(fp4sense protocol: {e.get('device', 'cpu float32')}, next-token distributions "
                  "against the unquantized model):", "",
                  "| effective bits / weight | KL(base ‖ this) | perplexity | base perplexity "
                  "| top-1 agreement |", "|---|---|---|---|---|",
                  f"| {e['effective_bits']:.3f} | {e['kl']:.4f} ± {e['kl_se']:.4f} | "
                  f"{e['ppl']:.3f} | {e['base_ppl']:.3f} | {e['top1']:.3f} |", ""]
    lines += ["## Serve with vLLM", "", "```bash", f"vllm serve {name}",
              "```", "", "or in Python: `vllm.LLM(model=\"<this folder or repo>\")`. NVFP4 "
              "runs natively (weights and activations in FP4) on Blackwell GPUs; on older "
              "CUDA GPUs vLLM runs NVFP4 weight-only (Marlin), activations in 16 bits. vLLM "
              "builds MXFP4 layers as W4A4 even where a checkpoint says MXFP4A16.", "",
              "## Reproduce", "", "From this folder, with `fp4sense-llmcompressor` installed:",
              "", "```python", "import fp4sense_llmcompressor  # registers the modifier",
              "from llmcompressor import oneshot",
              f"oneshot(model=\"{hub_id or '<base model>'}\", recipe=\"recipe.yaml\", "
              f"dataset=...{_precision(plan)})", "```", "", *_calibration_lines(plan)]
    path = folder / "README.md"
    ModelCard("\n".join(lines)).save(path)
    return path


def _text_name(text: str) -> str:
    """The evaluation text as a card names it: the protocol split, a dataset, or a file's
    name (never its path on this machine)."""

    if text == PROTOCOL_EVAL_TEXT:
        return "the protocol's evaluation split (State of the Union addresses 2000–2021)"
    if text.startswith("dataset:"):
        return f"the dataset `{text[len('dataset:'):]}`"
    return f"`{Path(text).name}`"


def _objective(objective: dict) -> str:
    if "budget_bits" in objective:
        return f"a budget of {objective['budget_bits']} bits per weight"
    if "budget_bytes" in objective:
        return f"a budget of {objective['budget_bytes']:,} bytes"
    return f"the fewest bits keeping predicted KL under {objective['kl_target']}"


def _precision(plan) -> str:
    """oneshot's argument that calibrates in the plan's dtype (none for bfloat16, its
    default for a bfloat16 base)."""
    dtype = plan.calibration.get("dtype")
    return f", precision=\"{dtype}\"" if dtype and dtype != plan.calibration.get(
        "stored_dtype", "bfloat16") else ""


def _calibration_lines(plan) -> list[str]:
    """Which dtype the oneshot calibrated in and what the files keep unquantized."""
    c = plan.calibration
    if not c.get("dtype"):
        return []
    return [f"llm-compressor calibrated the model in {c['dtype']} (the weights quantized "
            f"and the scales computed in it); the unquantized tensors are stored in "
            f"{c.get('stored_dtype', c['dtype'])}, as in the base model. A rerun "
            "calibrated in another dtype gives a checkpoint that differs slightly.", ""]


def _experts_lines(folder: Path, plan) -> list[str]:
    """A MoE plan: what the bits count, and experts the calibration text hardly reached
    (from the folder's sensitivity.json); nothing for a dense model."""
    if all(c.active == 1.0 for c in plan.choices):
        return []
    lines = ["### Experts", "",
             "Each block's routed experts are one unit (vLLM's fused-MoE layer takes one "
             f"scheme for all of them). {plan.bits:.2f} bits per weight count every expert "
             f"(what memory holds); a token computes with {plan.active_bits:.2f} bits per "
             "weight (the experts it is routed to). Routers stay in 16 bits."]
    saved = folder / "sensitivity.json"
    if saved.is_file():
        from fp4sense.reports.moe import LOW_COVERAGE, low_coverage

        few = low_coverage(json.loads(saved.read_text()).get("routing", {}))
        if few:
            lines.append(
                f"Experts that got under {LOW_COVERAGE:.0%} of an even share of the "
                "calibration tokens (their input scales still come from all tokens, as "
                "llm-compressor calibrates experts): " + "; ".join(
                    f"{u}: {', '.join(str(e) for e, _ in v)}" for u, v in few.items()) + ".")
    return lines + [""]


def _rotation_lines(plan) -> list[str]:
    """Units given a rotated scheme: what is stored, what serves them, what does not."""
    rotated = [c for c in plan.choices if get_scheme(c.scheme).rotation]
    if not rotated:
        return []
    widths = sorted({get_scheme(c.scheme).rotation for c in rotated})
    return ["### Rotations", "",
            f"{len(rotated)} of {len(plan.choices)} units "
            f"({sum(len(c.modules) for c in rotated)} linears) rotate their inputs by a "
            f"block-Hadamard matrix ({', '.join(map(str, widths))}-wide blocks) before "
            "quantizing: their weights are stored rotated, and the "
            "config's `transform_config` has the inputs rotated online (vLLM: hadacore on "
            "CUDA GPUs, QuTLASS's fused Hadamard + NVFP4 on Blackwell). transformers loads "
            "the checkpoint but does not apply `transform_config` (its load report lists the "
            "transform matrices as unexpected), so a plain transformers model computes with "
            "unrotated inputs: evaluate with vLLM, or with `fp4sense eval`, which attaches "
            "the transforms (`fp4sense.checkpoint.loading.load_checkpoint`).", ""]


def _training_lines(plan) -> list[str]:
    """The FP4 training (QAD) section, where the plan records one."""
    t = plan.training
    if not t:
        return []
    rollbacks = (f" The loss rose {t['rollbacks']} time(s); each time training went back to "
                 "its best state with half the learning rate." if t.get("rollbacks") else "")
    after_gptq = t.get("start", "").startswith("after GPTQ")
    held = t.get("holdout")
    block = t.get("mode") == "block"
    if block:
        ended = (f" The KL on {held['windows']} held-out windows it did not train on went "
                 f"{held['before']:.4f} -> {held['after']:.4f}"
                 + (" (training kept)." if held["step"] else
                    "; the training raised it, so the starting weights were kept.")
                 if held else "")
    else:
        ended = (f" The run ended on the state of step {held['step']}, the lowest KL on "
                 f"{held['windows']} held-out windows it did not train on "
                 f"({held['before']:.4f} before, {held['after']:.4f} after)." if held else "")
    scales = ("Training started from GPTQ's rounded weights under the scales GPTQ "
              "calibrated and ended on that grid: the checkpoint stores the trained model."
              if after_gptq else
              "The scales were then derived from the trained weights as for any checkpoint.")
    how = ("block by block: each decoder block in turn was trained for "
           f"{t['steps']} steps to reproduce the unquantized block's output from the "
           "output of the blocks before it as quantized and trained, the forward pass "
           "computing with the plan's formats (straight-through gradients)" if block else
           f"for {t['steps']} steps by quantization-aware distillation: the forward pass "
           "computed with the plan's formats (straight-through gradients) and the loss was "
           "the KL divergence to the unquantized model's next-token distributions")
    return ["## FP4 training", "",
            f"After planning{' and GPTQ' if after_gptq else ''}, the weights were trained "
            f"{how}, on {t['windows']} windows of "
            f"{_text_name(t['text']) if t.get('text') else 'the calibration text'} (learning "
            f"rate {t['lr']:g}, seed {t['seed']}). KL on the first training windows: "
            f"{t['loss_before']:.4f} before, {t['loss_after']:.4f} after.{ended}{rollbacks} "
            f"{scales} Curves: `distill.png`, per step: `distill.json`.", "",
            "![training](distill.png)", ""]
