"""Trust, round three: a hostile or careless user's inputs. Each case gives a correct
result, or exits non-zero with one line naming the culprit, loses nothing and runs no
code from the files it reads. The cases and their verdicts are listed in
docs/reliability.md (`pytest tests/cli/test_adversarial.py --collect-only -q`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FP4SENSE, SMALL, make_tiny_llama
from helpers import one_line


def _run(*args, cwd=None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([FP4SENSE, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=None if env is None else {**os.environ, **env},
                          timeout=600)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture
def gguf_dir(tmp_path) -> Path:
    """A folder holding a user's GGUF and another file of theirs."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(b"GGUF" + bytes(64))
    (folder / "notes.txt").write_text("mine")
    return folder


# --- data loss: --out never an input, --overwrite only of fp4sense's folders -------------
def test_convert_gguf_into_the_folder_holding_the_gguf(gguf_dir):
    before = _snapshot(gguf_dir)
    proc = _run("convert-gguf", gguf_dir / "model.gguf", "--out", gguf_dir, "--overwrite")
    one_line(proc, 1, f"--out {gguf_dir}", "model.gguf")
    assert _snapshot(gguf_dir) == before


def test_convert_gguf_into_the_current_folder(gguf_dir):
    before = _snapshot(gguf_dir)
    proc = _run("convert-gguf", "model.gguf", "--out", ".", "--overwrite", cwd=gguf_dir)
    one_line(proc, 1, "--out .", "current folder")
    assert _snapshot(gguf_dir) == before


def test_convert_gguf_into_a_parent_of_the_gguf(gguf_dir):
    before = _snapshot(gguf_dir.parent)
    proc = _run("convert-gguf", gguf_dir / "model.gguf", "--out", gguf_dir.parent,
                "--overwrite")
    one_line(proc, 1, "the input")
    assert _snapshot(gguf_dir.parent) == before


def test_convert_gguf_overwrite_of_a_users_folder(gguf_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    proc = _run("convert-gguf", gguf_dir / "model.gguf", "--out", mine, "--overwrite")
    one_line(proc, 1, "thesis.tex", "did not write")
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_quantize_overwrite_of_a_folder_holding_the_text(tiny_llama, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    text = folder / "calib.txt"
    text.write_text("the union " * 2000)
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", folder, "--overwrite",
                "--text", text, *SMALL)
    one_line(proc, 1, "the input", str(text))
    assert text.read_text() == "the union " * 2000


def test_analyze_into_the_model_folder(tiny_llama, text_file):
    before = _snapshot(tiny_llama)
    proc = _run("analyze", tiny_llama, "--text", text_file, "--out", tiny_llama)
    one_line(proc, 1, "the input")
    assert _snapshot(tiny_llama) == before


def test_analyze_into_a_users_folder(tiny_llama, text_file, tmp_path):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "report.md").write_text("my own report")
    proc = _run("analyze", tiny_llama, "--text", text_file, "--out", mine)
    one_line(proc, 1, "report.md", "did not write")
    assert (mine / "report.md").read_text() == "my own report"


def test_out_a_symlink_is_refused_and_the_link_kept(tiny_llama, text_file, tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", link, "--overwrite",
                "--text", text_file, *SMALL)
    one_line(proc, 1, "symbolic link", str(target))
    assert link.is_symlink() and (target / "keep.txt").read_text() == "x"


def test_overwrite_replaces_a_folder_fp4sense_wrote_and_nothing_added(tmp_path, monkeypatch):
    """The ledger: a published folder may be replaced; once a user adds a file to it, the
    file is named and nothing is replaced."""
    from fp4sense.runtime.outputs import guard_output, publish_folder, work_folder
    from fp4sense.validate import InputError

    monkeypatch.setenv("FP4SENSE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ck"
    work = work_folder(out, print)
    (work / "config.json").write_text("{}")
    publish_folder(work, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # no owner mark
    guard_output(out, overwrite=True)  # fp4sense's own folder: may be replaced
    (out / "todo.txt").write_text("mine")
    with pytest.raises(InputError, match="todo.txt"):
        guard_output(out, overwrite=True)


def test_a_folder_of_an_older_fp4sense_may_be_replaced_unless_it_holds_more(
        tmp_path, monkeypatch):
    from fp4sense.runtime.outputs import guard_output
    from fp4sense.validate import InputError

    monkeypatch.setenv("FP4SENSE_CACHE", str(tmp_path / "cache"))  # no ledger entry
    out = tmp_path / "old"
    out.mkdir()
    for name in ("plan.json", "config.json", "model.safetensors", "README.md", "plan.png"):
        (out / name).write_text("")
    guard_output(out, overwrite=True)
    (out / "id_rsa").write_text("key")
    with pytest.raises(InputError, match="id_rsa"):
        guard_output(out, overwrite=True)
    plain = tmp_path / "hf-model"  # a model folder fp4sense did not write
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    with pytest.raises(InputError, match="did not write"):
        guard_output(plain, overwrite=True)


def test_two_conversions_to_one_out(gguf_dir, tmp_path):
    """The second of two conversions to one --out stops at once (the first holds the
    lock), so the first result is never silently replaced."""
    out = tmp_path / "hf"
    code = ("import sys, time; from pathlib import Path; "
            "from fp4sense.runtime.outputs import claim_output; "
            f"claim_output(Path({str(out)!r})); print('claimed', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        proc = _run("convert-gguf", gguf_dir / "model.gguf", "--out", out)
        one_line(proc, 1, "being written by another fp4sense run", f"pid {holder.pid}")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_runs_partial_folder_is_removed_or_named(tmp_path):
    from fp4sense.runtime.outputs import work_folder

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / ".hf.partial-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1024))
    (stale / ".fp4sense-owner").write_text(f"{socket.gethostname()} {dead}\n")
    unknown = tmp_path / ".hf.partial-old"
    unknown.mkdir()
    said = []
    work = work_folder(tmp_path / "hf", said.append)
    assert not stale.exists() and work.exists() and unknown.exists()
    assert any("removed" in s and dead in s for s in said)
    assert any(str(unknown) in s and "remove it by hand" in s for s in said)


# --- leaks: push sends only what a checkpoint holds --------------------------------------
@pytest.fixture
def checkpoint(quantized, tmp_path) -> Path:
    return Path(shutil.copytree(quantized, tmp_path / "ck"))


def _push_refused(folder: Path, *culprits: str) -> str:
    proc = _run("push", folder, "--repo-id", "acme/x", "--dry-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "nothing was uploaded" in proc.stderr
    problems = [ln for ln in proc.stderr.splitlines() if ln.strip().startswith("- ")]
    for culprit in culprits:
        assert any(culprit in p for p in problems), (culprit, proc.stderr)
    return proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name, content", [
    ("id_rsa", "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n"),
    ("token", "hf_" + "a" * 34),
    ("credentials.json", json.dumps({"token": "hf_" + "b" * 34})),
    ("notes.txt", "nothing secret"),
], ids=["private-key", "token-file", "credentials", "stray-file"])
def test_push_refuses_a_file_a_checkpoint_does_not_hold(checkpoint, name, content):
    (checkpoint / name).write_text(content)
    _push_refused(checkpoint, name)


@pytest.mark.slow
def test_push_refuses_a_token_inside_the_model_card(checkpoint):
    card = checkpoint / "README.md"
    card.write_text(card.read_text() + "\nlogin with hf_" + "c" * 34 + "\n")
    _push_refused(checkpoint, "README.md", "Hugging Face token")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_push_refuses_a_link_out_of_the_folder(checkpoint, tmp_path, kind):
    secret = tmp_path / "outside"
    if kind == "file":
        secret.write_text("private")
        (checkpoint / "extra.json").symlink_to(secret)
        culprit = "extra.json"
    else:
        secret.mkdir()
        (secret / "a.txt").write_text("private")
        (checkpoint / "more").symlink_to(secret, target_is_directory=True)
        culprit = "more"
    _push_refused(checkpoint, culprit, "outside the folder")


@pytest.mark.slow
def test_push_refuses_a_plan_that_is_not_json(checkpoint):
    plan = checkpoint / "plan.json"
    plan.write_text(plan.read_text()[:200])
    _push_refused(checkpoint, "plan.json", "cannot be read")


@pytest.mark.slow
def test_push_refuses_a_plan_that_contradicts_the_tensors(checkpoint):
    plan = json.loads((checkpoint / "plan.json").read_text())
    flip = {"BF16": "NVFP4"}
    for c in plan["choices"]:
        c["scheme"] = flip.get(c["scheme"], "BF16")
    (checkpoint / "plan.json").write_text(json.dumps(plan))
    _push_refused(checkpoint, "plan.json", "stored")


@pytest.mark.slow
def test_push_refuses_a_recipe_with_a_python_tag_and_runs_nothing(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    (checkpoint / "recipe.yaml").write_text(
        f"stage: !!python/object/apply:os.makedirs [{str(marker)!r}]\n")
    _push_refused(checkpoint, "recipe.yaml", "safe YAML")
    assert not marker.exists()


@pytest.mark.slow
def test_push_refuses_a_recipe_that_is_not_a_recipe(checkpoint):
    (checkpoint / "recipe.yaml").write_text("- just\n- a list\n")
    _push_refused(checkpoint, "recipe.yaml", "not an llm-compressor recipe")


@pytest.mark.slow
def test_push_of_an_untouched_checkpoint_passes(checkpoint):
    proc = _run("push", checkpoint, "--repo-id", "acme/x", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- tracebacks and wrong successes: one line instead --------------------------------------
@pytest.mark.parametrize("args, flag", [
    (["verify-vllm", "ckpt", "--timeout", "3000000"], "--timeout"),
    (["verify-vllm", "ckpt", "--timeout", "1e30"], "--timeout"),
    (["analyze", "--tokens", "1"], "--tokens"),
    (["eval", "ckpt", "--tokens", "1"], "--tokens"),
    (["quantize", "--budget", "5", "--out", "q", "--select-plans", "1000"], "--select-plans"),
    (["quantize", "--budget", "5", "--out", "q", "--select-plans", "99999999999999"],
     "--select-plans"),
], ids=["timeout-huge", "timeout-1e30", "analyze-tokens-1", "eval-tokens-1",
        "select-plans-1000", "select-plans-huge"])
def test_senseless_numbers_are_usage_errors(args, flag, tmp_path):
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"argument {flag}" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keyword, value", [("window_tokens", 1), ("select_plans", 1000)])
def test_the_python_api_bounds_the_same_numbers(keyword, value, tmp_path):
    from fp4sense.api import quantize_model
    from fp4sense.validate import InputError

    with pytest.raises(InputError, match=keyword):
        quantize_model(None, budget_bits=5, out_dir=tmp_path / "q", **{keyword: value})


def test_tokens_beyond_the_models_context(tiny_llama, text_file):
    proc = _run("analyze", tiny_llama, "--text", text_file, "--tokens", "4096",
                "--analysis-windows", "1", "--no-cache", "--out", tiny_llama.parent / "never")
    one_line(proc, 1, "--tokens 4096", "context of 1024")
    assert not (tiny_llama.parent / "never").exists()


def test_an_inf_weight_with_low_memory_isone_line(tmp_path, text_file, tiny_llama):
    from safetensors.torch import load_file, save_file

    model = make_tiny_llama(tmp_path / "inf")
    shutil.copy(tiny_llama / "tokenizer.json", model)
    shutil.copy(tiny_llama / "tokenizer_config.json", model)
    state = load_file(model / "model.safetensors")
    state["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    proc = _run("analyze", model, "--text", text_file, "--low-memory", "--mode", "estimated",
                "--views", "grid", "--schemes", "NVFP4", "--analysis-windows", "1", "--tokens",
                "32", "--no-cache", "--no-plots", "--out", tmp_path / "a")
    one_line(proc, 1, "model.layers.1.mlp.down_proj", "NaN/Inf")


def test_a_damaged_cache_entry_is_named_and_computed_again(tiny_llama, text_file, tmp_path):
    env = {"FP4SENSE_CACHE": str(tmp_path / "cache")}
    args = ("analyze", tiny_llama, "--text", text_file, "--analysis-windows", "1", "--tokens", "32",
            "--schemes", "NVFP4", "--views", "component", "--no-plots", "--json")
    first = _run(*args, "--out", tmp_path / "a1", env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    [path] = (tmp_path / "cache" / "analysis").glob("*.jsonl")
    items = [json.loads(ln) for ln in path.read_text().splitlines()]
    next(d for d in items if d["key"].startswith("measured|")).pop("kl")
    path.write_text("".join(json.dumps(d) + "\n" for d in items))
    again = _run(*args, "--out", tmp_path / "a2", env=env)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-2000:]
    notes = [ln for ln in again.stderr.splitlines() if "damaged entry" in ln]
    assert len(notes) == 1 and str(path) in notes[0] and "'kl'" in notes[0]
    a1 = json.loads((tmp_path / "a1" / "sensitivity.json").read_text())["entries"]
    a2 = json.loads((tmp_path / "a2" / "sensitivity.json").read_text())["entries"]
    assert a1 == a2  # computed again, to the same figures
    third = _run(*args, "--out", tmp_path / "a3", env=env)  # the new entry is read
    assert third.returncode == 0 and "damaged entry" not in third.stderr


@pytest.mark.slow
def test_eval_of_a_truncated_plan_names_it(checkpoint, text_file):
    plan = checkpoint / "plan.json"
    plan.write_text(plan.read_text()[:100])
    proc = _run("eval", checkpoint, "--text", text_file, "--eval-windows", "1", "--tokens", "32")
    one_line(proc, 1, str(plan), "cannot be read")


@pytest.mark.parametrize("content", ["[1, 2]", '{"version": 4, "choices": [{"unit": 1}]}'],
                         ids=["a-list", "a-choice-cut"])
def test_a_hand_edited_plan_is_named(tmp_path, content):
    from fp4sense.planning import Plan
    from fp4sense.planning.milp import PLAN_VERSION, PlanError

    path = tmp_path / "plan.json"
    path.write_text(content.replace('"version": 4', f'"version": {PLAN_VERSION}'))
    with pytest.raises(PlanError, match=str(path)):
        Plan.load(path)


def test_a_plan_naming_an_unknown_scheme_is_named(tmp_path, quantized):
    from fp4sense.planning import Plan
    from fp4sense.planning.milp import PlanError

    record = json.loads((quantized / "plan.json").read_text())
    record["choices"][0]["scheme"] = "NVFP3"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(record))
    with pytest.raises(PlanError, match="NVFP3"):
        Plan.load(path)


# --- resources: the text read as a stream ----------------------------------------------
class _CountingTokenizer:
    """A tokenizer that records how many characters it was given."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text, **kw):
        self.chars = max(self.chars, len(text))
        return self.tok(text, **kw)


def test_a_large_text_is_read_only_as_far_as_the_windows_need(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    from fp4sense.inputs.texts import make_windows, protocol_windows

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    line = "The state of the union is strong, and its people are many.\n"
    big = tmp_path / "big.txt"
    big.write_text(line * 350_000)  # 21 MB
    counting = _CountingTokenizer(tok)
    windows = protocol_windows(counting, "calibration", 2, big, 64)
    assert counting.chars < 20_000, counting.chars  # of 21 million
    whole = make_windows(tok, line * 2000, 2, 64)
    assert torch.equal(windows, whole)


def _trained_tokenizer(kind: str, text: str):
    """A small tokenizer of each kind families use, trained here with the tokenizers
    library: byte-level BPE (GPT-2, Llama 3, Qwen), SentencePiece-style Unigram with a
    word-splitting Metaspace (Llama 2, T5), SentencePiece-style BPE over unsplit text
    (Gemma: Metaspace without splitting)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "byte-bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=
                                      pre_tokenizers.ByteLevel.alphabet())
    elif kind == "sp-unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=2000, unk_token="<unk>",
                                          special_tokens=["<unk>"])
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
        trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>"],
                                      max_token_length=16)
    tok.train_from_iterator(text.splitlines()[:4000], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["byte-bpe", "sp-unigram", "sp-bpe-unsplit"])
def test_streamed_windows_equal_the_whole_texts(kind, tmp_path):
    """The prefix read for the windows tokenizes as the whole text does, for the kinds of
    tokenizer the families use."""
    from fp4sense.inputs.texts import load_text, make_windows, protocol_windows

    text = load_text(None, "evaluation")
    tok = _trained_tokenizer(kind, text)
    path = tmp_path / "t.txt"
    path.write_text(text)
    for n, tokens in ((1, 32), (4, 128), (16, 512)):
        assert torch.equal(protocol_windows(tok, "evaluation", n, path, tokens),
                           make_windows(tok, text, n, tokens)), (n, tokens)


# --- the last round's leftovers ----------------------------------------------------------
@pytest.mark.parametrize("pin, unit", [(r".*layers\.0\.self_attn\.q_proj=BF16", "0:self_attn"),
                                       (r".*layers\.1\.mlp\.gate_proj=BF16", "1:mlp")],
                         ids=["q-alone", "gate-alone"])
def test_a_pin_on_part_of_a_fused_unit_names_the_unit(tiny_llama, text_file, tmp_path,
                                                      pin, unit):
    """A pin on q_proj alone pins the fused q/k/v whole; when that makes the budget
    infeasible, the line says so (it named only the budget before)."""
    proc = _run("quantize", tiny_llama, "--budget", "5", "--pin", pin, "--text", text_file,
                *SMALL, "--out", tmp_path / "q")
    line = one_line(proc, 1, "share one scheme", unit)
    assert "--pin" in line
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("source", ["/dev/null", "empty"])
def test_an_empty_text_is_called_empty(tiny_llama, tmp_path, source):
    path = Path(source) if source.startswith("/") else tmp_path / "empty.txt"
    if not path.exists():
        path.write_text("\n\n")
    proc = _run("analyze", tiny_llama, "--text", path, "--analysis-windows", "1", "--tokens", "32",
                "--no-cache", "--out", tmp_path / "a")
    one_line(proc, 1, str(path), "is empty")


def test_an_analysis_beside_a_users_file_never_lets_overwrite_take_it(tiny_llama, text_file,
                                                                     tmp_path):
    """analyze may write into a folder holding a file of the user's; the ledger records
    only what analyze wrote, so a later --overwrite of that folder names the user's file
    and replaces nothing."""
    env = {"FP4SENSE_CACHE": str(tmp_path / "cache")}
    shared = tmp_path / "work"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    proc = _run("analyze", tiny_llama, "--text", text_file, "--analysis-windows", "1",
                "--tokens", "32", "--schemes", "NVFP4", "--views", "component", "--no-plots",
                "--no-cache",
                "--out", shared, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (shared / "sensitivity.json").is_file()
    proc = _run("analyze", tiny_llama, "--text", text_file, "--analysis-windows", "1",
                "--tokens", "32", "--schemes", "NVFP4", "--views", "component", "--no-plots",
                "--no-cache",
                "--out", shared, env=env)  # a rerun into the folder it wrote
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = _run("quantize", tiny_llama, "--budget", "5", "--out", shared, "--overwrite",
                "--text", text_file, *SMALL, env=env)
    one_line(proc, 1, "notes.txt", "did not write")
    assert (shared / "notes.txt").read_text() == "mine"
