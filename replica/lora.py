"""LoRA adapters beside the base model: which are loaded (``LoRARegistry``), and one step's use of them
(``LoRAStep``), applied after each projection the adapters target.

A step mixes the base model and any number of loaded adapters. The batch's tokens are sorted by adapter once
per step (numpy over the batch, no per-token Python); each projection then adds every adapter's low-rank
update to its tokens in one segmented op (``kernels/lora.py``: compiled on the CPU, torch elsewhere).
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvmesh.core.errors import InvalidRequest
from kvmesh.kernels.lora import lora_update
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
        self.load_s: float | None = None
        """Seconds reading and placing an adapter took, a moving average over reads (None before the first)."""
        self.reads = 0
        """Adapters read from their files so far."""

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

    def path_of(self, name: str) -> str | None:
        """The directory ``name`` is served from; None if no adapter has that name."""
        entry = self._paths.get(name)
        return entry[1] if entry is not None else None

    def resident(self) -> list[str]:
        """The adapters whose weights are in memory, least recently used first."""
        return list(self._loaded)

    def _read(self, name: str, adapter_id: int, path: str) -> LoRAAdapter:
        start = time.perf_counter()
        weights = load_peft(name, path, self.shapes, self.max_rank, self.dtype)
        weights.layers = [
            {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in w.items()} for w in weights.layers
        ]
        took = time.perf_counter() - start
        self.reads += 1
        self.load_s = took if self.load_s is None else 0.8 * self.load_s + 0.2 * took
        self._loaded.pop(name, None)
        while len(self._loaded) >= self.max_cpu_loras:
            self._loaded.popitem(last=False)
        adapter = self._loaded[name] = LoRAAdapter(name, adapter_id, path, weights)
        return adapter


class LoRAStacks:
    """For the Triton kernel (``kernels/triton_lora.py``): the stacked pairs of the last few sets of adapters
    that stepped together, per layer and projection (a set of adapters stays together for many steps)."""

    def __init__(self, bounds: dict[str, list[int]], keep: int = 4) -> None:
        self.bounds, self.keep = bounds, keep
        self._sets: OrderedDict[tuple[int, ...], list[dict[str, tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()

    def get(
        self, ids: tuple[int, ...], weights: list[LoRAWeights]
    ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        if ids not in self._sets:
            from kvmesh.kernels.triton_lora import stack_pairs

            self._sets[ids] = [
                {
                    target: stack_pairs([w.layers[layer].get(target) for w in weights], len(edges) - 1)
                    for target, edges in self.bounds.items()
                    if any(target in w.layers[layer] for w in weights)
                }
                for layer in range(len(weights[0].layers))
            ]
            while len(self._sets) > self.keep:
                self._sets.popitem(last=False)
        self._sets.move_to_end(ids)
        return self._sets[ids]


@dataclass
class LoRAStep:
    """One step's adapters in order, the batch rows (token indices) that use them sorted by adapter, where each
    adapter's rows start (``seg``, on the CPU) and each fused projection's part bounds: ``kernels/lora.py``.
    With the Triton kernel: the adapters' pairs stacked (``stacked``) and the rows cut into ``tiles``."""

    weights: list[LoRAWeights]
    rows: torch.Tensor
    seg: torch.Tensor
    bounds: dict[str, list[int]]
    stacked: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None
    tiles: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        adapters: list[LoRAAdapter | None],
        qlens: np.ndarray,
        device: torch.device,
        bounds: dict[str, list[int]],
        stacks: LoRAStacks | None = None,
    ) -> LoRAStep | None:
        """Group a batch's tokens by adapter: ``adapters`` per sequence (None: the base model), ``qlens`` its
        tokens this step; ``stacks`` for the Triton kernel. None when no sequence uses an adapter."""
        ids = np.fromiter((a.id if a is not None else 0 for a in adapters), np.int64, len(adapters))
        used = np.unique(ids[ids > 0])
        if not len(used):
            return None
        by_id = {a.id: a.weights for a in adapters if a is not None}
        per_token = np.repeat(ids, qlens)
        tokens = np.flatnonzero(per_token)
        rows = tokens[np.argsort(per_token[tokens], kind="stable")]
        counts = np.bincount(np.searchsorted(used, per_token[tokens]), minlength=len(used))
        seg = torch.from_numpy(np.concatenate(([0], np.cumsum(counts))))
        weights = [by_id[i] for i in used.tolist()]
        step = cls(weights, torch.from_numpy(rows).to(device), seg, bounds)
        if stacks is not None:
            from kvmesh.kernels.triton_lora import lora_tiles

            step.stacked = stacks.get(tuple(used.tolist()), weights)
            step.tiles = lora_tiles(seg.tolist(), device)
        return step

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's update of projection ``target`` (input ``x``, output ``y``) to its rows of ``y``."""
        if self.stacked is not None:
            if (pair := self.stacked[layer].get(target)) is not None:
                from kvmesh.kernels.triton_lora import lora_update_triton

                lora_update_triton(y, x, *pair, self.rows, self.tiles, self.bounds[target])
            return
        pairs = [w.layers[layer].get(target) for w in self.weights]
        if not any(pairs):
            return
        none = x.new_empty(0)
        a = [p[0] if p else none for p in pairs]
        b = [p[1] if p else none for p in pairs]
        lora_update(y, x, a, b, self.rows, self.seg, self.bounds[target])
