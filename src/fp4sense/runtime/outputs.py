"""Output folders: the one rule every command that writes one follows for ``--out``
(analyze, quantize, convert-gguf, and any later command).

- never the inputs: ``--out`` is not an input, does not hold one (a parent of an input,
  the folder that holds the GGUF), is not inside one, and is not the current folder
  (analyze, which adds its files to a folder and replaces none of the user's, may write
  beside its inputs, never into the model's folder);
- ``--overwrite`` replaces only a folder fp4sense wrote, holding nothing it did not write
  (a ledger in the fp4sense cache records what each published folder held);
- one writer: an exclusive lock per ``--out`` (:func:`claim_output`) before it is judged;
- a symbolic link given as ``--out`` is refused (a rename would replace the link, not
  write into its target), naming the target to pass instead;
- a folder is written under ``.NAME.partial-*`` beside ``--out``, marked with its
  writer, and published by one rename; a killed run's partial folder is removed by the
  next run when its writer is provably gone, otherwise named.

Imports no torch: the command line checks ``--out`` before it loads anything.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from fp4sense.defaults import cache_dir
from fp4sense.validate import InputError

__all__ = ["CHECKPOINT_FILES", "check_analysis_output", "check_writable", "claim_output",
           "foreign_files", "guard_output", "is_checkpoint_file", "local_inputs",
           "publish_folder", "record_written", "remove_dead_partials", "work_folder",
           "write_owner"]

#: what a folder fp4sense writes holds (a checkpoint, a converted model, an analysis):
#: the only files ``push`` publishes, and what an older fp4sense folder may hold for
#: ``--overwrite`` to replace it (paths relative to the folder, shell patterns)
CHECKPOINT_FILES = (
    # weights and configs (transformers, compressed-tensors)
    "*.safetensors", "model.safetensors.index.json", "config.json",
    "generation_config.json", "recipe.yaml",
    # tokenizers (transformers' save_pretrained)
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt",
    "spiece.model", "chat_template.jinja", "chat_template.json",
    # fp4sense's own: card, plan, sensitivity report, plots, training record
    "README.md", "report.md", "plan.json", "sensitivity.json", "distill.json",
    "fp4sense-quantize.json", "*.png",
)
_OWNER = ".fp4sense-owner"
#: output folder (resolved) -> the open lock file this process holds for it
_CLAIMED: dict[str, int] = {}


def is_checkpoint_file(relative: str) -> bool:
    """Whether a path inside a folder (``a/b.json``) is one :data:`CHECKPOINT_FILES`
    names: top-level files only, no hidden ones."""
    return "/" not in relative and any(fnmatch.fnmatchcase(relative, p)
                                       for p in CHECKPOINT_FILES)


def check_writable(folder: Path, what: str, fix: str) -> None:
    """``folder`` (or the nearest existing parent) accepts new files; else one line."""
    probe = Path(folder)
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{what} {folder}: {probe} is a file, not a folder; {fix}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{what} {folder}: {probe} is not writable; {fix}")


def guard_output(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                 overwrite: bool = False, replaces: bool = True,
                 writes: Iterable[str] = ()) -> Path:
    """The one ``--out`` rule (module docstring); raises :class:`InputError` naming the
    culprit. ``inputs``: the files and folders the command reads (the model, the GGUF,
    the text). ``replaces``: the command publishes a whole new folder (quantize,
    convert-gguf); False for analyze, which writes its files into the folder, leaving the
    others: it may write where no file of the user's has one of the names it writes
    (report.md, sensitivity.json, plots), so it reruns into the folder it wrote, and
    beside the text it read, but never into the model's folder. Returns ``out``."""
    out = Path(out)
    if out.is_symlink():
        raise InputError(f"--out {out} is a symbolic link to {os.readlink(out)}; fp4sense "
                         "publishes --out by one rename, which would replace the link: pass "
                         f"its target ({out.resolve()}) as --out, or another folder")
    claim_output(out)  # before the folder is judged: no run can publish in between
    target, here = out.resolve(), Path.cwd().resolve()
    if replaces and (target == here or target in here.parents):
        raise InputError(f"--out {out} is the current folder or holds it; fp4sense writes "
                         "a new folder there in one rename: name a new folder")
    for path in inputs:
        p = Path(path).resolve()
        # a folder published by rename must not hold an input; files written into a
        # folder (analyze) must not change an input folder
        if target == p or p in target.parents or (replaces and target in p.parents):
            raise InputError(f"--out {out} is, holds or is inside the input {path}; it would "
                             "be lost or changed: choose another folder")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is an existing file; choose a folder name")
    if out.is_dir() and any(out.iterdir()):
        if replaces and not overwrite:
            raise InputError(f"{out} exists and is not empty; choose another --out or pass "
                             "--overwrite")
        writes = set(writes)  # a user's file with a name the command writes is refused
        stranger = [f for f in foreign_files(out)
                    if replaces or is_checkpoint_file(f) or f in writes]
        if stranger:
            raise InputError(
                f"--out {out} holds {stranger[0]!r}" + (f" and {len(stranger) - 1} more"
                                                        if len(stranger) > 1 else "")
                + ", which fp4sense did not write; it replaces only folders it wrote: move "
                "those files out, or choose another --out")
    check_writable(target.parent, "--out", "choose a folder you can write to")
    return out


def check_analysis_output(out_dir, cache, inputs: Iterable = (), cache_name: str = "analysis",
                          writes: Iterable[str] = ()) -> Path | None:
    """``fp4sense analyze``'s output folder (:func:`guard_output`, rerunnable into the
    folder it wrote, never into a checkpoint) and analysis cache (``cache``: True for the
    fp4sense cache, a folder, or False for none), checked writable before any work;
    returns the cache folder."""
    cache_folder = (cache_dir() / cache_name if cache is True else Path(cache) if cache
                    else None)
    if out_dir is not None:  # nothing is computed when the results cannot be written
        out = guard_output(out_dir, inputs=inputs, replaces=False, writes=writes)
        held = [n for n in ("plan.json", "recipe.yaml") if (out / n).is_file()]
        if held:
            raise InputError(f"--out {out_dir} holds a checkpoint ({held[0]}): the analysis "
                             "would replace its sensitivity.json; choose another --out")
    if cache_folder is not None:
        check_writable(cache_folder, "the analysis cache", "pass --no-cache, or point "
                       "FP4SENSE_CACHE at a writable folder")
    return cache_folder


def local_inputs(*given) -> list[Path]:
    """The inputs among ``given`` (model ids, paths, None) that are files or folders here:
    what :func:`guard_output` protects (a hub id or a dataset name is not a path)."""
    return [Path(g) for g in given if g is not None and Path(g).exists()]


def _ledger_path(folder: Path) -> Path:
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:32]
    return cache_dir() / "written" / f"{key}.json"


def _files_of(folder: Path) -> list[str]:
    """Every file, link and empty folder under ``folder``, relative, hidden ones too."""
    found = []
    for root, dirs, names in os.walk(folder):
        rel = Path(root).relative_to(folder)
        found += [(rel / n).as_posix() for n in names]
        found += [(rel / d).as_posix() for d in dirs if (Path(root) / d).is_symlink()]
        if not dirs and not names and Path(root) != Path(folder):
            found.append(rel.as_posix() + "/")
    return sorted(found)


def record_written(folder: Path, files: Iterable[str | os.PathLike] | None = None) -> None:
    """Record in the ledger what fp4sense wrote in ``folder``: everything it holds (a
    folder just published), or the ``files`` a command added to it (analyze), with what
    the ledger recorded before. A ledger that cannot be written only costs a later
    ``--overwrite`` its shortcut."""
    path = _ledger_path(folder)
    if files is None:
        written = _files_of(Path(folder))
    else:
        try:
            written = json.loads(path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            written = []
        root = Path(folder).resolve()
        written = sorted({*written, *(Path(f).resolve().relative_to(root).as_posix()
                                      for f in files)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"folder": str(Path(folder).resolve()), "files": written}))
    except OSError:
        pass


def foreign_files(folder: Path) -> list[str]:
    """The files in ``folder`` fp4sense did not write: those the ledger does not record
    for it; for a folder the ledger does not know (written before it, or by another
    cache), every file unless the folder is an fp4sense checkpoint or analysis
    (plan.json or sensitivity.json) holding only :data:`CHECKPOINT_FILES`."""
    folder = Path(folder)
    files = _files_of(folder)
    try:
        recorded = set(json.loads(_ledger_path(folder).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if recorded is not None:
        return [f for f in files if f not in recorded]
    if not any((folder / n).is_file() for n in ("plan.json", "sensitivity.json")):
        return files
    return [f for f in files if not is_checkpoint_file(f)]


def claim_output(out: Path) -> None:
    """Make this process the one writer of ``out`` until it exits: an exclusive lock on
    a file named after the folder's resolved path, in the fp4sense cache (beside ``out``
    when the cache cannot be written), never inside the folder. A second run to the same
    ``--out`` stops at once in one line naming the running one. Under torchrun only the
    launch's rank 0 (the one that writes) claims it."""
    import fcntl

    target = str(Path(out).resolve())
    if target in _CLAIMED or (int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun: as
                              and os.environ.get("RANK", "0") != "0"):  # launch_rank()
        return
    places = (cache_dir() / "locks" / f"{hashlib.sha256(target.encode()).hexdigest()[:32]}.lock",
              Path(target).parent / f".{Path(target).name}.fp4sense-lock")
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(place, os.O_RDWR | os.O_CREAT, 0o644)
            break
        except OSError:
            continue
    else:
        return  # nowhere to lock: the folder checks that follow name the unwritable path
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise InputError(f"--out {out} is being written by another fp4sense run ({holder}); "
                         "wait for it to finish, or choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                  f"{time.strftime('%H:%M:%S')}".encode(), 0)
    _CLAIMED[target] = fd  # released when this process exits, however it exits


def work_folder(out: Path, log: Callable[[str], None]) -> Path:
    """A new work folder ``.NAME.partial-*`` beside ``out`` (published by one rename at the
    end), marked with its writer; partial folders of provably dead runs are removed
    first, the others named."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for note in remove_dead_partials(out.parent, out.name):
        log(f"note: {note}")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        work.chmod(0o777 & ~umask)  # a normal folder once published, not mkdtemp's 0700
        write_owner(work)  # a later run may remove this folder once this process is gone
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # unmarked: no later run could remove it
        raise
    return work


def publish_folder(work: Path, out: Path) -> None:
    """Replace ``out`` by the finished ``work`` folder in one rename (an earlier ``out``,
    with ``--overwrite``, is moved aside first and removed after); the owner mark goes
    first, so the published folder holds only the checkpoint's files; the ledger records
    what it holds."""
    (Path(work) / _OWNER).unlink(missing_ok=True)
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(trash / out.name)
        work.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        work.rename(out)
    record_written(out)


def write_owner(work: Path) -> None:
    """Mark a work-in-progress folder with the process that writes it."""
    (Path(work) / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def remove_dead_partials(parent: Path, name: str) -> list[str]:
    """Remove ``.NAME.partial-*`` folders beside an output whose writer is provably dead
    (same host, process gone); name the ones that cannot be proven dead. One line each."""
    notes = []
    for folder in sorted(Path(parent).glob(f".{name}.partial-*")):
        owner = folder / _OWNER
        try:
            host, pid = owner.read_text().split()
            alive = host != socket.gethostname() or _alive(int(pid))
        except (OSError, ValueError):
            notes.append(f"{folder} is left from an interrupted run of an older fp4sense; "
                         "remove it by hand if no run is writing it")
            continue
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            notes.append(f"removed {folder}, left by a run that was killed (pid {pid})")
    return notes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
