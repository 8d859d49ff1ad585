"""convert-gguf writes a tokenizer that tokenizes as the GGUF does: GGUF files built here
with the gguf package (SentencePiece vocabularies of Llama, Mistral and Gemma, trained with
the sentencepiece library; a byte-level BPE with merges as Qwen's), checked against the
sentencepiece library and the GGUF's own merges; a broken tokenizer is named before the
work starts; a converted SentencePiece-vocabulary model quantizes and passes verify-vllm."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FP4SENSE, SMALL
from gguf_files import FAMILIES, VOCAB, training_lines, vocabularies_in, write_gguf


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory) -> dict:
    return vocabularies_in(tmp_path_factory.mktemp("vocab"))


def _convert_tokenizer(gguf_path: Path, out: Path):
    """The tokenizer convert-gguf writes for ``gguf_path``, saved in ``out`` and checked."""
    from transformers import AutoTokenizer

    from fp4sense.inputs.gguf import special_tokens
    from fp4sense.inputs.gguf_tokenizer import check_tokenizer, gguf_tokenizer

    loaded = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = gguf_tokenizer(gguf_path, loaded)
    special_tokens(tokenizer, gguf_path)
    tokenizer.save_pretrained(out)
    check_tokenizer(out, gguf_path)
    return AutoTokenizer.from_pretrained(out), loaded


def _vocab_of(family: str, vocabularies: dict) -> dict:
    return vocabularies["gpt2" if FAMILIES[family][1] == "gpt2" else FAMILIES[family][2]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_written_tokenizer_tokenizes_as_the_gguf(family, vocabularies, tmp_path):
    """Each family's vocabulary: the written tokenizer gives the reference's ids on the
    multi-script sample (SentencePiece vocabularies: the sentencepiece library on the
    trained model itself, not only on the model rebuilt from the GGUF), keeps the vocabulary
    size and adds BOS as the GGUF says."""
    import sentencepiece as spm

    from fp4sense.inputs.gguf_tokenizer import SAMPLE

    vocab = _vocab_of(family, vocabularies)
    path = write_gguf(tmp_path / f"{family}.gguf", family, vocab)
    written, _ = _convert_tokenizer(path, tmp_path / "tok")
    assert written.vocab_size == len(vocab["tokens"])
    ids = written(SAMPLE)["input_ids"]
    if "model" in vocab:  # SentencePiece: the trained model is the ground truth
        assert len(written) == len(vocab["tokens"])  # nothing added
        plain = spm.SentencePieceProcessor(model_file=vocab["model"]).encode(SAMPLE)
        assert ids == [2, *plain]  # BOS first, as add_bos_token says
        assert written.convert_ids_to_tokens(written("The capital")["input_ids"])[1:] == (
            ["▁The", "▁capital"] if FAMILIES[family][2] else ["The", "▁capital"])
    else:
        assert written.decode(ids) == SAMPLE and ids[0] != 0


def test_the_transformers_loader_alone_splits_gemma_words(vocabularies, tmp_path):
    """The bug: transformers' GGUF loader builds a Unigram model from Gemma's scores and
    splits words into characters; the check names that tokenizer and the first piece, and
    the written tokenizer does not."""
    from fp4sense.inputs.gguf_tokenizer import TokenizerMismatch, check_tokenizer

    path = write_gguf(tmp_path / "gemma.gguf", "gemma", vocabularies[False])
    written, loaded = _convert_tokenizer(path, tmp_path / "tok")
    loaded.save_pretrained(tmp_path / "as-loaded")
    with pytest.raises(TokenizerMismatch, match=r"gemma\.gguf.*SentencePiece.*at token \d+"):
        check_tokenizer(tmp_path / "as-loaded", path)
    words = "The capital of France is"
    assert len(loaded(words, add_special_tokens=False)["input_ids"]) > \
        len(written(words, add_special_tokens=False)["input_ids"])


def test_a_broken_tokenizer_is_named_before_the_work(vocabularies, tmp_path, tiny_llama,
                                                     text_file):
    """analyze, quantize and eval measure characters per token first: a tokenizer that
    gives about one per character is one warning line naming its folder."""
    from fp4sense.inputs.texts import tokenizer_warning

    path = write_gguf(tmp_path / "gemma.gguf", "gemma", vocabularies[False])
    written, loaded = _convert_tokenizer(path, tmp_path / "tok")
    loaded.save_pretrained(tmp_path / "broken")
    text = text_file.read_text()
    from transformers import AutoTokenizer

    broken = AutoTokenizer.from_pretrained(tmp_path / "broken")
    assert tokenizer_warning(written, text, len(written(text)["input_ids"])) is None
    line = tokenizer_warning(broken, text, len(broken(text)["input_ids"]))
    assert line.startswith("warning:") and str(tmp_path / "broken") in line
    cjk = "東京は日本の首都です。" * 50  # a token a character is normal here
    assert tokenizer_warning(broken, cjk, len(cjk)) is None
    # through the command: the model's own folder with the broken tokenizer in it
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    for f in model.glob("tokenizer*"):
        f.unlink()
    for f in (tmp_path / "broken").iterdir():
        shutil.copy(f, model)
    proc = subprocess.run([FP4SENSE, "analyze", str(model), "--text", str(text_file),
                           "--analysis-windows", "1", "--tokens", "32", "--no-cache", "--no-plots",
                           "--schemes", "NVFP4", "--views", "component",
                           "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [ln for ln in proc.stdout.splitlines() if "characters per token" in ln]
    assert len(warned) == 1 and str(model) in warned[0]
    before_work = proc.stdout.index(warned[0]) < proc.stdout.index("sensitivity ")
    assert before_work


@pytest.mark.slow
def test_a_converted_sentencepiece_model_quantizes_and_serves(vocabularies, tmp_path,
                                                              serve_python):
    """End to end: a tiny Llama with a SentencePiece vocabulary, written as a GGUF,
    converted, quantized and verified in vLLM."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True)
    gguf_path = write_gguf(tmp_path / "tiny-sp.gguf", "llama", vocabularies[True],
                           LlamaForCausalLM(config))
    hf = tmp_path / "tiny-sp"
    proc = subprocess.run([FP4SENSE, "convert-gguf", str(gguf_path), "--out", str(hf)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.convert_ids_to_tokens(tok("The capital")["input_ids"]) == \
        ["<s>", "▁The", "▁capital"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(training_lines()[:400]))
    out = tmp_path / "q"
    proc = subprocess.run([FP4SENSE, "quantize", str(hf), "--budget", "5", "--text", str(text),
                           *SMALL, "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "characters per token" not in proc.stdout
    proc = subprocess.run([FP4SENSE, "verify-vllm", str(out), "--text", str(text),
                           "--serve-python", str(serve_python), "--tokens", "64"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-2000:] + \
        proc.stderr[-2000:]
