"""GGUF files built with the gguf package for the tests (and scripts/gguf_tokenizer.py):
tokenizer vocabularies of each kind trained here (SentencePiece BPE with and without the
leading space, as Llama / Mistral and Gemma; a byte-level BPE with merges, as Qwen), and a
tiny Llama's tensors named as llama.cpp's converter names them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

#: family -> (GGUF architecture, tokenizer.ggml.model, add_space_prefix)
FAMILIES = {"llama": ("llama", "llama", True), "mistral": ("llama", "llama", True),
            "gemma": ("gemma3", "llama", False), "qwen": ("qwen2", "gpt2", None)}
VOCAB = 2000


def training_lines() -> list[str]:
    from fp4sense.inputs.texts import load_text

    text = load_text(None, "calibration")[:400_000]
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def vocabularies_in(folder: Path) -> dict:
    """Tokenizer fields of each kind: SentencePiece BPE models trained with and without
    the leading space (Llama / Mistral, Gemma), and a byte-level BPE with merges."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    lines = training_lines()
    (folder / "train.txt").write_text("\n".join(lines))
    out = {}
    for prefix in (True, False):
        name = folder / f"sp-{prefix}"
        spm.SentencePieceTrainer.train(
            input=str(folder / "train.txt"), model_prefix=str(name), vocab_size=VOCAB,
            model_type="bpe", byte_fallback=True, add_dummy_prefix=prefix,
            remove_extra_whitespaces=False, split_digits=True,
            normalization_rule_name="identity", character_coverage=1.0, pad_id=0, eos_id=1,
            bos_id=2, unk_id=3, minloglevel=2)
        proto = pb.ModelProto()
        proto.ParseFromString(Path(f"{name}.model").read_bytes())
        out[prefix] = {"tokens": [p.piece for p in proto.pieces],
                       "scores": [p.score for p in proto.pieces],
                       "types": [int(p.type) for p in proto.pieces], "model": f"{name}.model"}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(bpe.to_str())["model"]
    tokens = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    out["gpt2"] = {"tokens": tokens, "merges": merges, "types": [3] + [1] * (len(tokens) - 1)}
    return out


def write_gguf(path: Path, family: str, vocab: dict, model=None) -> Path:
    """A GGUF of ``family``'s tokenizer kind (and, given ``model``, a tiny Llama's tensors
    and hyperparameters, as llama.cpp's converter names them)."""
    import gguf

    arch, kind, prefix = FAMILIES[family]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if kind == "llama":
        writer.add_token_scores(vocab["scores"])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(prefix)
    else:
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(vocab["merges"])
        writer.add_eos_token_id(0)
        writer.add_bos_token_id(0)
        writer.add_add_bos_token(False)
    if model is not None:
        _add_llama_tensors(writer, model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_llama_tensors(writer, model) -> None:
    c = model.config
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in model.state_dict().items():
        array = value.float().numpy().astype(np.float32)
        if key == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
        elif key == "model.norm.weight":
            writer.add_tensor("output_norm.weight", array)
        elif key.startswith("model.layers."):
            block, rest = key[len("model.layers."):].split(".", 1)
            module = rest.removesuffix(".weight")
            writer.add_tensor(f"blk.{block}.{names[module]}.weight", array)
