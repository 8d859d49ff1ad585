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
from fp4sense.planning.milp import Plan
from fp4sense.publishing.hub import PushError, check_folder, validate_model_card
from fp4sense.reports.model_card import write_model_card


def _push(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([FP4SENSE, "push", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _snapshot(folder: Path, hidden: bool = True) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file() and (hidden or not p.name.startswith("."))}


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
    assert listed == {k: len(v) for k, v in _snapshot(quantized, hidden=False).items()}
    assert {"config.json", "model.safetensors", "README.md", "plan.png", "plan.json",
            "recipe.yaml", "sensitivity.json", "tokenizer.json"} <= set(listed)
    assert result["bytes"] == sum(listed.values())
    # a local base without --base-model-id: the card cannot link it, and push says so
    assert result["notes"] == [n for n in result["notes"] if "--base-model-id" in n] != []
    # the uploaded card names the repo in its vllm command; the local file is untouched
    assert result["card_rewritten"]
    assert _snapshot(quantized) == before
    text = _push(quantized, "--repo-id", "acme/tiny-fp4", "--dry-run")
    assert text.returncode == 0 and "nothing was uploaded" in text.stdout
    assert "model.safetensors" in text.stdout and "vllm serve names the repo" in text.stdout


def test_card_for_repo_names_the_repo():
    from fp4sense.publishing.hub import card_for_repo

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


# --- lineage and local paths ------------------------------------------------------------
def _absolute_paths(value) -> list[str]:
    if isinstance(value, dict):
        return [p for v in value.values() for p in _absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _absolute_paths(v)]
    return [value] if isinstance(value, str) and os.path.isabs(value) else []


@pytest.mark.slow
def test_checkpoint_files_record_no_paths_of_this_machine(quantized, tiny_llama, text_file):
    uploaded = {f.path for f in check_folder(quantized).files}
    for name in uploaded:
        if name.endswith(".json") and not name.startswith("tokenizer"):  # merges hold "/"
            assert _absolute_paths(json.loads((quantized / name).read_text())) == [], name
        if name.endswith((".json", ".yaml", ".md")):
            text = (quantized / name).read_text()
            for local in (tiny_llama, text_file, quantized):
                assert str(local) not in text, (name, local)
    # names and fingerprints stay: the base by its folder's name, the text by its file's
    plan = json.loads((quantized / "plan.json").read_text())
    report = json.loads((quantized / "sensitivity.json").read_text())
    assert plan["model"] == report["model"] == "tiny-llama"
    assert plan["model_fingerprint"] == report["model_fingerprint"]
    assert report["text"]["source"] == "text.txt" and report["text"]["cache_key"]
    # this machine keeps the paths outside the folder (the fp4sense cache): no hidden file
    from fp4sense.structure.lineage import local_record

    assert local_record(quantized)["base"] == str(tiny_llama.resolve())
    assert not [p for p in quantized.rglob(".*")], "a hidden file would travel with hf upload"


@pytest.mark.slow
def test_base_model_id_gives_the_card_its_lineage(tiny_llama, text_file, tmp_path):
    from conftest import SMALL

    out = tmp_path / "linked"
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5", "--out",
                           str(out), "--text", str(text_file), *SMALL, "--no-eval",
                           "--base-model-id", "acme/tiny-base"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = ModelCard.load(out / "README.md").data.to_dict()
    assert (meta["base_model"], meta["base_model_relation"]) == ("acme/tiny-base", "quantized")
    assert json.loads((out / "plan.json").read_text())["model"] == "acme/tiny-base"
    assert validate_model_card(out / "README.md") == []
    ready = check_folder(out)
    assert not any("--base-model-id" in n for n in ready.notes)


def test_malformed_base_model_id_is_refused_before_any_work(tiny_llama, tmp_path):
    proc = subprocess.run([FP4SENSE, "quantize", str(tiny_llama), "--budget", "5", "--out",
                           str(tmp_path / "q"), "--base-model-id", "not an id"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "--base-model-id 'not an id'" in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_card_without_a_known_base_says_how_to_link_it(quantized):
    card = ModelCard.load(quantized / "README.md")
    assert "base_model" not in card.data.to_dict()
    assert "--base-model-id ORG/NAME" in card.text


def test_base_inside_the_hub_cache_is_named_by_its_hub_id(tiny_llama, tmp_path):
    from fp4sense.structure.lineage import hub_id_of, public_name

    snapshot = tmp_path / "hub" / "models--acme--tiny-7b" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama, snapshot)
    assert hub_id_of(snapshot) == "acme/tiny-7b"
    assert public_name(snapshot) == "acme/tiny-7b"
    # outside that layout, a plain folder has no hub id: named by its folder only
    assert hub_id_of(tiny_llama) is None and public_name(tiny_llama) == "tiny-llama"
    assert hub_id_of(tiny_llama, "acme/given") == "acme/given"
    assert public_name("dataset:wikitext:wikitext-2-raw-v1") == \
        "dataset:wikitext:wikitext-2-raw-v1"


@pytest.mark.slow
def test_card_of_a_base_in_the_hub_cache_links_it(quantized, tiny_llama, tmp_path):
    snapshot = tmp_path / "hub" / "models--acme--tiny-7b" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama, snapshot)
    card = write_model_card(_copy(quantized, tmp_path / "c"), Plan.load(
        quantized / "plan.json"), None, source=str(snapshot), notes=[])
    meta = ModelCard.load(card).data.to_dict()
    assert (meta["base_model"], meta["base_model_relation"]) == ("acme/tiny-7b", "quantized")


@pytest.mark.slow
def test_push_refuses_a_folder_that_records_local_paths(quantized, tiny_llama, tmp_path):
    """A checkpoint of fp4sense 0.3 (plan.json records the base's absolute path)."""
    folder = _copy(quantized, tmp_path / "old")
    plan = json.loads((folder / "plan.json").read_text())
    plan["model"] = str(tiny_llama)
    (folder / "plan.json").write_text(json.dumps(plan))
    before = _snapshot(folder)
    proc = _push(folder, "--repo-id", "acme/tiny-fp4", "--dry-run")
    assert proc.returncode == 1, proc.stdout
    assert "plan.json records 1 path(s) of this machine" in proc.stderr
    assert "--allow-local-paths" in proc.stderr and "Traceback" not in proc.stderr
    allowed = _push(folder, "--repo-id", "acme/tiny-fp4", "--dry-run", "--allow-local-paths",
                    "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert any(str(tiny_llama) in n for n in json.loads(allowed.stdout)["notes"])
    assert _snapshot(folder) == before
