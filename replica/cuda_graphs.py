"""CUDA graphs of decode steps: one captured forward pass per batch-size bucket, replayed on fixed buffers.

A decode step launches a few hundred small kernels; on a fast GPU launching them one by one from Python
costs more than running them. A captured graph launches them all at once. Capture needs fixed shapes and
fixed addresses, so each bucket's graph runs on static input tensors of its size: a decode batch is padded
up to the next bucket (a padded row reads one cached slot, writes none, and its logits are dropped), block
tables are full width, and the attention kernels' context split is fixed per bucket. Prefill and mixed
steps, and decode batches larger than the largest bucket, run eagerly.

``DecodeGraphs(capture=False)`` runs the same padded, static path without capturing: how the CPU test
suite checks the padding and the bucket choice, which are the parts that are not CUDA's.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from kvmesh.kernels import AttentionMetadata, Kernels
from kvmesh.kernels.metadata import decode_splits
from kvmesh.replica.context import ForwardContext, LayerCache, forward_context
from kvmesh.replica.llama import LlamaForCausalLM
from kvmesh.replica.step_inputs import PreparedStep


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond: what ``max_num_seqs`` allows."""
    sizes = [1, 2, 4, *range(8, 64, 8), *range(64, 256, 16), *range(256, 1025, 32)]
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerCache],
        kernels: Kernels,
        device: torch.device,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_caches, self.kernels, self.device = model, kv_caches, kernels, device
        self.sizes = sorted(set(sizes))
        n, dev = self.sizes[-1], device
        self.max_seq_len = max_blocks * block_size
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one token per row: always this
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps = self.padded_steps = 0
        """Decode steps this path ran, and how many of them were padded up to their bucket."""
        if capture:
            self._capture()

    def _forward(self, size: int) -> torch.Tensor:
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_start_loc=self.query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.tables[:size],
            query_lens_cpu=np.ones(size, dtype=np.int64),
            seq_lens_cpu=np.full(size, self.max_seq_len),
            decode_splits=decode_splits(size, kv_heads, self.max_seq_len, self.device),
        )
        with torch.inference_mode(), forward_context(ForwardContext(meta, self.kv_caches, self.kernels)):
            return self.model(self.ids[:size], self.positions[:size], self.rows[:size])

    def _capture(self) -> None:
        """Largest bucket first, all in one memory pool: smaller graphs reuse what larger ones allocated."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # outside the capture: Triton compiles and autotunes on first launch
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket that holds ``n`` sequences, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, step: PreparedStep, last_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The step's logits from its bucket's graph, or None if it is not a decode step that fits one."""
        n = step.n
        size = self.bucket(n) if step.total == n else None
        if size is None:
            return None
        inp = step.inputs
        self.steps += 1
        self.padded_steps += size > n
        self.ids[:n].copy_(inp.host_tensor("input_ids", n), non_blocking=True)
        self.positions[:n].copy_(inp.host_tensor("positions", n), non_blocking=True)
        self.slots[:n].copy_(inp.host_tensor("slot_mapping", n), non_blocking=True)
        self.seq_lens[:n].copy_(inp.host_tensor("seq_lens", n), non_blocking=True)
        self.tables[:n, : step.width].copy_(inp.host_tensor("block_tables", n, step.width), non_blocking=True)
        if size > n:  # padded rows: read one slot, write none
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        if step.fill is not None:
            dst, src = (t.to(self.ids.device, non_blocking=True) for t in step.fill)
            self.ids[dst] = last_tokens[src]
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.outputs[size]
        else:
            logits = self._forward(size)
        if step.num_logits == n:
            return logits[:n]
        rows = torch.from_numpy(inp.host("logits_rows", step.num_logits).copy()).to(logits.device)
        return logits[rows]
