"""Ready a compressed-tensors checkpoint folder for the Hugging Face Hub, and push it.

``check_folder`` runs every check that can be run without the Hub and returns exactly the
files an upload would send; ``push`` runs it, then uploads those files in one commit with
``huggingface_hub`` (the token from the usual places: ``HF_TOKEN`` or ``hf auth login``).
Nothing is sent before every check has passed, and a commit is atomic: a failed upload
leaves the Hub repo as it was (a repo created for the upload is deleted again).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, get_token
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.repocard import REGEX_YAML_BLOCK
from huggingface_hub.utils import validate_repo_id

from fp4sense.checkpoint.checks import (
    TOKENIZER_CONFIG,
    VOCABULARIES,
    CheckpointError,
    check_checkpoint,
)
from fp4sense.publishing.contents import (
    local_paths,
    outside_links,
    recorded_files,
    unpublishable,
)
from fp4sense.validate import EXIT_HUB_ERROR, UserError

__all__ = ["HubError", "HubFile", "PushError", "ReadyFolder", "check_folder", "push",
           "validate_model_card"]

CARD_NAME = "README.md"
# The Hub's license identifiers (https://huggingface.co/docs/hub/repositories-licenses);
# "other" needs license_name and license_link beside it.
HUB_LICENSES = frozenset("""
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause
bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0
cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0
cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0
cdla-permissive-1.0 cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1
eupl-1.2 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc h-research
intel-research lppl-1.3c ms-pl apple-ascl apple-amlr mpl-2.0 odc-by odbl openrail++ osl-3.0
postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license
fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2 llama3.3 llama4 gemma
unknown other
""".split())
BASE_MODEL_RELATIONS = ("adapter", "merge", "quantized", "finetune")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
# what a model needs beside its weights to be served: a tokenizer config and a vocabulary
_SKIPPED_DIRS = {"__pycache__"}


class PushError(UserError, ValueError):
    """The folder is not ready for the Hub; the message lists every problem."""


class HubError(UserError, RuntimeError):
    """The Hub could not be reached, or refused the token or the upload."""

    exit_code = EXIT_HUB_ERROR


@dataclass(frozen=True)
class HubFile:
    """One file of an upload: its path in the repo and its size in bytes."""

    path: str
    size: int


@dataclass
class ReadyFolder:
    """A checked folder: the files an upload sends and the model card's metadata."""

    folder: str
    files: list[HubFile]
    quantization_format: str
    card: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes"] = self.bytes
        return d


def validate_model_card(path: str | os.PathLike) -> list[str]:
    """Problems of a model card (README.md) against the Hub's conventions; [] if none.

    The card must load with ``huggingface_hub.ModelCard.load``, carry a YAML metadata
    block, and its metadata must hold what the Hub accepts: a known license identifier
    (``other`` with ``license_name`` and ``license_link``), ``base_model`` as hub ids,
    ``base_model_relation`` from the Hub's list and only beside a ``base_model``, tags as
    strings. Images the card links relatively must exist beside it.
    """
    return _read_card(Path(path))[1]


def _read_card(path: Path) -> tuple[dict, list[str]]:
    """A model card's metadata (as huggingface_hub loads it) and its problems."""

    if not path.is_file():
        return {}, [f"{path}: no model card; write one (fp4sense quantize does) or add "
                    "README.md"]
    text = path.read_text(encoding="utf-8")
    if not REGEX_YAML_BLOCK.search(text):
        return {}, [f"{path}: no YAML metadata block (---) at the top of the model card"]
    try:
        meta = ModelCard.load(path).data.to_dict()
    except Exception as exc:  # the Hub client's own parser: any failure is the card's fault
        return {}, [f"{path}: the model card does not load with huggingface_hub ({exc})"]
    problems = []
    license_ = meta.get("license")
    if license_ is not None and license_ not in HUB_LICENSES:
        problems.append(f"{path}: license {license_!r} is not a Hub license identifier; use "
                        "one of them (e.g. apache-2.0) or 'other' with license_name and "
                        "license_link")
    if license_ == "other" and not (meta.get("license_name") and meta.get("license_link")):
        problems.append(f"{path}: license 'other' needs license_name and license_link")
    base = meta.get("base_model")
    bases = [base] if isinstance(base, str) else base
    if base is not None and not (isinstance(bases, list) and all(
            isinstance(b, str) and _HUB_ID.match(b) for b in bases)):
        problems.append(f"{path}: base_model {base!r} must be a hub id 'owner/name' (or a "
                        "list of them)")
    relation = meta.get("base_model_relation")
    if relation is not None and relation not in BASE_MODEL_RELATIONS:
        problems.append(f"{path}: base_model_relation {relation!r} must be one of "
                        f"{', '.join(BASE_MODEL_RELATIONS)}")
    if relation is not None and base is None:
        problems.append(f"{path}: base_model_relation without base_model")
    tags = meta.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str)
                                                                  for t in tags)):
        problems.append(f"{path}: tags must be a list of strings")
    for key in ("library_name", "pipeline_tag"):
        if key in meta and not isinstance(meta[key], str):
            problems.append(f"{path}: {key} must be a string")
    for link in _IMAGE_LINK.findall(text):
        if "://" not in link and not (path.parent / link).is_file():
            problems.append(f"{path}: links image {link}, which is not in the folder")
    return meta, problems


def check_folder(folder: str | os.PathLike, allow_local_paths: bool = False) -> ReadyFolder:
    """Every check an upload needs, without the Hub; the files it would send.

    Raises :class:`PushError` listing every problem found: a file that is not one a
    checkpoint holds (:data:`fp4sense.runtime.outputs.CHECKPOINT_FILES`: a private key, a
    token file, anything else), a secret inside one, a link that leaves the folder, a
    plan.json or recipe.yaml that does not load with the tools' own (safe) loaders or a
    plan that contradicts the tensors beside it, no compressed-tensors
    quantization_config, a weight file or index entry missing or truncated, a weight
    file the index does not list, no tokenizer, a model card that does not validate, a
    JSON file that records absolute paths of this machine (unless ``allow_local_paths``:
    then they are notes; checkpoints of fp4sense before 0.4 record them).
    """

    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder}: no such folder; pass a checkpoint folder written by "
                        "fp4sense quantize or llm-compressor")
    problems: list[str] = []
    fmt = ""
    try:
        qcfg = check_checkpoint(folder)
        fmt = qcfg.get("format") or ""
    except CheckpointError as exc:
        problems.append(str(exc))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        for stray in sorted(p.name for p in folder.glob("*.safetensors")):
            if stray not in listed:
                problems.append(f"{folder / stray}: weight file not in {index.name}; remove "
                                "it (vLLM and transformers would ignore or trip on it)")
    if not (folder / TOKENIZER_CONFIG).is_file() or not any(
            (folder / v).is_file() for v in VOCABULARIES):
        problems.append(f"{folder}: no tokenizer ({TOKENIZER_CONFIG} and one of "
                        f"{', '.join(VOCABULARIES)}); save it with tokenizer.save_pretrained")
    card, card_problems = _read_card(folder / CARD_NAME)
    problems += card_problems
    problems += outside_links(folder)
    files = _upload_files(folder)
    problems += unpublishable(folder, files)
    problems += recorded_files(folder)
    local = local_paths(folder, files)
    if local and not allow_local_paths:
        problems += [f"{note}; paths of this machine would be published: quantize again with "
                     "this fp4sense, or pass --allow-local-paths to upload them as they are"
                     for note in local]
        local = []
    if problems:
        raise PushError(f"{folder} is not ready for the Hub; nothing was uploaded:\n  - "
                        + "\n  - ".join(problems))
    notes = list(local)
    if card and not card.get("base_model"):  # problems were raised above
        notes.append("the model card names no base_model, so the Hub will not list this "
                     "checkpoint under its base model; quantize with --base-model-id ORG/NAME "
                     "or add base_model to the card")
    return ReadyFolder(str(folder), files, fmt, card, notes)


def _upload_files(folder: Path) -> list[HubFile]:
    """Every file under ``folder`` except hidden ones (``.cache``, ``.git``, ...)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIPPED_DIRS)
        for name in sorted(names):
            if name.startswith("."):
                continue
            p = Path(root) / name
            if p.is_file():
                files.append(HubFile(p.relative_to(folder).as_posix(), p.stat().st_size))
    return files


def card_for_repo(text: str, repo_id: str) -> str:
    """The model card with its ``vllm serve`` command naming the Hub repo."""
    return re.sub(r"^vllm serve \S+$", f"vllm serve {repo_id}", text, flags=re.MULTILINE)


def push(folder: str | os.PathLike, repo_id: str, *, private: bool = False,
         dry_run: bool = False, token: str | None = None, revision: str | None = None,
         commit_message: str | None = None, allow_local_paths: bool = False) -> dict:
    """Check ``folder`` and upload it to the Hub repo ``repo_id`` in one commit.

    ``dry_run`` runs every check and returns what would be uploaded, touching nothing.
    The uploaded model card names ``repo_id`` in its ``vllm serve`` command (the local
    file is not changed). Raises :class:`PushError` (the folder) or :class:`HubError`
    (token, network, upload); either way nothing is left half-done.
    """

    try:
        validate_repo_id(repo_id)
    except Exception as exc:  # HFValidationError's message names the rule broken
        raise PushError(f"--repo-id {repo_id!r} is not a valid Hub repo id ({exc})") from None
    ready = check_folder(folder, allow_local_paths=allow_local_paths)
    card_path = Path(folder) / CARD_NAME
    card_text = card_path.read_text(encoding="utf-8")
    result = {"repo_id": repo_id, "private": private, "dry_run": dry_run, **ready.to_dict(),
              "card_rewritten": card_for_repo(card_text, repo_id) != card_text}
    if dry_run:
        return result
    result["url"], result["created"] = _upload(
        ready, repo_id, card_for_repo(card_text, repo_id).encode(), private=private,
        token=token, revision=revision, commit_message=commit_message)
    return result


def _upload(ready: ReadyFolder, repo_id: str, card: bytes, *, private: bool,
            token: str | None, revision: str | None,
            commit_message: str | None) -> tuple[str, bool]:
    """Upload in one commit; (commit url, whether the repo was created for it)."""

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token "
                       "with write access); nothing was uploaded")
    api = HfApi(token=token)
    where = constants.ENDPOINT
    try:
        user = api.whoami()["name"]
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status == 401:
            raise HubError("the Hub rejected the token (401); run `hf auth login` again or "
                           "set HF_TOKEN; nothing was uploaded") from None
        raise HubError(f"the Hub at {where} answered {status}; nothing was uploaded") from None
    except Exception as exc:  # no network, DNS, proxy, offline mode: one line, not a trace
        raise HubError(f"cannot reach the Hugging Face Hub at {where} "
                       f"({_one_line(exc)}); nothing was uploaded. Check the "
                       "network (or HF_ENDPOINT / HF_HUB_OFFLINE), or use --dry-run") from None
    folder = Path(ready.folder)
    ops = [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=(
        card if f.path == CARD_NAME else str(folder / f.path))) for f in ready.files]
    created = False
    try:
        created = not api.repo_exists(repo_id)
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, operations=ops, revision=revision,
                                 commit_message=commit_message or
                                 f"Upload {ready.quantization_format or 'compressed'} "
                                 "checkpoint with fp4sense")
    except BaseException as exc:  # Ctrl-C too: an empty repo made for us is not left behind
        if created:
            try:
                api.delete_repo(repo_id)
            except Exception:  # the upload's error is the one to report
                pass
        if not isinstance(exc, Exception):
            raise
        raise HubError(f"upload to {repo_id} as {user} failed ({_one_line(exc)}); "
                       + ("the repo created for it was deleted" if created else
                          "the repo was left as it was (a commit is all or nothing)")) from None
    return getattr(info, "commit_url", None) or str(url), created


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
