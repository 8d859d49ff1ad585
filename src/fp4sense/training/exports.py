"""A training policy as the user's training stack loads it, each file with what it cannot
say written beside it (``notes``):

- ``te-precision-debug.yaml``: Transformer Engine's precision-debug features
  (nvdlfw_inspect; TE >= 2.13): ``DisableQuantizationLayer`` for a linear with all three
  GEMMs in high precision, ``DisableQuantizationGEMM`` with the GEMMs otherwise; one
  section per set of GEMMs, so no layer is matched twice (TE raises); layer regexes
  anchored (TE matches them unanchored with ``re.search``), with Megatron's names
  (``decoder.layers.<L>.self_attention.linear_qkv``, L counted from 1 as
  ``infer_and_assign_layer_names`` numbers them). TE only turns quantization off: an
  MXFP8 GEMM becomes BF16 there (noted);
- ``megatron.json``: ``--te-precision-config-file`` content (per module, 0-based indices;
  a module whose GEMMs differ takes its highest precision, noted) and, where the policy
  is whole blocks at the start and the end, ``--first-last-layers-bf16`` arguments;
- ``torchtitan.json``: the FQNs to leave out (``[quantize.linear.mx] filter_fqns``) and to
  convert (``NVFP4LinearConverter.fqns``), torchtitan's Llama names;
- ``torchao.json``: the module FQNs kept in high precision, for
  ``quantize_(model, config, filter_fn=torchao_filter(...))``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from fp4sense.numerics.training import GEMMS

__all__ = ["EXPORTS", "megatron_config", "te_debug_yaml", "torchao_filter", "torchtitan_fqns",
           "write_exports"]

EXPORTS = ("te-precision-debug.yaml", "megatron.json", "torchtitan.json", "torchao.json")
#: a Hugging Face leaf name -> (Megatron's module, torchtitan's)
_NAMES = {"q_proj": ("self_attention.linear_qkv", "attention.wq"),
          "k_proj": ("self_attention.linear_qkv", "attention.wk"),
          "v_proj": ("self_attention.linear_qkv", "attention.wv"),
          "qkv_proj": ("self_attention.linear_qkv", None),
          "o_proj": ("self_attention.linear_proj", "attention.wo"),
          "gate_proj": ("mlp.linear_fc1", "feed_forward.w1"),
          "up_proj": ("mlp.linear_fc1", "feed_forward.w3"),
          "gate_up_proj": ("mlp.linear_fc1", None),
          "down_proj": ("mlp.linear_fc2", "feed_forward.w2")}
_RANK = {"bf16": 2, "mxfp8": 1}  # higher: more precise; FP4 recipes 0


def _rank(p: str) -> int:
    return _RANK.get(p, 0)


def _leaves(policy: dict):
    """(block, HF module, leaf, {gemm: precision}) of every linear of the policy."""
    for ch in policy["choices"]:
        for m in ch["modules"]:
            yield ch["block"], m, m.rsplit(".", 1)[-1], ch["gemms"]


def _megatron(block: int, leaf: str, one_based: bool, module: str = "") -> str | None:
    name = _NAMES.get(leaf, (None, None))[0]
    if name is not None and ".experts." in module:  # routed experts: Megatron's grouped
        name = name.replace("mlp.", "mlp.experts.")
    return None if name is None else f"decoder.layers.{block + one_based}.{name}"


def te_debug_yaml(policy: dict) -> tuple[dict, list[str]]:
    """The precision-debug config (a dict to dump as YAML) and its notes."""
    notes, by_set = [], {}
    seen = set()
    for block, module, leaf, gemms in _leaves(policy):
        name = _megatron(block, leaf, True, module)
        off = tuple(g for g in GEMMS if gemms[g] in ("bf16", "mxfp8"))
        if any(gemms[g] == "mxfp8" for g in GEMMS):
            notes.append(f"{module}: MXFP8 GEMMs are written as BF16 (TE's debug features "
                         "only turn quantization off)")
        if not off or name is None or name in seen:
            if name is None and off:
                notes.append(f"{module}: no Megatron name; not in the TE file")
            continue
        seen.add(name)
        by_set.setdefault(off, []).append(name)
    config = {}
    for off, names in by_set.items():
        pattern = "(^|\\.)(" + "|".join(re.escape(n) for n in sorted(names)) + ")$"
        feature = ({"DisableQuantizationLayer": {"enabled": True}} if len(off) == 3 else
                   {"DisableQuantizationGEMM": {"enabled": True, "gemms": list(off)}})
        config[f"fp4sense_high_precision_{'_'.join(off)}"] = {
            "enabled": True, "layers": {"layer_name_regex_pattern": pattern},
            "transformer_engine": feature}
    return config, notes


def megatron_config(policy: dict) -> dict:
    """``--te-precision-config-file`` content, and first/last-layers arguments."""
    configs = {"bf16": {"transformer_engine_config_type": "TEQuantizationParams",
                        "training_recipe": {}},
               "mxfp8": {"transformer_engine_config_type": "TEQuantizationParams",
                         "training_recipe": {"fp8_quantization_recipe": "mxfp8"}},
               "nvfp4": {"transformer_engine_config_type": "TEQuantizationParams",
                         "training_recipe": {"fp4_quantization_recipe": "nvfp4"}}}
    matchers, notes, modules = {}, [], {}
    for block, module, leaf, gemms in _leaves(policy):
        name = _megatron(block, leaf, False, module)
        if name is None:
            notes.append(f"{module}: no Megatron name")
            continue
        best = max((gemms[g] for g in GEMMS), key=_rank)
        if len(set(gemms.values())) > 1:
            notes.append(f"{name}: per module, not per GEMM: {best} for all three "
                         f"(the policy: {gemms})")
        if best == "mxfp4":
            notes.append(f"{name}: Megatron has no MXFP4 recipe; nvfp4 written")
            best = "nvfp4"
        modules[name] = best
    for name, config in modules.items():
        matchers[name.replace(".", "_")] = {"config": config, "type": "glob",
                                            "pattern": name, "enabled": True}
    return {"te_precision_config": {"configs": configs, "matchers": matchers},
            "first_last_layers": _first_last(policy), "notes": notes}


def _first_last(policy: dict) -> dict:
    """Megatron's first/last-layers arguments, where the policy is whole blocks in BF16 at
    the start and the end and all-FP4 blocks between."""
    state: dict[int, set] = {}
    for ch in policy["choices"]:
        kinds = set(ch["gemms"].values())
        state.setdefault(ch["block"], set()).add(
            "bf16" if kinds == {"bf16"} else "fp4" if kinds == {policy["recipe"]} else "mixed")
    order = [("bf16" if s == {"bf16"} else "fp4" if s == {"fp4"} else "mixed")
             for _, s in sorted(state.items())]
    start = next((i for i, s in enumerate(order) if s != "bf16"), len(order))
    end = next((i for i, s in enumerate(reversed(order)) if s != "bf16"), 0)
    if start == len(order) or any(s != "fp4" for s in order[start:len(order) - end]):
        return {"expressible": False, "why": "the policy is not whole blocks in BF16 at the "
                "start and the end with all-FP4 blocks between (it chooses per unit and per "
                "GEMM): use the TE or Megatron precision config"}
    return {"expressible": True, "args": ["--first-last-layers-bf16",
                                          "--num-layers-at-start-in-bf16", str(start),
                                          "--num-layers-at-end-in-bf16", str(end)]}


def torchtitan_fqns(policy: dict) -> dict:
    keep, convert, notes = set(), set(), []
    for block, module, leaf, gemms in _leaves(policy):
        titan = None if ".experts." in module else _NAMES.get(leaf, (None, None))[1]
        if titan is None:
            notes.append(f"{module}: no torchtitan name")
            continue
        name = f"layers.{block}.{titan}"
        (convert if all(gemms[g] == policy["recipe"] for g in GEMMS) else keep).add(name)
    return {"filter_fqns": ["output", *sorted(keep)], "fqns": sorted(convert),
            "notes": notes + ["filter_fqns (exclude) and fqns (include) match by substring; "
                              "a linear not all-FP4 is left out whole"]}


def torchao_filter(source: str | Path | Mapping):
    """``filter_fn(module, fqn)`` for torchao's ``quantize_``: True for a linear to convert
    (not kept in high precision by the policy or its torchao.json)."""
    import torch

    data = json.loads(Path(source).read_text()) if not isinstance(source, Mapping) else source
    keep = set(data["keep_high_precision"]) if "keep_high_precision" in data else {
        m for _, m, _, gemms in _leaves(data)
        if any(gemms[g] != data["recipe"] for g in GEMMS)}
    return lambda module, fqn: isinstance(module, torch.nn.Linear) and fqn not in keep


def write_exports(policy: dict, folder: Path) -> list[Path]:
    """Every export of ``policy`` into ``folder``; returns the files."""
    te, te_notes = te_debug_yaml(policy)
    header = "".join(f"# {n}\n" for n in ["fp4sense training policy: Transformer Engine "
                                         "precision-debug config (TE >= 2.13)", *te_notes])
    files = {"te-precision-debug.yaml": header + yaml.safe_dump(te, sort_keys=False),
             "megatron.json": json.dumps(megatron_config(policy), indent=1),
             "torchtitan.json": json.dumps(torchtitan_fqns(policy), indent=1),
             "torchao.json": json.dumps({"keep_high_precision": sorted(
                 m for _, m, _, g in _leaves(policy)
                 if any(g[k] != policy["recipe"] for k in GEMMS)) + ["lm_head"]}, indent=1)}
    out = []
    for name, text in files.items():
        (folder / name).write_text(text)
        out.append(folder / name)
    return out
