"""Convert a GGUF model file to a Hugging Face folder that plain transformers loads.

transformers reads GGUF (dequantizing it) with ``gguf_file=``, but refuses to
``save_pretrained`` a model loaded that way. So the weights are read once, a fresh
model is built from the config, the state dict loaded into it, and the result saved as
safetensors with its tokenizer, built as the GGUF tokenizes and checked against the
GGUF's own vocabulary (:mod:`fp4sense.inputs.gguf_tokenizer`). Works for any
architecture transformers' GGUF loader knows (Llama, Qwen2/3, Mistral, Gemma, ...).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fp4sense.inputs.gguf_tokenizer import check_tokenizer, gguf_tokenizer
from fp4sense.runtime.outputs import guard_output, publish_folder, work_folder
from fp4sense.validate import UserError

__all__ = ["GGUFConversionError", "convert_gguf", "special_tokens"]

#: GGUF tokenizer metadata -> the tokenizer attribute it sets (transformers' GGUF loader
#: does not carry these over, so a converted tokenizer would drop the model's BOS)
_FLAGS = {"tokenizer.ggml.add_bos_token": "add_bos_token",
          "tokenizer.ggml.add_eos_token": "add_eos_token"}
_IDS = {"tokenizer.ggml.bos_token_id": "bos_token", "tokenizer.ggml.eos_token_id": "eos_token"}


class GGUFConversionError(UserError, RuntimeError):
    """The GGUF file could not be converted (names the file and the cause)."""


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    name_or_path: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Convert ``gguf_path`` to an HF folder at ``out_dir`` (safetensors in ``dtype``).

    ``out_dir`` follows the one ``--out`` rule (:func:`fp4sense.runtime.outputs.
    guard_output`): never the GGUF's folder, the current folder or a parent of either;
    ``overwrite`` replaces only a folder fp4sense wrote; one conversion at a time. The
    folder is written as ``.NAME.partial-*`` and renamed when complete, so an interrupted
    conversion never leaves a folder that looks usable (and the next run removes it).

    :param name_or_path: recorded as the model's ``_name_or_path`` (e.g. the hub id of
        the original model), since GGUF metadata names are often internal run names
    :return: the output folder
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if gguf_path.is_dir():
        raise GGUFConversionError(f"{gguf_path} is a folder; give the .gguf file itself "
                                  "(a split GGUF: its first part)")
    if not gguf_path.is_file():
        raise GGUFConversionError(f"GGUF file not found: {gguf_path}")
    guard_output(out_dir, inputs=[gguf_path], overwrite=overwrite)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except Exception as exc:  # transformers raises many kinds here; name the file once
        raise GGUFConversionError(f"could not read GGUF file {gguf_path}: {exc}") from exc
    state = loaded.state_dict()
    del loaded
    tokenizer = gguf_tokenizer(gguf_path, tokenizer)  # as the GGUF tokenizes
    special_tokens(tokenizer, gguf_path)
    if name_or_path:
        # GGUF's general.name is often an internal run name; record the real origin
        config._name_or_path = name_or_path
        if hasattr(config, "_model_name_or_path"):
            config._model_name_or_path = name_or_path
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied embeddings legitimately leave lm_head out of the GGUF state dict
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise GGUFConversionError(
            f"{gguf_path}: tensors do not match the {config.model_type} architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.tie_weights()
    tmp = work_folder(out_dir, log)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        check_tokenizer(tmp, gguf_path)  # the same ids as the GGUF's own vocabulary
        publish_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def special_tokens(tokenizer, gguf_path: str | os.PathLike) -> dict:
    """Give ``tokenizer`` the special-token behaviour the GGUF file's metadata states:
    whether encoding adds BOS / EOS (``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token``) and which tokens they are (``bos_token_id`` / ``eos_token_id``).
    Returns what the metadata said (absent keys are left as the loader set them)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    said: dict = {}
    for key, attr in _IDS.items():
        if key in fields:
            token_id = int(fields[key].parts[fields[key].data[0]][0])
            if 0 <= token_id < len(tokenizer):
                setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))
                said[attr] = token_id
    for key, attr in _FLAGS.items():
        if key in fields:
            said[attr] = bool(fields[key].parts[fields[key].data[0]][0])
            setattr(tokenizer, attr, said[attr])
    return said
