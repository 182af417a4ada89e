"""The synchronous engine: add requests, ``step()`` until done, ``close()``. ``LLM`` and ``AsyncLLM`` wrap it.

The engine is assembled from its ``EngineConfig``: the model runner (the device pool), the host tier with the
disk tier under it, the block pool, the KV manager and the scheduler, each built with what it needs. Every
tier emits its KV events into one ``KVEventLog`` given to it when it is built; the engine hands the log's
events to its ``kv_event_sinks`` after each step.

A step is: schedule a batch, plan it (advance its sequences on the host as if it had run, fork what
completes its prompt, and write a ``StepPlan`` of the device work), hand the plan to the device queue,
and collect the step launched before it into outputs. The device work is ``device_step.py``; the live
requests, ``live_requests.py``; what happens when a step fails, ``recovery.py``; the pools' sizes,
``pool_sizing.py``; warming up, ``warm_up.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import InvalidRequest
from kvmesh.core.hashing import BlockHash, model_seed
from kvmesh.core.limits import check_for_model, check_prompt_ids, check_request_fields
from kvmesh.core.messages import EngineStats
from kvmesh.core.model_files import apply_chat_template
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.kernels import check_block_size
from kvmesh.replica.block_pool import BlockPool
from kvmesh.replica.cpu_memory import keep_freed_memory
from kvmesh.replica.detokenizer import IncrementalDetokenizer
from kvmesh.replica.device_queue import DeviceQueue
from kvmesh.replica.device_step import DeviceStep
from kvmesh.replica.disk_tier import DiskTier
from kvmesh.replica.kv_cache_manager import KVCacheManager
from kvmesh.replica.kv_events import KVEvent, KVEventLog
from kvmesh.replica.kv_exchange import KVExchange
from kvmesh.replica.kv_transfer import BlockBytes
from kvmesh.replica.live_requests import LiveRequests
from kvmesh.replica.lora import LoRAAdapter, LoRARegistry
from kvmesh.replica.lora_weights import LoRAError
from kvmesh.replica.model_loader import load_model
from kvmesh.replica.model_runner import ModelRunner, kv_bytes_per_block
from kvmesh.replica.outputs import LogprobRow, RequestOutput, token_logprob
from kvmesh.replica.penalties import PenaltyCounts
from kvmesh.replica.pool_sizing import device_blocks, host_blocks
from kvmesh.replica.recovery import StepRecovery
from kvmesh.replica.request import Request
from kvmesh.replica.scheduler import ScheduledRequest, Scheduler
from kvmesh.replica.simulated import SimulatedRunner, SimulatedStep, load_simulated
from kvmesh.replica.step_plan import (
    Advanced,
    LaunchedStep,
    PrepareFailed,
    StepPlan,
    plan_logits,
    prompt_rows,
    sampling_tensors,
)
from kvmesh.replica.structured import GrammarCompiler
from kvmesh.replica.swap import SwapSpace, block_bytes
from kvmesh.replica.telemetry import StepRates
from kvmesh.replica.warm_up import warm_up_engine

log = logging.getLogger(__name__)


def _prepare_device(config: EngineConfig) -> torch.device:
    """The engine's device (CUDA when available unless ``device`` names one), checked for the block size, and
    this process's torch threads and allocator set for it."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_block_size(config.block_size, device)
    if device.type == "cpu":
        keep_freed_memory()  # activations reuse freed heap instead of faulting in fresh pages each step
    return device


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = _prepare_device(config)
        dtype = getattr(torch, config.dtype) if config.dtype else None
        self.loaded = (
            load_model(config.model, device, dtype, config.max_model_len)
            if config.simulate is None
            else load_simulated(config.model)
        )
        self.tokenizer = self.loaded.tokenizer
        self.model_id = config.model
        self.max_model_len = config.max_model_len or self.loaded.config.max_position_embeddings
        model_dtype = next(self.loaded.model.parameters()).dtype
        self.bytes_per_block = kv_bytes_per_block(self.loaded, config.block_size, model_dtype, config.kv_cache_dtype)
        self.num_blocks = device_blocks(config, device, self.bytes_per_block)
        self.block_size = config.block_size
        self.hash_seed = model_seed(self.model_id)
        self.events = KVEventLog()
        """Every tier's KV events in order: the device pool, host tier and disk tier are built with it."""
        self.kv_event_sinks: list[Callable[[list[KVEvent]], None]] = []
        """Called with each step's KV events (the index publisher); they must not block."""
        self.rates = StepRates()
        self._build_kv(device)
        self.loras = self._lora_registry(device, model_dtype)
        """The LoRA adapters served beside the model (``replica/lora.py``); None without ``enable_lora``."""
        self.eos_token_ids = self._eos_token_ids()
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size, sorted(self.eos_token_ids))
        self.penalties = PenaltyCounts(self.runner.device)
        self.live = LiveRequests(self.scheduler, self.penalties, self.grammars)
        self.requests = self.live.requests
        """Each live request's unfinished sequences (one, or up to ``n`` once forked)."""
        self.recovery = StepRecovery(live=self.live, kv=self.kv, launch=self._launch, collect=self._collect)
        self._ids = itertools.count()
        self.async_scheduling = config.async_scheduling
        self.device = DeviceQueue(device, config.async_scheduling and config.device_thread, config.torch_threads)
        self.device_step = (DeviceStep if config.simulate is None else SimulatedStep)(
            self.runner, self.swap, self.penalties
        )
        self.exchange = KVExchange(
            self.pool, self.swap, BlockBytes(self.runner.kv_caches), self.device, self._flush_events
        )
        """Export and adoption of prefix blocks for peers (``replica/kv_peer.py``)."""
        self._launched_step: LaunchedStep | None = None
        self._last_collect = self._last_launched = 0.0
        """When the last step was collected, and when the last inline step finished its launch (step timing)."""
        self.closed = False
        """Set by ``close()``."""
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%s) on %s",
            config.model,
            self.num_blocks,
            config.block_size,
            config.kv_cache_dtype,
            device,
        )

    def _build_kv(self, device: torch.device) -> None:
        """The model runner (the device pool), the host tier, the block pool, the KV manager, the scheduler and,
        on CUDA, the decode steps' kernels and graphs."""
        config = self.config
        max_blocks_per_seq = -(-self.max_request_tokens // config.block_size) + 1
        runner = ModelRunner if config.simulate is None else SimulatedRunner
        self.runner = runner(self.loaded, config, num_blocks=self.num_blocks, max_blocks_per_seq=max_blocks_per_seq)
        self.kv_fingerprint = self.runner.fingerprint(self.model_id, self.hash_seed, config)
        """What a block's bytes depend on besides its tokens: blocks from disk or a peer must carry this one."""
        self.swap = self._host_tier(device)
        host_cache = self.swap if self.swap is not None and self.swap.cache_blocks else None
        self.pool = BlockPool(self.num_blocks, config.enable_prefix_caching, events=self.events, host_tier=host_cache)
        windows = [layer.self_attn.window for layer in self.loaded.model.layers]
        self.kv = KVCacheManager(
            self.pool,
            config.block_size,
            sliding_window=None if None in windows else max(windows),  # blocks behind every layer's window free
            swap=self.swap,
            max_seqs=config.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
        )
        self.scheduler = Scheduler(self.kv, config)
        self.runner.prepare_decode(config)

    def _host_tier(self, device: torch.device) -> SwapSpace | None:
        """The host tier (swap space and host prefix cache) over the runner's cache, with the disk tier under it;
        None when the config gives it no block."""
        config = self.config
        swap_blocks, cache_blocks = host_blocks(config, device, self.num_blocks, self.bytes_per_block)
        disk = None
        if config.disk_cache_dir is not None:
            if not cache_blocks:
                raise ValueError("disk_cache_dir needs a host tier (host_cache_bytes > 0): its blocks go through it")
            size = block_bytes(self.runner.kv_caches)
            disk = DiskTier(
                config.disk_cache_dir, config.disk_cache_bytes, self.kv_fingerprint, size, events=self.events
            )
            log.info("disk tier %s: %d blocks adopted, room for %d", disk.dir, disk.adopted, disk.num_blocks)
        if swap_blocks + cache_blocks < 1:
            return None
        return SwapSpace(
            self.runner.kv_caches,
            swap_blocks + cache_blocks,
            prefill_tok_s=lambda: self.rates.prefill_tok_s,  # read when a load is priced
            events=self.events,
            cache_blocks=cache_blocks,
            disk=disk,
        )

    def _lora_registry(self, device: torch.device, dtype: torch.dtype) -> LoRARegistry | None:
        config = self.config
        if not config.enable_lora:
            return None
        shapes = self.loaded.model.lora_shapes()
        loras = LoRARegistry(shapes, config.max_cpu_loras, config.max_lora_rank, dtype, device)
        for name, path in (config.lora_modules or {}).items():
            loras.load(name, path)
        return loras

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as model ``name`` from the next request on; ``LoRAError`` (a
        ValueError) if it cannot be served, with nothing changed."""
        if self.loras is None:
            raise LoRAError("this engine was started without enable_lora")
        self.loras.load(name, path)

    def ensure_lora(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name`` unless it already is: a cluster's replica loads an adapter
        when the first request naming it arrives (``GenerateCall.lora_path``). ``LoRAError`` as ``load_lora``."""
        if self.loras is None or self.loras.path_of(name) != path:
            self.load_lora(name, path)

    def unload_lora(self, name: str) -> bool:
        """Stop serving adapter ``name`` (requests running on it finish on it); False if it was not served."""
        return self.loras is not None and self.loras.unload(name)

    def _eos_token_ids(self) -> set[int]:
        eos = self.loaded.config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

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
        lora_name: str | None = None,
    ) -> str:
        """Queue a request (on the adapter ``lora_name``, or the base model); raises ``InvalidRequest`` (a
        ValueError naming the field) for parameters out of bounds, an unknown adapter, an empty prompt or one
        that cannot fit the context."""
        params = params or SamplingParams()
        check_request_fields(cache_salt=cache_salt, request_id=request_id)
        lora = self._adapter(lora_name)
        ids = self.tokenize(prompt)
        self._check(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        detok = IncrementalDetokenizer(
            self.tokenizer.backend_tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            max_total_tokens=self.max_request_tokens,
            eos_token_ids=self.eos_token_ids,
            detokenizer=detok,
            block_size=self.block_size,
            hash_seed=self.hash_seed,
            cache_salt=cache_salt,
            block_hashes=block_hashes,
            lora=lora,
        )
        self.live.admit(request)
        return request_id

    def _adapter(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        if self.loras is None:
            raise InvalidRequest(f"this engine serves no LoRA adapters (asked for {name!r})", "model")
        return self.loras.get(name)

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        """What only this engine can check: token ids within its vocabulary, a prompt that fits, ``n``."""
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

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (all its sequences) and free its blocks at once; False if unknown or finished."""
        return self.live.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._launched_step is not None

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one step; report every sequence that produced a token or ended.

        With ``async_scheduling`` (the default) a call launches the step it schedules and then collects the
        one launched by the call before: the host turns that step's tokens into outputs (detokenization,
        stop strings) while the device runs the new one, which was scheduled before those tokens were
        known (a sequence's next input is read on the device from the step before). So the outputs are one
        call behind, and a sequence found finished when its tokens arrive has already run one more step,
        whose token is dropped. Without it, each call launches and collects the same step.

        A request with ``n > 1`` whose prompt a step completes is forked when the step is launched: its one
        row of logits is sampled once per sequence, and its sequences share the prompt's blocks. A request
        whose data makes a step fail is failed alone (``recovery.py``)."""
        try:
            launched = self._launch()
        except PrepareFailed as failed:  # nothing was launched: run the batch one request at a time
            log.warning("preparing a step of %d requests failed (%r)", len(failed.batch), failed.__cause__)
            outputs = self.drain() + self.recovery.run_alone(failed.batch)
        else:
            if self.async_scheduling:
                launched, self._launched_step = self._launched_step, launched
            outputs = self._collect(launched) if launched is not None else []
        self._flush_events()
        return outputs

    def _launch(self, batch: list[ScheduledRequest] | None = None) -> LaunchedStep | None:
        """Schedule (unless ``batch`` is given), plan the step and hand its device work to the device queue."""
        began = time.perf_counter()
        batch = self.scheduler.schedule() if batch is None else batch
        if not batch:
            return None
        t0 = time.perf_counter()
        prompt = prompt_rows(batch) if self.live.prompt_logprob_ids else None
        try:
            prepared = self.runner.prepare(batch, self.kv.tables.array, prompt.rows if prompt else None)
        except Exception as exc:  # a request's data does not fit the step's buffers; nothing has changed yet
            raise PrepareFailed(batch) from exc
        copies, swaps = self.kv.take_copies(), self.swap.take() if self.swap is not None else None
        advanced = self._advance(batch)
        sampling, failures = sampling_tensors(advanced.seqs, advanced.positions, self.runner.device)
        plan = StepPlan(prepared=prepared, copies=copies, swaps=swaps, sampling=sampling, prompt=prompt)
        plan_logits(plan, advanced, self.penalties, self.runner.device)
        handle = self.device.submit(lambda: self.device_step(plan))
        launched = LaunchedStep(
            batch=batch,
            seqs=advanced.seqs,
            forks=advanced.forks,
            handle=handle,
            t0=t0,
            prefill=advanced.prefill,
            decodes=advanced.decodes,
            failures=failures,
            prompt=prompt,
        )
        if handle.ran_inline:
            # Its compute ran just now, not while the host collects the step before: it is timed from the
            # end of the previous launch while that step is in flight (the pipeline's period, host work
            # included), else from the start of this one.
            done = time.perf_counter()
            launched.ran_s = done - (self._last_launched if self._launched_step is not None else began)
            self._last_launched = done
        return launched

    def _advance(self, batch: list[ScheduledRequest]) -> Advanced:
        """Advance every scheduled sequence as if the step had run, publish the blocks it fills, and fork
        what completes its prompt; the sequences the step samples, in the order of its tokens."""
        advanced = Advanced()
        bs = self.block_size
        for sr in batch:
            req, n = sr.request, sr.num_new_tokens
            sr.start = start = req.num_computed_tokens
            req.num_computed_tokens = end = start + n
            if end // bs > start // bs:
                # Published now: a request that hits these blocks runs after this step on the device.
                self.kv.cache_full_blocks(req)
            if n > 1:
                advanced.prefill += n
            else:
                advanced.decodes += 1
            if end == len(req.all_token_ids) + req.num_pending:  # its last known token: this step samples
                family = [req]
                if req.fork_pending:
                    family = self.live.fork(req)
                    advanced.forks.append(family)
                for seq in family:
                    advanced.positions.append(seq.num_tokens - seq.num_prompt_tokens)
                    seq.pending_row = len(advanced.seqs)
                    seq.num_pending += 1
                    advanced.seqs.append(seq)
                    advanced.rows.append(advanced.logits_rows)
                advanced.logits_rows += 1
        return advanced

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs: append them, publish the blocks
        it completed, apply stop conditions, retire finished sequences."""
        try:
            tokens, failures, logprobs = launched.handle.result()
        except Exception as exc:  # undone with the step launched on top of it; its requests rerun alone
            later, self._launched_step = self._launched_step, None
            return self.recovery.isolate(launched, later, exc)
        failures = {**launched.failures, **failures}
        if launched.prompt is not None:  # before the outputs: the first one carries the prompt's
            launched.prompt.score(logprobs, len(launched.seqs))
        outputs = []
        scores_prompts = bool(self.live.prompt_logprob_ids)  # before the loop: retiring a request drops its id
        for i, (req, token) in enumerate(zip(launched.seqs, tokens, strict=True)):
            req.num_pending -= 1
            if req.finish_reason is not None or req.request_id not in self.requests:  # ended while in flight
                continue
            try:
                if failures and i in failures:
                    raise failures[i]
                outputs.append(self._output(req, token, logprobs.get(i), scores_prompts))
            except Exception as exc:
                outputs.append(self.live.fail(req.request_id, exc))
        # A step's time is from its launch, or from the previous collection if it ran behind it: the period
        # of the pipeline, what one more step costs. A step that ran inline was timed at its launch.
        now = time.perf_counter()
        seconds = launched.ran_s if launched.ran_s is not None else now - max(launched.t0, self._last_collect)
        self.rates.observe(launched.prefill, launched.decodes, seconds, now)
        self._last_collect = now
        return outputs

    def _output(self, req: Request, token: int, logprob_row: LogprobRow | None, scores_prompts: bool) -> RequestOutput:
        """Append a sampled token to its sequence, publish a block it completes, retire the sequence if it
        ended; its output (with the token's log-probability, and the prompt's on its first token)."""
        filled = req.append_token(token)
        if filled and req.kv_row >= 0 and req.num_computed_tokens >= len(req.all_token_ids):
            self.kv.cache_full_blocks(req)  # a block whose KV was computed before its last token was known
        if req.finish_reason:
            self.rates.observe_finished(len(req.all_token_ids) - req.num_prompt_tokens)
            self.live.retire(req)
        out = RequestOutput.of(req, [token])
        if logprob_row is not None:
            out.logprobs = [token_logprob(token, logprob_row, req.params.logprobs)]
        first = scores_prompts and len(req.all_token_ids) == req.num_prompt_tokens + 1
        if first and req.params.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs  # with the first token
        return out

    def drain(self) -> list[RequestOutput]:
        """Collect the step in flight, if any (its outputs); the engine then holds no pending token."""
        previous, self._launched_step = self._launched_step, None
        outputs = self._collect(previous) if previous is not None else []
        self._flush_events()
        return outputs

    def _flush_events(self) -> None:
        events = self.events.take()
        if events:
            for sink in self.kv_event_sinks:
                sink(events)

    # ------------------------------------------------------------------ life cycle and observability
    def warm_up(self, batch: int = 8, steps: int = 4) -> None:
        """Prefill and decode a few dummy requests before serving, so routers get measured rates from the first
        request on and the kernels are built (``warm_up.py``); leaves no trace."""
        warm_up_engine(self, batch, steps)

    def close(self) -> None:
        """Release what outlives steps, once: collect the step in flight, stop the device queue's worker and,
        with a disk tier, write every block still cached (device pool and host tier) to it, for an engine
        started on the directory later, then stop its writer and free the directory's slot."""
        if self.closed:
            return
        self.closed = True
        self.drain()
        self.device.shutdown()
        if self.swap is not None and self.swap.disk is not None:
            cached = ((h, self.pool.lookup(h)) for h in self.pool.cached_hashes())
            self.swap.spill([(h, block.block_id) for h, block in cached if block is not None])
            self.swap.disk.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while requests hold blocks); sinks hear ``AllBlocksCleared``."""
        done = self.pool.reset()
        if done and self.swap is not None:
            self.swap.clear_cache()
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
        rows = [r.kv_row for r in self.kv.req_blocks]
        assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0, "sequences sharing a block-table row"
        for req in self.kv.req_blocks:
            table = self.kv.tables.array[req.kv_row, : len(self.kv.req_blocks[req])].tolist()
            assert table == self.kv.block_ids(req), f"block-table row of {req.request_id} out of date"

    def stats(self) -> EngineStats:
        """The engine's state in one read (the queues copied first: a step may be running in another thread):
        what the routers' load report, the autoscaler's KV pressure and ``kvmesh status`` are derived from."""
        s, pool, size, swap, rates = self.scheduler, self.pool, self.block_size, self.swap, self.rates
        waiting, running = tuple(s.waiting), tuple(s.running)  # one C-level copy each
        pending = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        pending += sum(
            r.num_tokens - r.num_computed_tokens for r in running if r.num_computed_tokens < r.num_tokens - 1
        )
        waiting_blocks = sum(-(-r.num_tokens // size) for r in waiting)
        disk = swap.disk if swap is not None else None
        return EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            pending_prefill_tokens=pending,
            kv_usage=pool.usage,
            kv_free_blocks=pool.num_free - waiting_blocks,
            kv_total_blocks=self.num_blocks,
            cache_fill=pool.fill,
            prefill_tok_s=rates.prefill_tok_s if rates.prefill_measured else None,
            decode_s_per_seq=rates.decode_s_per_seq,
            host_load_tok_s=swap.load_tok_s(size) if swap is not None and swap.cache_blocks else None,
            disk_load_tok_s=swap.disk_load_tok_s(size) if disk is not None else None,
            prefill_busy=rates.prefill_busy(time.perf_counter()),
            step_s=rates.step_s,
            mean_output_tokens=rates.mean_output_tokens,
            max_num_seqs=s.max_num_seqs,
            slot_free_steps=_slot_free_steps(running, rates.mean_output_tokens),
            loras=self.loras.resident() if self.loras is not None else [],
            lora_slots=self.loras.max_cpu_loras if self.loras is not None else 0,
            lora_load_s=self.loras.load_s if self.loras is not None else None,
            waiting_blocks=waiting_blocks,
            num_free_blocks=pool.num_free,
            num_cached_blocks=pool.num_cached_free,
            num_preemptions=s.num_preemptions,
            num_swapped_out=s.num_swapped_out,
            num_recomputed_tokens=s.num_recomputed_tokens,
            requests_admitted=s.requests_admitted,
            lora_reads=self.loras.reads if self.loras is not None else 0,
            prompt_tokens=s.prompt_tokens_queried,
            cached_prompt_tokens=s.prompt_tokens_hit,
            cached_prompt_tokens_host=s.prompt_tokens_hit_host,
            host_tier_blocks=swap.cache_blocks if swap is not None else 0,
            host_tier_used_blocks=swap.num_cached if swap is not None else 0,
            disk_tier_blocks=disk.num_blocks if disk is not None else 0,
            disk_tier_used_blocks=len(disk) if disk is not None else 0,
            disk_blocks_read=swap.disk_blocks_read if disk is not None else 0,
            disk_blocks_dropped=disk.dropped if disk is not None else 0,
        )


def _slot_free_steps(running: tuple[Request, ...], mean_output: float) -> float | None:
    """Decode steps until the first of ``running`` ends: the least of each one's expected remaining output,
    what its ``max_tokens`` leaves and, where it may stop sooner (EOS, stop ids or strings), at most what the
    mean output length leaves (at least one step). None when none runs."""
    best = None
    for r in running:
        done = r.num_tokens - r.num_prompt_tokens
        left = r.max_new_tokens - done
        if r.stop_ids or r.params.stop:
            left = min(left, max(mean_output - done, 1.0))
        best = left if best is None else min(best, left)
    return best
