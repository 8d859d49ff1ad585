"""Helpers for models carrying compressed-tensors quantization (fake-quantized in memory).

After llm-compressor's oneshot a model re-quantizes every weight on every forward
(fake quantization). For evaluation that is wasted work: :func:`bake_weights` applies
the weight quantization once, with compressed-tensors' own ``forward_quantize``, and
leaves only the activation quantization live. The numbers do not change.
"""

from __future__ import annotations

import torch

__all__ = ["apply_served_activation_quantization", "bake_weights", "load_checkpoint"]


@torch.no_grad()
def bake_weights(model: torch.nn.Module) -> int:
    """Replace each quantized weight by its fake-quantized value, once; return the count."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

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
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized

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
    from transformers import AutoModelForCausalLM

    # compressed-tensors decompresses FP4 weights to bf16 on the first forward; loading
    # straight into float32 then fails on a dtype mismatch. So load in bf16, let one
    # forward decompress, then compute in ``dtype``.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model.to(device)
    model(input_ids=torch.tensor([[0, 1]], device=model.device))
    model.to(dtype)
    act_layers, notes = apply_served_activation_quantization(model, promote_mxfp4)
    return model, act_layers, notes
