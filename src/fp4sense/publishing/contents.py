"""What a checkpoint folder may publish: only the files a checkpoint holds, no secret
inside them, no link out of the folder, and fp4sense's own records (plan.json,
recipe.yaml) loaded with the tools' own safe loaders and checked against the tensors
beside them. Each function returns one problem line per culprit, naming the file and
what to do (``push`` lists them all and uploads nothing)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from fp4sense.checkpoint.checks import tensor_index
from fp4sense.numerics.schemes import INPUT_CLIP_OBSERVER, get_scheme
from fp4sense.planning.milp import Plan
from fp4sense.runtime.outputs import CHECKPOINT_FILES, is_checkpoint_file
from fp4sense.validate import UserError

__all__ = ["SECRETS", "local_paths", "outside_links", "recorded_files", "unpublishable"]

#: secrets a text file must not carry to the Hub: kind -> pattern (each a documented
#: token format: Hugging Face user access tokens, PEM private keys, AWS access key ids,
#: GitHub tokens, Slack tokens)
SECRETS = {
    "a Hugging Face token": re.compile(rb"\bhf_[A-Za-z]{34}\b"),
    "a private key": re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----"),
    "an AWS access key": re.compile(rb"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "a GitHub token": re.compile(rb"\bgh[pousr]_[A-Za-z0-9]{36}\b"),
    "a Slack token": re.compile(rb"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
}
#: files not read for secrets: binary tensors and images
_BINARY = (".safetensors", ".png")


def outside_links(folder: Path) -> list[str]:
    """Links under ``folder`` whose target lies outside it (an upload would send the
    target's content, or fail on a dangling one)."""
    root = Path(folder).resolve()
    found = []
    for base, dirs, names in os.walk(folder):
        for name in (*dirs, *names):
            p = Path(base) / name
            if p.is_symlink():
                target = p.resolve()
                if target != root and root not in target.parents:
                    found.append(f"{p}: a link to {os.readlink(p)}, outside the folder; an "
                                 "upload would send what it points to: remove the link, or "
                                 "copy the file in")
    return found


def unpublishable(folder: Path, files: Iterable) -> list[str]:
    """Files an upload would send that a checkpoint does not hold (a private key, a token
    or credentials file, a stray note: the allowlist is
    :data:`~fp4sense.runtime.outputs.CHECKPOINT_FILES`), and allowed text files that
    carry a secret (:data:`SECRETS`)."""
    problems = []
    for f in files:
        if not is_checkpoint_file(f.path):
            problems.append(f"{Path(folder) / f.path}: not a file a checkpoint holds "
                            "(weights, configs, tokenizer, model card, plan, recipe, "
                            "sensitivity report, plots), so it is not uploaded; move it out "
                            f"of the folder (allowed: {', '.join(CHECKPOINT_FILES)})")
            continue
        if f.path.endswith(_BINARY):
            continue
        data = (Path(folder) / f.path).read_bytes()
        for kind, pattern in SECRETS.items():
            if pattern.search(data):
                problems.append(f"{Path(folder) / f.path}: holds {kind}; remove it from the "
                                "file (and revoke it) before pushing")
                break
    return problems


def recorded_files(folder: Path) -> list[str]:
    """plan.json loaded as fp4sense loads it and checked against the tensors beside it;
    recipe.yaml loaded with safe YAML (no Python tags) and shaped as an llm-compressor
    recipe (stages of ``*_modifiers``)."""
    folder = Path(folder)
    problems = []
    recipe = folder / "recipe.yaml"
    if recipe.is_file():
        problems += _recipe_problems(recipe)
    if (folder / "plan.json").is_file():
        try:
            plan = Plan.load(folder / "plan.json")
        except UserError as exc:
            return [*problems, str(exc)]
        try:
            stored = tensor_index(folder)
        except UserError:
            return problems  # the checkpoint checker names the weights' fault
        problems += _plan_against(folder / "plan.json", plan, stored)
        problems += _clips_against(folder, plan)
    return problems


def _recipe_problems(recipe: Path) -> list[str]:
    try:
        doc = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0][:160]
        return [f"{recipe}: does not load as safe YAML ({first}); a recipe holds no Python "
                "tags: write it again (fp4sense quantize does)"]
    stages = doc.values() if isinstance(doc, dict) else ()
    if not any(isinstance(s, dict) and any(str(k).endswith("_modifiers") and isinstance(v, dict)
                                           for k, v in s.items()) for s in stages):
        return [f"{recipe}: not an llm-compressor recipe (no stage with *_modifiers); write "
                "it again (fp4sense quantize does)"]
    return []


def _stored_as(module: str, stored: dict) -> str | None:
    """How the files store a module's weight: its format, or None when absent."""
    packed = stored.get(f"{module}.weight_packed")
    if packed is not None:
        scale = stored.get(f"{module}.weight_scale", {}).get("dtype")
        return {"F8_E4M3": "nvfp4", "U8": "mxfp4"}.get(scale, "int4")
    weight = stored.get(f"{module}.weight")
    if weight is None:
        return None
    return {"F8_E4M3": "fp8", "I8": "int8"}.get(weight.get("dtype"), "unquantized")


def _plan_against(path: Path, plan: Plan, stored: dict) -> list[str]:
    """Each planned module stored as its scheme says (modules the files store under other
    names, such as a MoE's experts, are left to the checkpoint checker)."""
    for choice in plan.choices:
        want = get_scheme(choice.scheme).weight_format or "unquantized"
        for module in choice.modules:
            have = _stored_as(module, stored)
            if have is not None and have != want:
                return [f"{path}: gives {choice.unit} {choice.scheme}, but {module} is stored "
                        f"{have}; the plan is not this checkpoint's: restore its plan.json"]
    return []


def _clips_against(folder: Path, plan: Plan) -> list[str]:
    """Each ``*_ACLIP`` unit's input tensor scale calibrated, as config.json records it,
    from the fraction of the input maximum its plan chose."""
    try:
        groups = json.loads((folder / "config.json").read_text())["quantization_config"][
            "config_groups"]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # the checkpoint checker names a missing or broken config
    made = []  # (target regex, fraction its input observer used)
    for name, group in groups.items():
        inputs = group.get("input_activations") or {}
        fraction = ((inputs.get("observer_kwargs") or {}).get("fraction", 1.0)
                    if inputs.get("observer") == INPUT_CLIP_OBSERVER else 1.0)
        made += [(name, t, fraction) for t in group.get("targets", ())]
    for choice in plan.choices:
        for module in choice.modules:
            for name, target, fraction in made:
                hit = (re.match(target[3:], module) if target.startswith("re:")
                       else target == module)
                if hit and abs(float(fraction) - choice.input_fraction) > 1e-12:
                    return [f"{folder / 'plan.json'}: makes {choice.unit}'s input tensor "
                            f"scale from {choice.input_fraction:g} of the input maximum, but "
                            f"config.json's {name} calibrated {module}'s from {fraction:g}; "
                            "the plan is not this checkpoint's: restore its plan.json"]
    return []


#: files read for paths of this machine: every text file a checkpoint folder holds
_TEXT_SUFFIXES = (".json", ".md", ".yaml", ".yml", ".txt", ".jinja", ".py", ".cfg")
#: an absolute path in free text (README, recipe.yaml): /a/b... up to a space or quote
_PATH_IN_TEXT = re.compile(r"(?<![\w.:/~-])(/[\w.+@-]+(?:/[\w.+@-]+)+)")


def _machine_path(value: str) -> bool:
    """An absolute path of this machine: it, or the folder it names a file in, exists
    (deeper than ``/tmp`` or ``/home``: those say nothing of the user)."""
    if not os.path.isabs(value):
        return False
    path = Path(value)
    return any(len(p.parts) > 2 and p.exists() for p in (path, path.parent))


def local_paths(folder: Path, files: Iterable) -> list[str]:
    """The text files to upload (JSON, YAML, Markdown, ...) that name absolute paths of
    this machine (one line each, naming the file and the first paths)."""
    def walk(value, key: str = ""):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, k)
        elif isinstance(value, list):
            for v in value:
                yield from walk(v, key)
        elif isinstance(value, str) and _machine_path(value):
            yield key, value

    notes = []
    for f in files:
        if not f.path.endswith(_TEXT_SUFFIXES) or Path(f.path).name.startswith(
                ("tokenizer", "vocab", "merges")):  # vocabularies hold "/" pieces
            continue
        try:
            text = (folder / f.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        try:
            found = sorted(set(walk(json.loads(text)))) if f.path.endswith(".json") else []
        except ValueError:
            found = []
        found += sorted({("", m) for m in _PATH_IN_TEXT.findall(text) if _machine_path(m)}
                        - {("", v) for _, v in found})
        if found:
            shown = ", ".join(f"{k or 'text'}: {v}" for k, v in found[:3])
            notes.append(f"{f.path} records {len(found)} path(s) of this machine ({shown}"
                         f"{', ...' if len(found) > 3 else ''})")
    return notes
