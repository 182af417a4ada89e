"""LoRA adapters beside the base model: which are loaded (``LoRARegistry``), and one step's use of them
(``LoRAStep``), applied after each projection the adapters target.

A step mixes the base model and any number of loaded adapters. The batch's tokens are grouped by adapter
once per step (numpy over the batch, no per-token Python); each layer then adds, per adapter present, the
low-rank update to its rows: two small matmuls and an ``index_add_``, the whole batch in one matmul when a
single adapter covers it. The torch reference of a segmented LoRA op (vLLM's punica, S-LoRA's SGMV).
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


GROUPED_PADDING = 2.0
"""A step runs its adapters as one padded batch (``LoRAStacks``) while padding the adapters' token groups to the
largest one at most doubles the rows; past that (a long prefill beside short ones) each adapter runs alone."""


@dataclass
class Stacked:
    """Several adapters' pairs for one layer and projection, as batches: ``a`` [adapters, in, rank] and ``b``
    [adapters, rank, out], ranks zero-padded to the largest (an adapter without the projection: all zero)."""

    a: torch.Tensor
    b: torch.Tensor


class LoRAStacks:
    """Stacked pairs of the last few sets of adapters that stepped together (a mix stays for many steps)."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._sets: OrderedDict[tuple[int, ...], list[dict[str, Stacked]]] = OrderedDict()

    def get(self, adapters: list[LoRAAdapter]) -> list[dict[str, Stacked]]:
        """Per layer, per projection any of ``adapters`` targets, their pairs stacked in this order."""
        key = tuple(a.id for a in adapters)
        if key not in self._sets:
            self._sets[key] = [
                _stack(per_layer) for per_layer in zip(*(a.weights.layers for a in adapters), strict=True)
            ]
            while len(self._sets) > self.keep:
                self._sets.popitem(last=False)
        self._sets.move_to_end(key)
        return self._sets[key]


def _stack(per_adapter: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]) -> dict[str, Stacked]:
    stacked = {}
    for target in {t for pairs in per_adapter for t in pairs}:
        some_a, some_b = next(pairs[target] for pairs in per_adapter if target in pairs)
        rank = max(pairs[target][0].shape[0] for pairs in per_adapter if target in pairs)
        a = some_a.new_zeros(len(per_adapter), some_a.shape[1], rank)
        b = some_b.new_zeros(len(per_adapter), rank, some_b.shape[0])
        for j, pairs in enumerate(per_adapter):
            if target in pairs:
                pa, pb = pairs[target]
                a[j, :, : pa.shape[0]] = pa.T
                b[j, : pb.shape[1]] = pb.T
        stacked[target] = Stacked(a, b)
    return stacked


@dataclass
class Grouped:
    """A step's adapter tokens as a padded batch: ``rows`` [adapters * group] (each adapter's tokens, then
    padding pointing at row 0), ``valid`` (1 for a token, 0 for padding; None without padding)."""

    stacked: list[dict[str, Stacked]]
    rows: torch.Tensor
    valid: torch.Tensor | None
    shape: tuple[int, int]


@dataclass
class LoRAStep:
    """One step's adapters: per adapter present, its weights and the batch rows (token indices) it covers
    (None: every row); or all of them as one padded batch (``grouped``)."""

    segments: list[tuple[LoRAWeights, torch.Tensor | None]]
    grouped: Grouped | None = None

    @classmethod
    def build(
        cls, adapters: list[LoRAAdapter | None], qlens: np.ndarray, device: torch.device, stacks: LoRAStacks
    ) -> LoRAStep | None:
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
        tokens = np.flatnonzero(per_token)
        position = np.searchsorted(used, per_token[tokens])
        counts = np.bincount(position, minlength=len(used))
        group = int(counts.max())
        if len(used) * group > GROUPED_PADDING * len(tokens):
            return cls([(by_id[i].weights, _rows(per_token, i, device)) for i in used.tolist()])
        order = np.argsort(position, kind="stable")
        within = np.arange(len(tokens)) - np.repeat(np.cumsum(counts) - counts, counts)
        slots = position[order] * group + within
        rows = np.zeros(len(used) * group, np.int64)
        rows[slots] = tokens[order]
        valid = None
        if len(slots) < len(rows):
            mask = np.zeros((len(rows), 1), np.float32)
            mask[slots] = 1.0
            valid = torch.from_numpy(mask).to(device)
        shape = (len(used), group)
        stacked = stacks.get([by_id[i] for i in used.tolist()])
        return cls([], Grouped(stacked, torch.from_numpy(rows).to(device), valid, shape))

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each adapter's update of projection ``target`` (input ``x``, output ``y``) to its rows of ``y``."""
        if self.grouped is not None:
            self._apply_grouped(self.grouped, layer, target, x, y)
            return
        for weights, rows in self.segments:
            pair = weights.layers[layer].get(target)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y.add_((x @ a.T) @ b.T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)

    @staticmethod
    def _apply_grouped(grouped: Grouped, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        stacked = grouped.stacked[layer].get(target)
        if stacked is None:
            return
        xs = x.index_select(0, grouped.rows)
        if grouped.valid is not None:
            xs.mul_(grouped.valid.to(xs.dtype))
        update = torch.bmm(torch.bmm(xs.view(*grouped.shape, -1), stacked.a), stacked.b)
        y.index_add_(0, grouped.rows, update.view(len(grouped.rows), -1))


def _rows(per_token: np.ndarray, adapter_id: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(per_token == adapter_id)).to(device)
