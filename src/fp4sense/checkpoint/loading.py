"""Helpers for models carrying compressed-tensors quantization (fake-quantized in memory).

After llm-compressor's oneshot a model re-quantizes every weight on every forward
(fake quantization). For evaluation that is wasted work: :func:`bake_weights` applies
the weight quantization once, with compressed-tensors' own ``forward_quantize``, and
leaves only the activation quantization live. The numbers do not change.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import remove_dispatch
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import (
    forward_quantize,
    set_forward_quantized,
)
from compressed_tensors.transform import TransformConfig, apply_transform_config
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from fp4sense.checkpoint.checks import transform_modules
from fp4sense.inputs.moe import fused_experts, linearize_experts
from fp4sense.validate import InputError

__all__ = ["apply_online_transforms", "apply_served_activation_quantization", "bake_weights",
           "load_checkpoint"]


@torch.no_grad()
def bake_weights(model: torch.nn.Module) -> int:
    """Replace each quantized weight by its fake-quantized value, once; return the count."""

    baked = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        status = getattr(module, "quantization_status", None)
        if scheme is None or scheme.weights is None or status is None:
            continue
        if status >= QuantizationStatus.COMPRESSED:
            continue
        module.weight.data = forward_quantize(module, module.weight.data, "weight", scheme.weights)
        # the forward wrapper reads the scheme each call: without weights it only
        # quantizes activations from now on
        module.quantization_scheme = scheme.model_copy(update={"weights": None})
        baked += 1
    return baked


def _is_mxfp4(args) -> bool:
    return (args is not None and args.num_bits == 4 and args.type == "float"
            and args.group_size == 32)


def apply_served_activation_quantization(
    model: torch.nn.Module, promote_mxfp4: bool = True
) -> tuple[int, list[str]]:
    """Quantize activations the way vLLM serves the checkpoint, with compressed-tensors' code.

    transformers' load decompresses the weights and runs every linear unquantized, so on
    its own it does not compute what vLLM serves for W4A4 schemes. This re-attaches
    compressed-tensors' forward with the checkpoint's input activation arguments, and for
    MXFP4 weights with none (MXFP4A16) the MXFP4 preset's, since vLLM runs those as W4A4.

    :return: how many layers quantize their inputs, and notes on what was changed
        beyond the checkpoint's own config
    """

    mxfp4_inputs = preset_name_to_scheme("MXFP4", ["Linear"]).input_activations
    promoted = quantized = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        inputs = scheme.input_activations
        if inputs is None and promote_mxfp4 and _is_mxfp4(scheme.weights):
            inputs, promoted = mxfp4_inputs, promoted + 1
        if inputs is None:
            continue
        # weights are already decompressed: only the inputs are quantized from here on
        module.quantization_scheme = scheme.model_copy(
            update={"weights": None, "input_activations": inputs})
        set_forward_quantized(module)
        quantized += 1
    notes = []
    if promoted:
        notes.append(f"vLLM builds MXFP4 layers as W4A4 (dynamic MXFP4 activations) even "
                     f"when the checkpoint says MXFP4A16; the reference does the same "
                     f"({promoted} layers)")
    return quantized, notes


@torch.no_grad()
def load_checkpoint(folder, promote_mxfp4: bool = False, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32):
    """A compressed-tensors checkpoint as a model (``dtype`` on ``device``; the protocol's
    float32 on the CPU by default) computing what it describes:
    weights decompressed, input activations quantized as the config says (and MXFP4A16
    as W4A4 when ``promote_mxfp4``, as vLLM serves it).

    :return: (model, number of layers quantizing their inputs, notes)
    """

    # compressed-tensors decompresses FP4 weights to bf16 on the first forward; loading
    # straight into float32 then fails on a dtype mismatch. So load in bf16, let one
    # forward decompress, then compute in ``dtype``.
    if _has_fused_experts(folder):
        model = _load_linearized(folder).eval()
    else:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                           output_loading_info=True)
        model.eval()
        missing = [k for k in info.get("missing_keys", ()) if not k.endswith("_buffer")]
        if missing:
            raise InputError(f"checkpoint {str(folder)!r} lacks {len(missing)} tensor(s) the "
                             f"model needs ({', '.join(sorted(missing)[:3])}"
                             f"{', ...' if len(missing) > 3 else ''}); they would be random: "
                             "write the checkpoint again")
    model.to(device)
    model(input_ids=torch.tensor([[0, 1]], device=model.device))
    model.to(dtype)
    rotated = apply_online_transforms(model, folder)
    act_layers, notes = apply_served_activation_quantization(model, promote_mxfp4)
    if rotated:
        notes.append(f"{rotated} layers rotate their inputs online (the checkpoint's "
                     "transform_config, applied by fp4sense: transformers' own load "
                     "ignores it)")
    return model, act_layers, notes


def apply_online_transforms(model: torch.nn.Module, folder) -> int:
    """Attach the online side (``input``) of the checkpoint's ``transform_config`` with
    compressed-tensors' own ``apply_transform_config``: its weights already hold the
    fused side, and transformers' load attaches no transform. Returns how many linears
    rotate their inputs."""

    config = json.loads((Path(folder) / "config.json").read_text())
    given = (config.get("quantization_config") or {}).get("transform_config")
    if not given:
        return 0
    full = TransformConfig.model_validate(given)
    online = TransformConfig(config_groups={
        name: scheme.model_copy(update={"apply": [a for a in scheme.apply if a.is_online()]})
        for name, scheme in full.config_groups.items()})
    apply_transform_config(model, online)
    return sum(1 for m in model.modules()
               if any(type(c).__name__ == "HadamardTransform" for c in m.children()))


def _has_fused_experts(folder) -> bool:
    """Whether the model a checkpoint describes keeps experts as 3-D parameters."""

    config = AutoConfig.from_pretrained(folder)
    if getattr(config.get_text_config(), "num_hidden_layers", None):
        config.get_text_config().num_hidden_layers = 1  # one block shows the layout
    with torch.device("meta"):
        probe = AutoModelForCausalLM.from_config(_without_quantization(config))
    return bool(fused_experts(probe))


def _without_quantization(config):
    plain = copy.deepcopy(config)
    if hasattr(plain, "quantization_config"):
        del plain.quantization_config
    return plain


def _load_linearized(folder) -> torch.nn.Module:
    """A MoE checkpoint whose experts are stored per expert (as llm-compressor writes
    them): the model is built with per-expert linears (the host's layout), the
    compressed-tensors config applied to it as transformers' quantizer does, the tensors
    loaded - every one the model needs, or one line naming the first that is not there -
    and the weights decompressed."""

    config = AutoConfig.from_pretrained(folder)
    quantization = getattr(config, "quantization_config", None)
    model = AutoModelForCausalLM.from_config(_without_quantization(config),
                                             dtype=torch.bfloat16)
    linearize_experts(model, str(folder))
    compressor = None
    if quantization is not None:
        qconfig = QuantizationConfig.model_validate(quantization)
        apply_quantization_config(model, qconfig, run_compressed=False, show_progress=False)
        compressor = ModelCompressor(quantization_config=qconfig)
        compressor.compress_model(model)  # the stored layout (packed weights, scales)
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
             if index.is_file() else [folder / "model.safetensors"])
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    state = _renamed(state, config.model_type)
    transforms = transform_modules(folder)  # attached (and built) by apply_online_transforms
    state = {k: v for k, v in state.items()
             if k.rpartition(".")[0].rpartition(".")[2] not in transforms}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    bad = [f"{k} (missing)" for k in missing] + [f"{k} (not in the model)" for k in unexpected]
    if bad:
        raise InputError(f"checkpoint {str(folder)!r} does not match its model: "
                         f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''} "
                         f"({len(bad)} tensors); write the checkpoint again")
    if compressor is not None:
        compressor.decompress_model(model)
    # compressed-tensors leaves its modules wrapped in offloading to the device they were
    # built on (the CPU): moved to a GPU, they would still compute there
    remove_dispatch(model, onload_tensors=True)
    return model


def _renamed(state: dict, model_type: str) -> dict:
    """Stored names as the model names them: transformers' load-time renamings of the
    family (Mixtral's ``block_sparse_moe`` -> ``mlp``), the only ones a per-expert
    checkpoint needs (its weight converters fuse experts, which these models keep apart)."""

    renamings = [r for r in get_checkpoint_conversion_mapping(model_type) or ()
                 if isinstance(r, WeightRenaming)]
    if not renamings:
        return state
    out = {}
    for key, tensor in state.items():
        for renaming in renamings:
            key = renaming.rename_source_key(key)[0]
        out[key] = tensor
    return out
