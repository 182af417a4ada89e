"""LoRA adapters beside the base model: which are loaded (``LoRARegistry``), and one step's use of them
(``LoRAStep``), applied after each projection the adapters target.

A step mixes the base model and any number of loaded adapters. The batch's tokens are grouped by adapter
once per step (numpy over the batch, no per-token Python); each layer then adds, per adapter present, the
low-rank update to its rows: two small matmuls and an ``index_add_``, the whole batch in one matmul when a
single adapter covers it. The torch reference of a segmented LoRA op (vLLM's punica, S-LoRA's SGMV).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvmesh.core.errors import InvalidRequest
from kvmesh.replica.lora_weights import LoRAError, LoRAWeights, ProjectionShapes, load_peft


@dataclass
class LoRAAdapter:
    """A loaded adapter: its request-facing ``name``, a positive ``id`` (0 is the base model), its files."""

    name: str
    id: int
    path: str
    weights: LoRAWeights


class LoRARegistry:
    """The adapters an engine serves, by name and PEFT directory; the weights of at most ``max_cpu_loras`` kept
    in memory (the least recently used dropped, and read again from their directory when next asked for)."""

    def __init__(
        self, shapes: ProjectionShapes, max_cpu_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shapes, self.max_cpu_loras, self.max_rank = shapes, max_cpu_loras, max_rank
        self.dtype, self.device = dtype, device
        self._paths: dict[str, tuple[int, str]] = {}
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._ids = itertools.count(1)

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Serve the adapter at ``path`` as ``name``; ``LoRAError`` if it cannot be served, and then nothing
        changes. Cached blocks are keyed by the name (as routers see it): reload new weights under a new one."""
        if not name or not isinstance(name, str):
            raise LoRAError("an adapter needs a non-empty name")
        adapter = self._read(name, next(self._ids), str(path))
        self._paths[name] = (adapter.id, adapter.path)
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving ``name``; requests already running on it finish on their own reference to its weights."""
        self._loaded.pop(name, None)
        return self._paths.pop(name, None) is not None

    def get(self, name: str) -> LoRAAdapter:
        """The adapter ``name`` (read again if it was dropped from memory); ``InvalidRequest`` on the ``model``
        field if none is served under that name."""
        if name not in self._paths:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded", "model")
        adapter = self._loaded.get(name)
        if adapter is None:
            adapter = self._read(name, *self._paths[name])
        self._loaded.move_to_end(name)
        return adapter

    def names(self) -> list[str]:
        return list(self._paths)

    def _read(self, name: str, adapter_id: int, path: str) -> LoRAAdapter:
        weights = load_peft(name, path, self.shapes, self.max_rank, self.dtype)
        weights.layers = [
            {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in w.items()} for w in weights.layers
        ]
        self._loaded.pop(name, None)
        while len(self._loaded) >= self.max_cpu_loras:
            self._loaded.popitem(last=False)
        adapter = self._loaded[name] = LoRAAdapter(name, adapter_id, path, weights)
        return adapter


@dataclass
class LoRAStep:
    """One step's adapters: per adapter present, its weights and the batch rows (token indices) it covers
    (None: every row)."""

    segments: list[tuple[LoRAWeights, torch.Tensor | None]]

    @classmethod
    def build(cls, adapters: list[LoRAAdapter | None], qlens: np.ndarray, device: torch.device) -> LoRAStep | None:
        """Group a batch's tokens by adapter: ``adapters`` per sequence (None: the base model), ``qlens`` its
        tokens this step. None when no sequence uses an adapter."""
        ids = np.fromiter((a.id if a is not None else 0 for a in adapters), np.int64, len(adapters))
        used = np.unique(ids[ids > 0])
        if not len(used):
            return None
        by_id = {a.id: a for a in adapters if a is not None}
        if len(used) == 1 and (ids > 0).all():
            return cls([(by_id[int(used[0])].weights, None)])
        per_token = np.repeat(ids, qlens)
        return cls([(by_id[i].weights, _rows(per_token, i, device)) for i in used.tolist()])

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's update of projection ``target`` (input ``x``, output ``y``) to its rows of ``y``."""
        for weights, rows in self.segments:
            pair = weights.layers[layer].get(target)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y.add_((x @ a.T) @ b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)


def _rows(per_token: np.ndarray, adapter_id: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(per_token == adapter_id)).to(device)
