"""The synchronous engine: add requests, ``step()`` until done. ``LLM`` and ``AsyncLLM`` wrap it."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import check_block_size
from replica.block_pool import BlockPool
from replica.config import DEFAULT_CPU_KV_BYTES, GPU_KV_FRACTION, MAX_DEFAULT_SWAP_BYTES, EngineConfig
from replica.detokenizer import IncrementalDetokenizer
from replica.errors import InvalidRequest
from replica.kv_cache_manager import KVCacheManager
from replica.kv_events import KVEvent
from replica.limits import check_for_model, check_prompt_ids, check_request_fields
from replica.model_files import apply_chat_template
from replica.model_loader import load_model
from replica.model_runner import ModelRunner, kv_bytes_per_block
from replica.request import Request
from replica.sampler import sample
from replica.sampling_params import SamplingParams
from replica.scheduler import Scheduler
from replica.swap import SwapSpace
from router.hashing import BlockHash, first_block_extra, model_seed

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One sequence's state after a step. ``text``/``token_ids`` are cumulative; ``delta_*`` are this step's.

    A request with ``n > 1`` reports each of its sequences separately, under the same ``request_id`` with
    its ``index`` (0..n-1), so streaming stays one flat list of outputs per step; the request is done when
    all ``n`` have ``finished``, or at once when one output has ``finish_reason`` "error"."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None = None
    index: int = 0
    error: str | None = None
    """Why the request failed (``finish_reason`` "error"): its data made an engine step fail."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    kv_usage: float
    """Share of KV blocks pinned by requests (cached but evictable blocks count as free)."""
    prefix_hit_rate: float
    """Prompt tokens served from the prefix cache over prompt tokens admitted, since start."""
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_swapped_out: int
    """Preemptions that swapped the sequence to host memory instead of dropping its KV."""
    num_recomputed_tokens: int
    """Computed tokens thrown away by preemptions that recompute."""
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    requests_admitted: int
    """Requests admitted since start (each counted once, however often it was preempted)."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens of admitted requests, and those served from the prefix cache: a hit rate by tokens
    over any window is the ratio of their increments."""


class StepRates:
    """Running estimates of this engine's speed, reported to routers to turn queues into seconds.

    ``prefill_tok_s`` comes from steps dominated by prefill (an exponential moving average).
    ``decode_token_s`` is the *marginal* cost of one more running sequence in a decode step: the slope of
    ``step_s = base + slope * running`` fitted by exponentially weighted least squares over pure-decode
    steps. It stays unmeasured (``None``) until steps of different batch sizes were seen; a serving replica
    runs ``LLMEngine.warm_up`` first, so it reports a measured slope from its first request on.
    """

    def __init__(self, alpha: float = 0.2, decode_alpha: float = 0.05) -> None:
        self.prefill_tok_s = 2000.0
        self.step_s = 0.02
        self.mean_output_tokens = 128.0
        self.alpha = alpha
        self.decode_alpha = decode_alpha
        self.prefill_measured = False
        self._fit = [0.0] * 5  # weighted sums: 1, x, y, xx, xy (x = running, y = step seconds)

    def observe_finished(self, output_tokens: int) -> None:
        self.mean_output_tokens += self.alpha * (output_tokens - self.mean_output_tokens)

    def observe(self, batch: list, seconds: float) -> None:
        prefill = sum(sr.num_new_tokens for sr in batch if sr.num_new_tokens > 1)
        decodes = len(batch) - sum(1 for sr in batch if sr.num_new_tokens > 1)
        a = self.alpha
        self.step_s += a * (seconds - self.step_s)
        if prefill >= 64 and prefill >= 8 * decodes:
            rate = prefill / seconds
            self.prefill_tok_s = (
                rate if not self.prefill_measured else self.prefill_tok_s + a * (rate - self.prefill_tok_s)
            )
            self.prefill_measured = True
        elif prefill == 0 and decodes:
            d = self.decode_alpha
            terms = (1.0, decodes, seconds, decodes * decodes, decodes * seconds)
            self._fit = [(1 - d) * s + d * t for s, t in zip(self._fit, terms, strict=True)]

    @property
    def decode_token_s(self) -> float | None:
        w, sx, sy, sxx, sxy = self._fit
        if w == 0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < 0.25:  # batch sizes barely varied: base and slope cannot be told apart yet
            return None
        # One more sequence cannot cost more than a whole recent step. The fit forgets slowly and keeps
        # warm-up steps taken while replicas started side by side on shared cores (0.3 s slopes against
        # 0.016 s steps were reported): routers priced every running sequence at that and moved
        # conversations off their cached history.
        return min(max((sxy / w - mx * my) / var, 0.0), my, self.step_s)


def _pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        device = _pick_device(config.device)
        check_block_size(config.block_size, device)
        dtype = getattr(torch, config.dtype) if config.dtype else None
        self.loaded = load_model(config.model, device, dtype, config.max_model_len)
        self.tokenizer = self.loaded.tokenizer
        self.model_id = config.model
        self.max_model_len = config.max_model_len or self.loaded.config.max_position_embeddings
        model_dtype = next(self.loaded.model.parameters()).dtype
        self.bytes_per_block = kv_bytes_per_block(self.loaded, config.block_size, model_dtype, config.kv_cache_dtype)
        num_blocks = config.num_kv_blocks or self._blocks_for_budget(device)
        self.num_blocks = num_blocks
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, config.kv_cache_dtype)
        self.rates = StepRates()
        self.swap = self._swap_space()
        windows = [layer.self_attn.window for layer in self.loaded.model.layers]
        sliding = None if None in windows else max(windows)  # blocks behind every layer's window are freed
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching, sliding, self.swap)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode)
        self.hash_seed = model_seed(self.model_id)
        eos = self.loaded.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, list[Request]] = {}
        """Each live request's unfinished sequences (one, or up to ``n`` once forked)."""
        self.kv_event_sinks: list[Callable[[list[KVEvent]], None]] = []
        """Called with each step's KV events (the index publisher); they must not block."""
        self._ids = itertools.count()
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%s) on %s",
            config.model, num_blocks, config.block_size, config.kv_cache_dtype, device,
        )  # fmt: skip

    def _swap_space(self) -> SwapSpace | None:
        """The host swap tier: ``swap_space_bytes``, by default half the KV pool's bytes (at most 4 GiB)."""
        per_block = self.bytes_per_block
        size = self.config.swap_space_bytes
        if size is None:
            size = min(self.num_blocks * per_block // 2, MAX_DEFAULT_SWAP_BYTES)
        if size < per_block or self.config.preemption_mode == "recompute":
            return None
        return SwapSpace(self.runner.kv_caches, size // per_block, lambda: self.rates.prefill_tok_s)

    def _blocks_for_budget(self, device: torch.device) -> int:
        budget = self.config.kv_cache_bytes
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * GPU_KV_FRACTION)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        return max(1, budget // self.bytes_per_block)

    # ------------------------------------------------------------------ requests
    @property
    def max_request_tokens(self) -> int:
        """Prompt + output a single request may reach: the context, and never more than the whole pool."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        block_hashes: list[BlockHash] | None = None,
    ) -> str:
        """Queue a request; raises ``InvalidRequest`` (a ValueError naming the field) for parameters out of
        bounds, an empty prompt or one that cannot fit the context."""
        params = params or SamplingParams()
        check_request_fields(cache_salt=cache_salt, request_id=request_id)
        ids = self.tokenize(prompt)
        vocab = self.loaded.config.vocab_size
        check_prompt_ids(ids, vocab)
        check_for_model(params, vocab)
        if len(ids) >= self.max_request_tokens:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; this engine accepts at most {self.max_request_tokens - 1} "
                f"(context {self.max_model_len}, KV pool {self.num_blocks * self.block_size} tokens)",
                "prompt",
            )
        if params.n > self.scheduler.max_num_seqs:
            raise InvalidRequest(
                f"n={params.n} is more than this engine runs at once (max_num_seqs {self.scheduler.max_num_seqs})",
                "n",
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        detok = IncrementalDetokenizer(
            self.tokenizer.backend_tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
        )
        req = Request(
            request_id,
            ids,
            params,
            self.max_request_tokens,
            self.eos_token_ids,
            detok,
            self.block_size,
            self.hash_seed,
            first_block_extra(cache_salt),
            block_hashes,
        )
        self.requests[request_id] = [req]
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (all its sequences) and free its blocks at once; False if unknown or finished."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for req in seqs:
            self.scheduler.finish(req, "abort")
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every sequence that produced output or ended.

        Copy-on-write block copies queued by the scheduling run before the forward pass. A request with
        ``n > 1`` whose prompt this step completes is forked here: its one row of logits is sampled once
        per sequence, each with its own generator, and its sequences share the prompt's blocks.

        A request whose data makes the step fail is failed alone (an output with ``finish_reason``
        "error" and the cause in ``error``): the batch is run again one request at a time to find it, and
        every other request gets exactly the tokens it would have got."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.perf_counter()
        if self.swap is not None:
            self.swap.run_swap_outs()  # before anything writes the blocks they leave
        self.runner.copy_blocks(self.kv.take_copies())
        if self.swap is not None:
            self.swap.run_swap_ins()
        tables = [self.kv.block_ids(sr.request) for sr in batch]
        outputs: list[RequestOutput] = []
        try:
            logits = self.runner.execute(batch, tables)
        except Exception as exc:
            log.warning("a step of %d requests failed (%r); running them one at a time", len(batch), exc)
            batch, logits, failed = self._execute_alone(batch, tables)
            outputs += [self._fail(req.request_id, err) for req, err in failed]
        sampling = [sr.request for sr in batch if sr.samples]
        for sr in batch:
            sr.request.num_computed_tokens += sr.num_new_tokens
            self.kv.cache_full_blocks(sr.request)
        seqs: list[Request] = []
        rows: list[int] = []
        for row, req in enumerate(sampling):
            family = self._fork(req) if req.fork_pending else [req]
            seqs += family
            rows += [row] * len(family)
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        for req, token in zip(seqs, self._sample(logits, seqs), strict=True):
            if req.request_id not in self.requests:  # failed earlier in this step with a sibling sequence
                continue
            try:
                if isinstance(token, Exception):
                    raise token
                req.append_token(token)
                if req.finish_reason:
                    self.rates.observe_finished(len(req.output_token_ids))
                    self._retire(req)
                outputs.append(self._output(req, [token]))
            except Exception as exc:
                outputs.append(self._fail(req.request_id, exc))
        self._flush_events()
        self.rates.observe(batch, time.perf_counter() - t0)
        return outputs

    def _execute_alone(self, batch: list, tables: list[list[int]]) -> tuple[list, torch.Tensor, list]:
        """The failed step's forward again, one request at a time: the requests that ran, their logits rows
        (in batch order) and the ``(request, exception)`` of those that failed alone too."""
        ok, rows, failed = [], [], []
        for sr, table in zip(batch, tables, strict=True):
            try:
                rows.append(self.runner.execute([sr], [table]))
                ok.append(sr)
            except Exception as exc:
                failed.append((sr.request, exc))
        vocab = self.loaded.config.vocab_size
        logits = torch.cat(rows) if rows else torch.empty((0, vocab), device=self.runner.device)
        return ok, logits, failed

    def _sample(self, logits: torch.Tensor, seqs: list[Request]) -> list[int | Exception]:
        """One token per sequence; if the batch cannot be sampled, each row alone, failing only its own."""
        try:
            return sample(logits, seqs)
        except Exception as exc:
            log.warning("sampling %d rows failed (%r); sampling them one at a time", len(seqs), exc)
        tokens: list[int | Exception] = []
        for i, req in enumerate(seqs):
            try:
                tokens += sample(logits[i : i + 1], [req])
            except Exception as exc:
                tokens.append(exc)
        return tokens

    def _fail(self, request_id: str, exc: BaseException) -> RequestOutput:
        """End a request (all its sequences) that made the step fail; its output names the cause."""
        seqs = self.requests.pop(request_id, [])
        for req in seqs:
            self.scheduler.finish(req, "error")
        log.warning("request %s failed in the engine: %r", request_id, exc)
        req = seqs[0] if seqs else None
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=req.prompt_token_ids if req else [],
            token_ids=req.output_token_ids if req else [],
            text=req.detokenizer.text if req else "",
            delta_text="",
            delta_token_ids=[],
            num_cached_tokens=max(req.num_cached_tokens, 0) if req else 0,
            finish_reason="error",
            index=req.index if req else 0,
            error=f"{type(exc).__name__}: {exc}"[:500],
        )

    def _fork(self, req: Request) -> list[Request]:
        family = self.scheduler.fork(req)
        self.requests[req.request_id] = list(family)
        return family

    def _retire(self, req: Request) -> None:
        """A sequence stopped: free its blocks; the request ends with its last sequence."""
        self.scheduler.finish(req, req.finish_reason)
        seqs = self.requests[req.request_id]
        seqs.remove(req)
        if not seqs:
            del self.requests[req.request_id]

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        finished = req.finish_reason is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=req.detokenizer.text,
            delta_text=req.detokenizer.take_delta(finished),
            delta_token_ids=new_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            finish_reason=req.finish_reason,
            index=req.index,
        )

    # ------------------------------------------------------------------ observability
    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events:
            for sink in self.kv_event_sinks:
                sink(events)

    def warm_up(self, batch: int = 8, steps: int = 4) -> None:
        """Decode a few dummy steps at two batch sizes before serving.

        Routers weigh a replica's decode batch by its marginal cost per sequence, which a replica can only
        measure from steps of different sizes; without this, a fresh replica would report nothing until
        traffic happened to vary its batch, and routers would guess. It also warms the kernels, so the
        first user does not pay for it. Leaves no trace: blocks, cache and counters are reset.
        """
        n = max(2, min(batch, self.scheduler.max_num_seqs))
        params = SamplingParams(max_tokens=2 * steps + 2, temperature=0, ignore_eos=True)
        vocab = self.loaded.config.vocab_size
        rids = [
            self.add_request([(1000 + 97 * i + k) % vocab for k in range(self.block_size)], params, f"warm-up-{i}")
            for i in range(n)
        ]
        self.step()  # prefill all
        for running in (n, 1):
            for rid in rids[running:]:
                self.abort_request(rid)
            for _ in range(steps):
                self.step()
        for rid in rids:
            self.abort_request(rid)
        self.reset_prefix_cache()
        self.scheduler.reset_counters()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while requests hold blocks); sinks hear ``AllBlocksCleared``."""
        done = self.pool.reset()
        self._flush_events()
        return done

    def check_integrity(self) -> None:
        """Assert the pool's accounting, that exactly the running sequences own blocks, and that every block's
        reference count is the number of sequences holding it (shared prompt blocks of forks included)."""
        self.pool.check_integrity()
        owners = set(self.kv.req_blocks)
        running = set(self.scheduler.running)
        assert owners == running, f"blocks owned by non-running sequences: {[r.request_id for r in owners ^ running]}"
        live = {r for seqs in self.requests.values() for r in seqs}
        assert running <= live, "a running sequence belongs to no live request"
        refs = Counter(b.block_id for blocks in self.kv.req_blocks.values() for b in blocks if b is not None)
        if self.swap is not None:
            self.swap.check_integrity(self.kv.num_swapped_blocks)
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count != its owners"

    def load_report(self) -> dict:
        """What routers need to estimate a newcomer's wait here (Ray Serve ``record_routing_stats``)."""
        s = self.scheduler
        waiting, running = tuple(s.waiting), tuple(s.running)  # one C-level copy each: a step may be running
        pending = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        pending += sum(
            r.num_tokens - r.num_computed_tokens for r in running if r.num_computed_tokens < r.num_tokens - 1
        )
        return {
            "pending_prefill_tokens": pending,
            "num_running": len(running),
            "num_waiting": len(waiting),
            "kv_usage": self.pool.usage,
            # Blocks a newcomer could take once the queue ahead of it is admitted: routers must not send a
            # long prompt where it would wait for running sequences to finish while another pool has room.
            "kv_free_blocks": self.pool.num_free - sum(-(-r.num_tokens // self.block_size) for r in waiting),
            "kv_total_blocks": self.num_blocks,
            "cache_fill": self.pool.fill,
            # Unmeasured rates are left out: the router then assumes what the replica's peers measured.
            "prefill_tok_s": self.rates.prefill_tok_s if self.rates.prefill_measured else None,
            "decode_token_s": self.rates.decode_token_s,
            "step_s": self.rates.step_s,
            "mean_output_tokens": self.rates.mean_output_tokens,
            "max_num_seqs": self.scheduler.max_num_seqs,
        }

    def kv_pressure(self) -> dict[str, int]:
        """KV demand for the autoscaler: blocks pinned by running requests (cached-but-evictable blocks are
        free capacity, not demand), blocks the waiting requests' prompts will need, the pool size, the queue
        and the preemption counter. Read from the event loop while a step may run in the engine thread:
        the queues are copied first (one C-level call each), never iterated live."""
        size = self.block_size
        waiting, running = tuple(self.scheduler.waiting), tuple(self.scheduler.running)
        return {
            "kv_used_blocks": self.pool.num_used,
            "kv_waiting_blocks": sum(-(-r.num_tokens // size) for r in waiting),
            "kv_total_blocks": self.num_blocks,
            "num_waiting": len(waiting),
            "num_running": len(running),
            "num_preemptions": self.scheduler.num_preemptions,
        }

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            kv_usage=self.pool.usage,
            prefix_hit_rate=s.prompt_tokens_hit / s.prompt_tokens_queried if s.prompt_tokens_queried else 0.0,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
            num_swapped_out=s.num_swapped_out,
            num_recomputed_tokens=s.num_recomputed_tokens,
            num_blocks=self.num_blocks,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=self.pool.num_cached_free,
            requests_admitted=s.requests_admitted,
            prompt_tokens=s.prompt_tokens_queried,
            cached_prompt_tokens=s.prompt_tokens_hit,
        )
