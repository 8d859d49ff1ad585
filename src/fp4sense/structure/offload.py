"""Decoder blocks on disk: one block's weights in memory at a time (``--offload-dir``)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4sense.runtime.memory import mapped_allocations, return_freed_memory
from fp4sense.runtime.outputs import check_writable
from fp4sense.validate import InputError

__all__ = ["BlockStore", "Originals", "check_offload_dir"]


def check_offload_dir(folder: Path) -> None:
    """An offload folder must be writable and hold nothing but fp4sense's block files (a
    previous run's): one line naming it otherwise, before any model is loaded."""

    if folder.exists() and not folder.is_dir():
        raise InputError(f"--offload-dir {folder} is an existing file; choose a folder")
    if folder.is_dir():
        other = sorted(p.name for p in folder.iterdir()
                       if not (p.name.startswith("block_") and p.suffix == ".safetensors"))
        if other:
            raise InputError(f"--offload-dir {folder} is not empty ({', '.join(other[:3])}"
                             f"{', ...' if len(other) > 3 else ''}); fp4sense writes block "
                             "files there, so give an empty or new folder")
    check_writable(folder, "--offload-dir", "choose a folder you can write to")


def _check_finite(value: torch.Tensor, name: str, file: Path) -> None:
    """A weight read block by block holds no NaN / Inf (the whole model's check, made
    when its block is read): one line naming the module and the file."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise InputError(f"model has non-finite weights in {name.removesuffix('.weight')} "
                         f"({bad} NaN/Inf, in {file.name}); fix or re-download the checkpoint")


class BlockStore:
    """Decoder blocks kept out of memory: each block's parameters are read from
    safetensors files just before the block runs, then dropped (kept through a backward
    pass until :meth:`release_all`). Perturbations are overrides applied on load.

    The files are either the model's own (``files``: parameter name -> file, nothing is
    copied; :func:`fp4sense.inputs.models.load_model` with ``low_memory``) or copies
    written into ``folder`` from a model in memory (``--offload-dir``)."""

    def __init__(self, model, blocks_path: str, folder: Path | None = None,
                 device: torch.device | str = "cpu", files: dict[str, Path] | None = None,
                 dtype: torch.dtype | None = None):

        self.blocks = model.get_submodule(blocks_path)
        self.prefix = blocks_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.files = files
        self.owns_weights = files is None  # a copy: the model gets its weights back
        self.folder = Path(folder) if folder is not None else None
        if files is None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.overrides: dict[str, torch.Tensor] = {}
        self.loaded: set[int] = set()
        self.holding: set[int] = set()  # loaded for several calls (:meth:`held`)
        self.perturbed: set[str] = set()  # loaded parameters that hold an override
        self.handles = []
        for i, block in enumerate(self.blocks):
            if files is None:
                state = {n: p.data.contiguous() for n, p in block.named_parameters()}
                save_file(state, self._file(i))
            self.handles.append(block.register_forward_pre_hook(self._load_hook(i)))
            self.handles.append(block.register_forward_hook(self._drop_hook(i)))
            self._drop(i)

    def _file(self, i: int) -> Path:
        return self.folder / f"block_{i}.safetensors"

    def _where(self, full_name: str) -> tuple[Path, str]:
        """(file, key) of one block parameter by its model-level name."""
        if self.files is not None:
            return self.files[full_name], full_name
        index, _, rest = full_name[len(self.prefix) + 1:].partition(".")
        return self._file(int(index)), rest

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, self.dtype) if self.dtype is not None else tensor.to(
            self.device)

    def tensor(self, full_name: str) -> torch.Tensor:
        """One stored tensor by its model-level name (``model.layers.3.mlp.up_proj.weight``)."""

        file, key = self._where(full_name)
        with safe_open(str(file), "pt") as fh:
            return self._cast(fh.get_tensor(key))

    def _load(self, i: int) -> None:
        with mapped_allocations():  # the block's weights leave memory when it is dropped
            self._read(i)

    def _read(self, i: int) -> None:
        names = [(n, f"{self.prefix}.{i}.{n}") for n, _ in self.blocks[i].named_parameters()]
        by_file: dict[Path, list[tuple[str, str, str]]] = {}
        for name, full in names:
            file, key = self._where(full)
            by_file.setdefault(file, []).append((name, full, key))
        params = dict(self.blocks[i].named_parameters())
        for file, items in by_file.items():
            with safe_open(str(file), "pt", device=str(self.device)) as fh:
                for name, full, key in items:
                    value = self.overrides.get(full)
                    if callable(value):  # a perturbation computed when its block loads
                        value = value()
                    (self.perturbed.add if value is not None else self.perturbed.discard)(full)
                    if value is None:
                        value = self._cast(fh.get_tensor(key))
                        _check_finite(value, full, file)
                    params[name].data = value
        self.loaded.add(i)

    def original(self, full_name: str) -> torch.Tensor:
        """A block parameter's stored value: the loaded one when its block is in memory
        and no perturbation overrides it (no second copy), else read from the file."""
        index, _, rest = full_name[len(self.prefix) + 1:].partition(".")
        if (index.isdigit() and int(index) in self.loaded and full_name not in self.perturbed
                and full_name not in self.overrides):
            return self.blocks[int(index)].get_parameter(rest).data
        return self.tensor(full_name)

    def _drop(self, i: int) -> None:
        for param in self.blocks[i].parameters():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self.loaded.discard(i)
        return_freed_memory()  # the block's memory goes back, not to the heap

    def _load_hook(self, i: int):
        def hook(module, args, kwargs=None):
            # a replayed block needs no weights; a held one has them
            if "forward" not in vars(module) and i not in self.holding:
                self._load(i)
        return hook

    def _drop_hook(self, i: int):
        def hook(module, args, output):
            if not torch.is_grad_enabled() and i not in self.holding:
                self._drop(i)
        return hook

    @contextmanager
    def held(self, i: int):
        """Block ``i`` loaded once for several calls (a measured run's windows), dropped
        after."""
        self._load(i)
        self.holding.add(i)
        try:
            yield
        finally:
            self.holding.discard(i)
            self._drop(i)

    def release_all(self) -> None:
        for i in list(self.loaded):
            self._drop(i)

    def close(self, restore: bool = True) -> None:
        """Remove the hooks; with ``restore``, give every block its weights back."""
        for h in self.handles:
            h.remove()
        if restore:
            for i in range(len(self.blocks)):
                self.overrides.clear()
                self._load(i)
        self.loaded.clear()


class Originals(dict):
    """linear name -> unquantized weight, read from the block store when offloaded."""

    def __init__(self, modules: dict, store: BlockStore | None):
        super().__init__()
        self.modules, self.store = modules, store

    def __missing__(self, name: str) -> torch.Tensor:
        if self.store is not None:
            return self.store.original(f"{name}.weight")
        return self.modules[name].weight.data
