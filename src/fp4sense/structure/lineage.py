"""Where a model or a text came from, named as files that leave this machine may name it.

A checkpoint's files go to the Hub; paths of the user's machine (their user name, their
projects, their directory layout) must not. So the base model is named by its Hub id
where it can be known for certain, else by its folder's name; a text by its file's name
or dataset id. Identity is kept by content fingerprints (the model fingerprint, the
analysis cache key), never by paths. The paths themselves, which ``fp4sense eval`` uses
to find the base again on this machine, stay in the fp4sense cache, keyed by the
checkpoint's plan.json, never in the folder (``hf upload`` sends hidden files too).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from fp4sense.defaults import cache_dir

__all__ = ["LOCAL_RECORD", "hub_id_of", "is_hub_id", "local_record", "public_name",
           "text_name", "write_local_record"]

#: the in-folder record of local paths earlier versions wrote (read, never written: it
#: would travel with ``hf upload``)
LOCAL_RECORD = ".fp4sense-local.json"
# the Hugging Face cache stores ORG/NAME as models--ORG--NAME/snapshots/<revision>
_HUB_CACHE_FOLDER = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)")


def is_hub_id(value: str) -> bool:
    """``value`` has the form of a Hub model id ``ORG/NAME`` (and is no local path)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value.count("/") != 1 or Path(value).exists():
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def hub_id_of(source: str | os.PathLike, explicit: str | None = None) -> str | None:
    """The Hub id of a model source, where it is known for certain; else None.

    In order: ``explicit`` (``--base-model-id``, checked for form); the source itself when
    it is a Hub id; a folder inside the Hugging Face cache (``models--ORG--NAME``); the id
    the folder's config records (``_name_or_path`` as transformers saves it from a hub
    load, or fp4sense's bundled model)."""
    if explicit is not None:
        if not is_hub_id(explicit):
            raise ValueError(f"--base-model-id {explicit!r} is not a Hub model id; give it as "
                             "ORG/NAME, e.g. meta-llama/Llama-3.1-8B-Instruct")
        return explicit
    text = str(source)
    if is_hub_id(text):
        return text
    path = Path(text)
    if not path.exists():
        return None
    parts = path.resolve().parts
    for i, part in enumerate(parts):
        m = _HUB_CACHE_FOLDER.fullmatch(part)
        if m and parts[i + 1:i + 2] == ("snapshots",):
            return f"{m['org']}/{m['name']}"
    config = path / "config.json"
    if config.is_file():
        d = json.loads(config.read_text())
        for key in ("_model_name_or_path", "_name_or_path"):
            cand = d.get(key)
            if isinstance(cand, str) and is_hub_id(cand):
                return cand
    return None


def public_name(source: str | os.PathLike | None, hub_id: str | None = None) -> str:
    """How shared files name a model or text: its Hub id (or ``hub_id``), a dataset spec
    as given, else the file's or folder's name — never its path on this machine."""
    if hub_id:
        return hub_id
    if source is None:
        return ""
    text = str(source)
    if not text or text.startswith("dataset:") or is_hub_id(text):
        return text
    if os.sep in text or "/" in text or Path(text).exists():
        found = hub_id_of(text) if Path(text).exists() else None
        return found or Path(text).name
    return text


def text_name(text: str | os.PathLike | None) -> str:
    """How reports name an analysis text: the protocol split, a dataset spec, or a file's
    name (never its path)."""
    return public_name(text) if text is not None else "protocol calibration split"


def _record_file(folder: Path) -> Path | None:
    """Where this machine keeps ``folder``'s local record: the fp4sense cache, under the
    hash of the checkpoint's plan.json and the folder's inode (a rename or ``mv`` keeps
    both; two checkpoints with the same plan, from two copies of a base, stay apart)."""
    plan = Path(folder) / "plan.json"
    if not plan.is_file():
        return None
    st = os.stat(folder)
    digest = hashlib.sha256(plan.read_bytes()).hexdigest()[:32]
    return cache_dir() / "local" / f"{digest}-{st.st_dev}-{st.st_ino}.json"


def write_local_record(folder: Path, **paths: str | os.PathLike | None) -> Path | None:
    """Record the local paths a checkpoint was made from (absolute) outside it, so that
    this machine can find them again and no upload sends them (None without plan.json)."""
    record = {k: str(Path(v).resolve()) for k, v in paths.items()
              if v is not None and Path(v).exists()}
    path = _record_file(folder)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


def local_record(folder: Path) -> dict[str, str]:
    """The local paths :func:`write_local_record` kept for ``folder`` ({} if none; an
    earlier version's hidden file in the folder is read too)."""
    exact = _record_file(folder)
    # a copied folder (another inode): the newest record of the same plan whose base is here
    same_plan = ([] if exact is None else sorted(
        exact.parent.glob(exact.name.split("-")[0] + "-*.json"),
        key=lambda f: f.stat().st_mtime, reverse=True))
    for path in (exact, *same_plan, Path(folder) / LOCAL_RECORD):
        try:
            if path is not None and path.is_file():
                record = json.loads(path.read_text())
                if path in (exact, Path(folder) / LOCAL_RECORD) or Path(
                        record.get("base", "")).exists():
                    return record
        except (OSError, ValueError):
            continue
    return {}
