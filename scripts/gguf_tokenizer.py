"""Show a converted Gemma-family tokenizer's ids on the check's sample beside the
reference's (the sentencepiece library on the GGUF's own pieces, scores and types) and
beside what transformers' GGUF loader alone builds.

The vocabulary is a Gemma-style SentencePiece BPE (no leading space, byte fallback)
trained here on the calibration text, written as a ``gemma3`` GGUF with the gguf package
(no hub access needed)::

    .venv/bin/python scripts/gguf_tokenizer.py [--out gguf-tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from transformers import AutoTokenizer  # noqa: E402

from fp4sense.inputs.gguf import special_tokens  # noqa: E402
from fp4sense.inputs.gguf_tokenizer import (  # noqa: E402
    SAMPLE,
    _fields,
    check_tokenizer,
    gguf_tokenizer,
    reference_ids,
)
from gguf_files import vocabularies_in, write_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the ids as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vocab = vocabularies_in(tmp)[False]
        path = write_gguf(tmp / "gemma.gguf", "gemma", vocab)
        loaded = AutoTokenizer.from_pretrained(str(tmp), gguf_file=path.name)
        tokenizer = gguf_tokenizer(path, loaded)
        special_tokens(tokenizer, path)
        tokenizer.save_pretrained(tmp / "tok")
        check_tokenizer(tmp / "tok", path)
        written = AutoTokenizer.from_pretrained(tmp / "tok")
        rows = {
            "written": written(SAMPLE, add_special_tokens=False)["input_ids"],
            "reference": reference_ids(_fields(path), SAMPLE),
            "transformers_loader": loaded(SAMPLE, add_special_tokens=False)["input_ids"],
        }
        pieces = {k: written.convert_ids_to_tokens(v) if k != "transformers_loader"
                  else loaded.convert_ids_to_tokens(v) for k, v in rows.items()}
    print(f"sample: {SAMPLE!r}\n")
    for key, ids in rows.items():
        print(f"{key:20s} {len(ids):4d} tokens, {len(SAMPLE) / len(ids):.2f} characters per "
              "token")
        print(f"{'':20s} ids    {ids[:24]} ...")
        print(f"{'':20s} pieces {pieces[key][:16]} ...")
    same = rows["written"] == rows["reference"]
    print(f"\nwritten == reference: {same}; transformers' loader alone == reference: "
          f"{rows['transformers_loader'] == rows['reference']}")
    if args.out:
        args.out.write_text(json.dumps({"sample": SAMPLE, "ids": rows, "pieces": pieces,
                                        "written_equals_reference": same}, indent=1,
                                       ensure_ascii=False))


if __name__ == "__main__":
    main()
