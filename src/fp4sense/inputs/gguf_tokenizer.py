"""A GGUF's tokenizer, written so that it tokenizes as the GGUF does, and checked.

A GGUF names its tokenizer's kind in ``tokenizer.ggml.model``:

- ``llama``: a SentencePiece vocabulary with scores (Llama 2, Mistral, Gemma). llama.cpp
  and SentencePiece tokenize it by merging the best-scored pair of neighbouring pieces.
  transformers' GGUF loader builds that (a BPE whose merges are ordered by score,
  ``GGUFLlamaConverter``) for Llama-architecture files, but a Unigram model for Gemma's,
  which splits words into characters; fp4sense builds every such vocabulary with
  transformers' own ``GGUFLlamaConverter``;
- ``gpt2``: a byte-level BPE with its merges (SmolLM2, Qwen, Llama 3): transformers'
  loader keeps the merges, and fp4sense keeps its tokenizer.

After conversion :func:`check_tokenizer` compares the written tokenizer's ids on a fixed
sample in several scripts with a reference: the ``sentencepiece`` library on a model built
from the GGUF's own pieces, scores and types; for a merges vocabulary, the ``tokenizers``
library's BPE on the GGUF's own vocabulary and merges (on the sample's words, which every
byte-level pre-tokenizer splits alike) and an exact round trip of the whole sample.
"""

from __future__ import annotations

import os
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.integrations.ggml import GGUFLlamaConverter
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from fp4sense.validate import UserError

__all__ = ["SAMPLE", "TokenizerMismatch", "check_tokenizer", "gguf_tokenizer",
           "reference_ids", "sentencepiece_model"]

#: the fixed sample the written tokenizer is checked on: Latin with accents, German ß,
#: CJK, digits and code
SAMPLE = ("The capital of France is Paris. Ça coûte douze euros à Zürich; déjà vu, naïve "
          "café. Die Straße und der Fußgänger grüßen. 東京は日本の首都です。北京欢迎你。 "
          "In 2024, 3.14159 × 12,500 = 39,269.875.\n"
          "def area(r):\n    return 3.14159 * r ** 2  # circle\n\tif x != y: print(x)")
#: the words of the sample that every byte-level pre-tokenizer splits alike (letters
#: after one space): the merges reference runs on these
_WORDS = ("The capital of France is Paris Ça coûte douze euros à Zürich déjà vu naïve café "
          "Die Straße und der Fußgänger grüßen 東京は日本の首都です 北京欢迎你")

#: GGUF token types (llama.cpp's llama_token_type) are SentencePiece's piece types
#: (1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte)
_BYTE = 6


class TokenizerMismatch(UserError, RuntimeError):
    """The written tokenizer does not tokenize as the GGUF does (names the first piece)."""


def _fields(gguf_path: Path) -> dict:
    """The GGUF's tokenizer fields as transformers' GGUF loader reads them."""

    return load_gguf_checkpoint(str(gguf_path), return_tensors=False)["tokenizer"]


def gguf_tokenizer(gguf_path: str | os.PathLike, loaded):
    """The tokenizer to write for the GGUF: ``loaded`` (what transformers' loader built)
    for a vocabulary with merges; for a SentencePiece vocabulary with scores, the BPE
    transformers' ``GGUFLlamaConverter`` builds from its pieces and scores, carrying the
    special tokens and the chat template over."""

    fields = _fields(Path(gguf_path))
    if fields.get("tokenizer_type") != "llama" or "merges" in fields:
        return loaded
    backend = GGUFLlamaConverter(dict(fields)).converted()
    tokens = fields["tokens"]

    def named(key: str) -> str | None:
        i = fields.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=named("bos_token_id"),
        eos_token=named("eos_token_id"), unk_token=named("unk_token_id"),
        pad_token=named("pad_token_id"), clean_up_tokenization_spaces=False)
    if getattr(loaded, "chat_template", None):
        tokenizer.chat_template = loaded.chat_template
    return tokenizer


def sentencepiece_model(fields: dict) -> bytes:
    """A serialized SentencePiece BPE model of the GGUF's pieces, scores and types, with
    the normalization llama.cpp applies to such a vocabulary (spaces as ``▁``, a leading
    ``▁`` unless ``add_space_prefix`` is false, nothing else)."""

    model = pb.ModelProto()
    for piece, score, kind in zip(fields["tokens"], fields["scores"],
                                  fields.get("token_type") or [1] * len(fields["tokens"]),
                                  strict=True):
        model.pieces.add(piece=piece, score=float(score), type=int(kind))
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(fields["tokens"])
    spec.byte_fallback = _BYTE in (fields.get("token_type") or [])
    for key, field in (("unk_token_id", "unk_id"), ("bos_token_id", "bos_id"),
                       ("eos_token_id", "eos_id"), ("pad_token_id", "pad_id")):
        setattr(spec, field, int(fields[key]) if isinstance(fields.get(key), int) else -1)
    norm = model.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(fields.get("add_prefix_space", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return model.SerializeToString()


def reference_ids(fields: dict, text: str) -> list[int]:
    """The ids the GGUF's own vocabulary gives ``text``: SentencePiece on its pieces,
    scores and types; for a merges vocabulary, the ``tokenizers`` BPE on its vocabulary
    and merges behind a byte-level pre-tokenizer."""
    if fields.get("tokenizer_type") == "llama" and "merges" not in fields:

        return spm.SentencePieceProcessor(model_proto=sentencepiece_model(fields)).encode(text)

    vocab = {t: i for i, t in enumerate(fields["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
    bpe = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return bpe.encode(text, add_special_tokens=False).ids


def _piece(fields: dict, ids: list[int], at: int) -> str:
    """The piece at position ``at`` of ``ids``, named in the GGUF's vocabulary."""
    if at >= len(ids):
        return "(the end)"
    tokens = fields["tokens"]
    return repr(tokens[ids[at]]) if 0 <= ids[at] < len(tokens) else f"id {ids[at]}"


def check_tokenizer(folder: str | os.PathLike, gguf_path: str | os.PathLike) -> None:
    """The tokenizer written in ``folder`` gives the GGUF vocabulary's own ids on
    :data:`SAMPLE` (a merges vocabulary: on its words, and decodes the whole sample back);
    else one :class:`TokenizerMismatch` naming the tokenizer and the first piece that
    differs."""

    fields = _fields(Path(gguf_path))
    written = AutoTokenizer.from_pretrained(str(folder))
    spm_vocab = fields.get("tokenizer_type") == "llama" and "merges" not in fields
    text = SAMPLE if spm_vocab else _WORDS
    got = list(written(text, add_special_tokens=False)["input_ids"])
    want = reference_ids(fields, text)
    what = (f"the tokenizer written from {Path(gguf_path).name} "
            f"({'SentencePiece' if spm_vocab else 'BPE with merges'} vocabulary)")
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                  min(len(got), len(want)))
        raise TokenizerMismatch(
            f"{what} does not tokenize as the GGUF does: at token {at} it gives "
            f"{_piece(fields, got, at)}, the GGUF's vocabulary {_piece(fields, want, at)}; "
            "nothing was written (report the GGUF's tokenizer.ggml.model and pre-tokenizer)")
    if not spm_vocab:
        ids = written(SAMPLE, add_special_tokens=False)["input_ids"]
        back = written.decode(ids)
        if back != SAMPLE:
            raise TokenizerMismatch(f"{what} does not decode the sample back to itself (got "
                                    f"{back[:60]!r}...); nothing was written")
