"""Hub-ready output: the model card `fp4sense quantize` writes, and `fp4sense push`.

The Hub is not reachable from CI: the tests cover every check, the dry run, and the
one-line failures without a token or without a network; the upload itself is
huggingface_hub's own `create_commit`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from conftest import FP4SENSE
from fp4sense.hub import PushError, check_folder, validate_model_card
from fp4sense.planner import Plan
from fp4sense.report import write_model_card


def _push(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([FP4SENSE, "push", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- the model card ---------------------------------------------------------------------
@pytest.mark.slow
def test_quantize_card_loads_and_validates(quantized, tiny_llama):
    card = ModelCard.load(quantized / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers"
    assert {"fp4", "nvfp4", "compressed-tensors", "llmcompressor", "vllm"} <= set(meta["tags"])
    assert "![plan](plan.png)" in card.text and (quantized / "plan.png").is_file()
    assert "vllm serve" in card.text and "## Measured" in card.text
    assert "windows × 64 tokens of the protocol's evaluation split" in card.text
    # a local base model is named by its folder, never by a path on this machine
    assert str(tiny_llama) not in card.text and "# tiny-llama, FP4" in card.text
    assert validate_model_card(quantized / "README.md") == []


@pytest.mark.slow
def test_card_carries_base_model_and_license(quantized, assets, tmp_path):
    plan = Plan.load(quantized / "plan.json")
    # the bundled model: its folder records the hub id; the license is the base model's
    bundled = write_model_card(_copy(quantized, tmp_path / "a"), plan, None,
                               source=str(assets["model"]), notes=[])
    meta = ModelCard.load(bundled).data.to_dict()
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0"
    assert validate_model_card(bundled) == []
    # a local base model with its own card: an "other" license travels with name and link
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"_name_or_path": "acme/base-7b"}))
    (base / "README.md").write_text("---\nlicense: other\nlicense_name: acme-license\n"
                                    "license_link: https://acme.example/license\n---\n# base\n")
    card = write_model_card(_copy(quantized, tmp_path / "b"), plan, None, source=str(base),
                            notes=[])
    meta = ModelCard.load(card).data.to_dict()
    assert (meta["base_model"], meta["license"], meta["license_name"], meta["license_link"]) \
        == ("acme/base-7b", "other", "acme-license", "https://acme.example/license")
    assert validate_model_card(card) == []


def test_card_problems_are_named(tmp_path):
    (tmp_path / "README.md").write_text(
        "---\nlicense: apache-3.0\nbase_model: not a hub id\nbase_model_relation: quantised\n"
        "tags: [fp4]\n---\n# x\n![plan](plan.png)\n")
    problems = "\n".join(validate_model_card(tmp_path / "README.md"))
    for culprit in ("license 'apache-3.0'", "base_model 'not a hub id'",
                    "base_model_relation 'quantised'", "links image plan.png"):
        assert culprit in problems, problems
    (tmp_path / "README.md").write_text("# no metadata\n")
    assert "no YAML metadata block" in validate_model_card(tmp_path / "README.md")[0]
    (tmp_path / "README.md").write_text("---\nlicense: other\n---\n# x\n")
    assert "license_name and license_link" in validate_model_card(tmp_path / "README.md")[0]
    (tmp_path / "README.md").write_text("---\n- a list, not a mapping\n---\n# x\n")
    assert "does not load with huggingface_hub" in validate_model_card(tmp_path / "README.md")[0]


# --- push: checks and dry run -----------------------------------------------------------
@pytest.mark.slow
def test_dry_run_lists_exactly_the_upload_and_touches_nothing(quantized, tiny_llama):
    before = _snapshot(quantized)
    proc = _push(quantized, "--repo-id", "acme/tiny-fp4", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["dry_run"] and "url" not in result
    assert result["quantization_format"] == "mixed-precision"
    listed = {f["path"]: f["size"] for f in result["files"]}
    assert listed == {k: len(v) for k, v in before.items()}
    assert {"config.json", "model.safetensors", "README.md", "plan.png", "plan.json",
            "recipe.yaml", "sensitivity.json", "tokenizer.json"} <= set(listed)
    assert result["bytes"] == sum(listed.values())
    # provenance files that name this machine's paths are pointed out, not refused
    assert any(n.startswith("plan.json records") and str(tiny_llama) in n
               for n in result["notes"]), result["notes"]
    assert not any(n.startswith("tokenizer") for n in result["notes"])
    # the uploaded card names the repo in its vllm command; the local file is untouched
    assert result["card_rewritten"]
    assert _snapshot(quantized) == before
    text = _push(quantized, "--repo-id", "acme/tiny-fp4", "--dry-run")
    assert text.returncode == 0 and "nothing was uploaded" in text.stdout
    assert "model.safetensors" in text.stdout and "vllm serve names the repo" in text.stdout


def test_card_for_repo_names_the_repo():
    from fp4sense.hub import card_for_repo

    card = "# x\n\n```bash\nvllm serve tiny-mixed\n```\n"
    assert card_for_repo(card, "acme/tiny-fp4") == "# x\n\n```bash\nvllm serve acme/tiny-fp4\n```\n"


@pytest.mark.slow
def test_hidden_files_are_not_uploaded(quantized, tmp_path):
    folder = _copy(quantized, tmp_path / "ck")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x.lock").write_text("")
    (folder / ".DS_Store").write_text("")
    paths = {f.path for f in check_folder(folder).files}
    assert not any(p.startswith(".") for p in paths) and "config.json" in paths


@pytest.mark.slow
def test_every_problem_is_named_in_one_error(quantized, tmp_path):
    folder = _copy(quantized, tmp_path / "ck")
    (folder / "tokenizer.json").unlink()
    (folder / "plan.png").unlink()
    (folder / "model-00009-of-00009.safetensors").write_bytes(b"")
    # shard the weights into an index that names a file that is not there
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as fh:
        keys = list(fh.keys())
    weight_map = {k: "model.safetensors" for k in keys}
    weight_map[keys[0]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(PushError) as err:
        check_folder(folder)
    msg = str(err.value)
    assert msg.count("\n  - ") == 4, msg
    for culprit in ("model-00002-of-00002.safetensors listed in the index is missing",
                    "model-00009-of-00009.safetensors: weight file not in",
                    "no tokenizer", "links image plan.png", "nothing was uploaded"):
        assert culprit in msg, msg


@pytest.mark.slow
def test_plain_model_and_missing_card_are_refused(tiny_llama, quantized, tmp_path):
    proc = _push(tiny_llama, "--repo-id", "acme/x", "--dry-run")
    assert proc.returncode == 1
    assert "no compressed-tensors quantization_config" in proc.stderr
    assert "no model card" in proc.stderr
    assert "Traceback" not in proc.stderr
    folder = _copy(quantized, tmp_path / "ck")
    (folder / "README.md").unlink()
    proc = _push(folder, "--repo-id", "acme/x", "--dry-run")
    assert proc.returncode == 1 and "no model card" in proc.stderr


def test_missing_folder_and_bad_repo_id(tmp_path):
    proc = _push(tmp_path / "nope", "--repo-id", "acme/x", "--dry-run")
    assert proc.returncode == 1 and "no such folder" in proc.stderr
    proc = _push(tmp_path, "--repo-id", "a/b/c", "--dry-run")
    assert proc.returncode == 1 and "'a/b/c' is not a valid Hub repo id" in proc.stderr


# --- push: no token, no network ----------------------------------------------------------
def _hub_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # no stored token there
    env.update(extra)
    return env


@pytest.mark.slow
def test_no_token_is_one_clear_error(quantized, tmp_path):
    before = _snapshot(quantized)
    proc = _push(quantized, "--repo-id", "acme/tiny-fp4", env=_hub_env(tmp_path))
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Hugging Face token" in lines[0]
    assert "nothing was uploaded" in lines[0]
    assert _snapshot(quantized) == before


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"HF_ENDPOINT": "http://127.0.0.1:9"},
                                   {"HF_HUB_OFFLINE": "1"}], ids=["unreachable", "offline"])
def test_no_network_is_one_clear_error(quantized, tmp_path, extra):
    env = _hub_env(tmp_path, HF_TOKEN="hf_" + "x" * 34, **extra)
    proc = _push(quantized, "--repo-id", "acme/tiny-fp4", env=env)
    assert proc.returncode == 5, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "cannot reach the Hugging Face Hub" in lines[0] and "nothing was uploaded" in lines[0]
