"""Decoder blocks on disk: one block's weights in memory at a time (``--offload-dir``)."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["BlockStore", "Originals"]


class BlockStore:
    """Offloaded decoder blocks: each block's parameters live in a safetensors file and are
    loaded just before the block runs, then dropped (kept through a backward pass until
    :meth:`release_all`). Perturbations are overrides applied on load."""

    def __init__(self, model, blocks_path: str, folder: Path):
        from safetensors.torch import save_file

        self.blocks = model.get_submodule(blocks_path)
        self.prefix = blocks_path
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.overrides: dict[str, torch.Tensor] = {}
        self.loaded: set[int] = set()
        self.handles = []
        for i, block in enumerate(self.blocks):
            state = {n: p.data.contiguous() for n, p in block.named_parameters()}
            save_file(state, self.folder / f"block_{i}.safetensors")
            self.handles.append(block.register_forward_pre_hook(self._load_hook(i)))
            self.handles.append(block.register_forward_hook(self._drop_hook(i)))
            self._drop(i)

    def _file(self, i: int) -> Path:
        return self.folder / f"block_{i}.safetensors"

    def tensor(self, full_name: str) -> torch.Tensor:
        """One stored tensor by its model-level name (``model.layers.3.mlp.up_proj.weight``)."""
        from safetensors import safe_open

        index, _, rest = full_name[len(self.prefix) + 1:].partition(".")
        with safe_open(str(self._file(int(index))), "pt") as fh:
            return fh.get_tensor(rest)

    def _load(self, i: int) -> None:
        from safetensors.torch import load_file

        state = load_file(self._file(i))
        for name, param in self.blocks[i].named_parameters():
            full = f"{self.prefix}.{i}.{name}"
            param.data = self.overrides.get(full, state[name])
        self.loaded.add(i)

    def _drop(self, i: int) -> None:
        for param in self.blocks[i].parameters():
            param.data = torch.empty(0, dtype=param.dtype)
        self.loaded.discard(i)

    def _load_hook(self, i: int):
        def hook(module, args, kwargs=None):
            if "forward" not in vars(module):  # a replayed block needs no weights
                self._load(i)
        return hook

    def _drop_hook(self, i: int):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                self._drop(i)
        return hook

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
            return self.store.tensor(f"{name}.weight")
        return self.modules[name].weight.data
