"""The synchronous engine: add requests, ``step()`` until done. ``LLM`` and ``AsyncLLM`` wrap it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.kernels import check_block_size
from kvmesh.replica.block_pool import BlockPool
from kvmesh.replica.cpu_memory import keep_freed_memory
from kvmesh.replica.cuda_graphs import default_sizes
from kvmesh.replica.detokenizer import IncrementalDetokenizer
from kvmesh.replica.device_queue import DeviceQueue, StepHandle, StepLogprobs, StepResult
from kvmesh.replica.kv_cache_manager import KVCacheManager
from kvmesh.replica.kv_events import KVEvent
from kvmesh.replica.logit_bias import LogitBias
from kvmesh.replica.model_loader import load_model
from kvmesh.replica.model_runner import ModelRunner, PreparedStep, kv_bytes_per_block
from kvmesh.replica.outputs import RequestOutput
from kvmesh.replica.penalties import PenaltyCounts, StepPenalties
from kvmesh.replica.request import Request, RequestStatus
from kvmesh.replica.sampler import GREEDY, SamplingTensors, sample
from kvmesh.replica.scheduler import ScheduledRequest, Scheduler
from kvmesh.replica.structured import GrammarCompiler, GrammarRows
from kvmesh.replica.swap import SwapCopies, SwapSpace
from kvmesh.replica.telemetry import EngineSnapshot, EngineStats, StepRates
from kvmesh.shared.engine_config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_HOST_CACHE_FRACTION,
    GPU_KV_FRACTION,
    MAX_DEFAULT_HOST_CACHE_BYTES,
    MAX_DEFAULT_SWAP_BYTES,
    EngineConfig,
)
from kvmesh.shared.errors import InvalidRequest
from kvmesh.shared.hashing import BlockHash, first_block_extra, model_seed
from kvmesh.shared.limits import check_for_model, check_prompt_ids, check_request_fields
from kvmesh.shared.messages import TokenLogprob
from kvmesh.shared.model_files import apply_chat_template
from kvmesh.shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def _token_logprob(token: int, row: tuple[float, list[int], list[float]], k: int) -> TokenLogprob:
    """A sampled token's log-probability and its row's ``k`` most likely alternatives (the step computed
    as many as its most demanding row asked for)."""
    chosen, ids, values = row
    return TokenLogprob(token_id=token, logprob=chosen, top=list(zip(ids[:k], values[:k], strict=True)))


@dataclass(slots=True)
class _Launched:
    """A step handed to the device and not collected yet."""

    batch: list[ScheduledRequest]
    seqs: list[Request]
    """The sequences this step samples, in the order of its tokens."""
    forks: list[list[Request]]
    """Families forked when it was launched (parent first)."""
    handle: StepHandle
    t0: float
    prefill: int
    decodes: int
    failures: dict[int, Exception]
    """Rows already known to fail (their settings), by row."""
    prompt: _PromptRows | None = None
    ran_s: float | None = None
    """Its time, when the device ran it inside its launch (the CPU's inline queue); None: timed on collection."""


@dataclass(slots=True)
class _PromptRows:
    """The prompt positions of a step whose log-probabilities requests asked for (``prompt_logprobs``): the
    logits at ``rows`` (flattened batch positions, returned after the sampling rows) score ``targets``, the
    prompt tokens that follow them, for ``owners``; ``k`` alternatives, the most any of them asked for."""

    rows: list[int]
    targets: list[int]
    owners: list[Request]
    k: int


class _PrepareFailed(Exception):
    """A step's inputs could not be built: nothing was launched or changed."""

    def __init__(self, batch: list[ScheduledRequest]) -> None:
        super().__init__(f"preparing a step of {len(batch)} requests failed")
        self.batch = batch


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
        if device.type == "cpu":
            keep_freed_memory()  # activations reuse freed heap instead of faulting in fresh pages each step
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
        max_blocks_per_seq = -(-self.max_request_tokens // config.block_size) + 1
        self.runner = ModelRunner(
            self.loaded,
            num_blocks,
            config.block_size,
            config.kv_cache_dtype,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_blocks_per_seq,
        )
        self.rates = StepRates()
        self.swap = self._swap_space(device)
        windows = [layer.self_attn.window for layer in self.loaded.model.layers]
        sliding = None if None in windows else max(windows)  # blocks behind every layer's window are freed
        self.kv = KVCacheManager(
            self.pool,
            config.block_size,
            config.enable_prefix_caching,
            sliding,
            self.swap,
            config.max_num_seqs,
            max_blocks_per_seq,
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode)
        if device.type == "cuda" and not config.enforce_eager:
            sizes = [
                s for s in config.cuda_graph_sizes or default_sizes(config.max_num_seqs) if s <= config.max_num_seqs
            ]
            started = time.perf_counter()
            self.runner.capture_decode_graphs(sizes)
            log.info("captured %d CUDA graphs of decode steps in %.1f s", len(sizes), time.perf_counter() - started)
        self.hash_seed = model_seed(self.model_id)
        eos = self.loaded.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size, sorted(self.eos_token_ids))
        self.penalties = PenaltyCounts(self.runner.device)
        self.requests: dict[str, list[Request]] = {}
        self._prompt_logprob_ids: set[str] = set()
        """Live requests that report their prompt's log-probabilities: only then are batches scanned for them."""
        """Each live request's unfinished sequences (one, or up to ``n`` once forked)."""
        self.kv_event_sinks: list[Callable[[list[KVEvent]], None]] = []
        """Called with each step's KV events (the index publisher); they must not block."""
        self._ids = itertools.count()
        self.async_scheduling = config.async_scheduling
        self.device = DeviceQueue(device, config.async_scheduling and config.device_thread, config.torch_threads)
        self._inflight: _Launched | None = None
        self._last_tokens: torch.Tensor | None = None
        """The tokens of the last step run on the device (device work only touches it)."""
        self._last_collect = self._last_launched = 0.0
        """When the last step was collected, and when the last inline step finished its launch (step timing)."""
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%s) on %s",
            config.model,
            num_blocks,
            config.block_size,
            config.kv_cache_dtype,
            device,
        )

    def _swap_space(self, device: torch.device) -> SwapSpace | None:
        """The host tier: room for swapped-out sequences (``swap_space_bytes``, by default half the KV pool's
        bytes, at most 4 GiB) plus the host prefix cache (``host_cache_bytes``)."""
        per_block = self.bytes_per_block
        swap = self.config.swap_space_bytes
        if swap is None:
            swap = min(self.num_blocks * per_block // 2, MAX_DEFAULT_SWAP_BYTES)
        if self.config.preemption_mode == "recompute":
            swap = 0
        cache = self.config.host_cache_bytes
        if cache is None:
            pool_bytes = self.num_blocks * per_block
            default = min(int(pool_bytes * DEFAULT_HOST_CACHE_FRACTION), MAX_DEFAULT_HOST_CACHE_BYTES)
            cache = default if device.type == "cuda" else 0
        swap_blocks, cache_blocks = swap // per_block, cache // per_block
        if swap_blocks + cache_blocks < 1:
            return None
        return SwapSpace(
            self.runner.kv_caches, swap_blocks + cache_blocks, lambda: self.rates.prefill_tok_s, cache_blocks
        )

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
        if params.json_schema is not None:
            req.matcher = self.grammars.matcher(params.json_schema)
        if params.presence_penalty or params.frequency_penalty:
            req.penalty_row = self.penalties.assign()
        if params.prompt_logprobs is not None:
            self._prompt_logprob_ids.add(request_id)
        self.requests[request_id] = [req]
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request (all its sequences) and free its blocks at once; False if unknown or finished."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for req in seqs:
            self._end(req, "abort")
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

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
        row of logits is sampled once per sequence, and its sequences share the prompt's blocks.

        A request whose data makes a step fail is failed alone (an output with ``finish_reason`` "error"
        and the cause in ``error``): the step (and any launched after it) is undone and run again one
        request at a time to find it, and every other request gets exactly the tokens it would have got."""
        try:
            launched = self._launch()
        except _PrepareFailed as failed:  # nothing was launched: run the batch one request at a time
            log.warning("preparing a step of %d requests failed (%r)", len(failed.batch), failed.__cause__)
            outputs = self.drain() + self._run_alone(failed.batch)
        else:
            if self.async_scheduling:
                launched, self._inflight = self._inflight, launched
            outputs = self._collect(launched) if launched is not None else []
        self._flush_events()
        return outputs

    def _launch(self, batch: list[ScheduledRequest] | None = None) -> _Launched | None:
        """Schedule (unless ``batch`` is given), advance every scheduled sequence as if the step had run,
        fork what completes its prompt, and hand the step's device work to the device queue."""
        began = time.perf_counter()
        batch = self.scheduler.schedule() if batch is None else batch
        if not batch:
            return None
        t0 = time.perf_counter()
        prompt = self._prompt_rows(batch) if self._prompt_logprob_ids else None
        try:
            prepared = self.runner.prepare(batch, self.kv.tables.array, prompt.rows if prompt else None)
        except Exception as exc:  # a request's data does not fit the step's buffers; nothing has changed yet
            raise _PrepareFailed(batch) from exc
        copies = self.kv.take_copies()
        swaps = self.swap.take() if self.swap is not None else None
        seqs: list[Request] = []
        rows: list[int] = []
        positions: list[int] = []
        forks: list[list[Request]] = []
        prefill = decodes = logits_row = 0
        bs = self.block_size
        for sr in batch:
            req, n = sr.request, sr.num_new_tokens
            sr.start = start = req.num_computed_tokens
            req.num_computed_tokens = end = start + n
            if end // bs > start // bs:
                # Published now: a request that hits these blocks runs after this step on the device.
                self.kv.cache_full_blocks(req)
            if n > 1:
                prefill += n
            else:
                decodes += 1
            if end == len(req.all_token_ids) + req.num_pending:  # its last known token: this step samples
                family = [req]
                if req.fork_pending:
                    family = self._fork(req)
                    forks.append(family)
                for seq in family:
                    positions.append(seq.num_tokens - seq.num_prompt_tokens)
                    seq.pending_row = len(seqs)
                    seq.num_pending += 1
                    seqs.append(seq)
                    rows.append(logits_row)
                logits_row += 1
        sampling, failures = self._sampling_tensors(seqs, positions)
        special = [i for i, seq in enumerate(seqs) if seq.logit_work]  # one scan; most steps find none
        bias = LogitBias.build(seqs, positions, special, self.runner.device) if special else None
        wants = [i for i in special if seqs[i].params.logprobs is not None]
        constrained = [i for i in special if seqs[i].matcher is not None]
        grammar = GrammarRows(constrained, [seqs[i].matcher for i in constrained]) if constrained else None
        top_k = max((seqs[i].params.logprobs for i in wants), default=0)
        penalised = [i for i in special if seqs[i].penalty_row >= 0]
        penalties = None
        if penalised or self.penalties.has_work:
            ps = [seqs[i].params for i in penalised]
            slots = [seqs[i].penalty_row for i in penalised]
            presence, frequency = [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps]
            penalties = self.penalties.step(penalised, slots, presence, frequency)
        expand = torch.tensor(rows) if len(rows) > logits_row else None
        scored = None
        if prompt is not None:
            scored = (len(prompt.rows), torch.tensor(prompt.targets), prompt.k)
        work = functools.partial(
            self._device_step,
            prepared,
            copies,
            swaps,
            sampling,
            bias,
            penalties,
            grammar,
            wants,
            top_k,
            expand,
            scored,
        )
        launched = _Launched(batch, seqs, forks, self.device.submit(work), t0, prefill, decodes, failures, prompt)
        if launched.handle.ran_inline:
            # Its compute ran just now, not while the host collects the step before: it is timed from the
            # end of the previous launch while that step is in flight (the pipeline's period, host work
            # included), else from the start of this one.
            done = time.perf_counter()
            launched.ran_s = done - (self._last_launched if self._inflight is not None else began)
            self._last_launched = done
        return launched

    @staticmethod
    def _prompt_rows(batch: list[ScheduledRequest]) -> _PromptRows | None:
        """The positions of ``batch`` (before it advances) whose logits score a prompt token that a request
        wants the log-probability of and has not been given yet."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Request] = []
        k, offset = 0, 0
        for sr in batch:
            req, n = sr.request, sr.num_new_tokens
            want = req.params.prompt_logprobs
            if want is not None:
                start, prompt = req.num_computed_tokens, req.prompt_token_ids
                first = max(start, len(req.prompt_logprobs))  # position p scores token p + 1
                last = min(start + n, len(prompt) - 1)
                if first < last:
                    rows += range(offset + first - start, offset + last - start)
                    targets += prompt[first + 1 : last + 1]
                    owners += [req] * (last - first)
                    k = max(k, want)
            offset += n
        return _PromptRows(rows, targets, owners, k) if rows else None

    def _sampling_tensors(self, seqs: list[Request], positions: list[int]) -> tuple[SamplingTensors, dict]:
        """The step's sampling settings; a row whose settings cannot be turned into tensors is sampled
        greedily and failed when the step is collected (the others are not affected)."""
        device = self.runner.device
        params = [r.params for r in seqs]
        if all(p.greedy for p in params):
            return GREEDY, {}
        values = [
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
            [r.sample_seed for r in seqs],
            positions,
        ]
        try:
            return SamplingTensors.build(*values, device), {}
        except Exception:
            failures: dict[int, Exception] = {}
            for i in range(len(seqs)):
                try:
                    SamplingTensors.build(*([column[i]] for column in values), device)
                except Exception as exc:
                    failures[i] = exc
                    for column, neutral in zip(values, (0.0, 0, 1.0, 0.0, 0, 0), strict=True):
                        column[i] = neutral
            return SamplingTensors.build(*values, device), failures

    def _device_step(
        self,
        prepared: PreparedStep,
        copies: list[tuple[int, int]],
        swaps: SwapCopies | None,
        sampling: SamplingTensors,
        bias: LogitBias | None,
        penalties: StepPenalties | None,
        grammar: GrammarRows | None,
        wants_logprobs: list[int],
        top_logprobs: int,
        expand: torch.Tensor | None,
        scored: tuple[int, torch.Tensor, int] | None = None,
    ) -> StepResult:
        """A step's device work, in launch order (``kvmesh/replica/device_queue.py``): block copies, the forward
        pass, logit biases, penalties and grammar masks, sampling (then the penalty counts), and the
        log-probabilities of the rows in ``wants_logprobs`` (the sampled token's and the ``top_logprobs`` most
        likely). ``scored``: (count, target tokens, alternatives) of the prompt positions whose logits follow
        the sampling rows; their log-probabilities come back as rows numbered after the sampled ones. A row
        whose sampling fails alone gets token 0 and its exception."""
        if swaps is not None:
            self.swap.copy_out(swaps)  # before anything writes the blocks they leave
        self.runner.copy_blocks(copies)
        if swaps is not None:
            self.swap.copy_in(swaps)
        logits = self.runner.forward(prepared, self._last_tokens)
        prompt_lp = None
        if scored is not None:  # the prompt positions' rows come after the sampling rows
            count, targets, prompt_k = scored
            prompt_lp = torch.log_softmax(logits[-count:].float(), dim=-1)
            logits = logits[:-count]
        if expand is not None:
            logits = logits[expand.to(logits.device)]
        raw = None
        if wants_logprobs:  # from the raw logits: before biases and the sampler's in-place scaling
            raw = torch.log_softmax(logits[torch.tensor(wants_logprobs, device=logits.device)].float(), dim=-1)
        if bias is not None:
            bias.apply(logits)
        if penalties is not None:
            self.penalties.apply(penalties, logits)
        if grammar is not None:
            grammar.mask(logits)
        failures: dict[int, Exception] = {}
        try:
            tokens = sample(logits, sampling)
        except Exception as exc:
            log.warning("sampling %d rows failed (%r); sampling them one at a time", logits.shape[0], exc)
            tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
            for i in range(logits.shape[0]):
                try:
                    tokens[i] = sample(logits[i : i + 1], sampling.row(i))[0]
                except Exception as row_exc:
                    failures[i] = row_exc
        self._last_tokens = tokens
        if penalties is not None:
            self.penalties.count(penalties, tokens)
        if grammar is not None:
            failures.update(grammar.accept(tokens))
        logprobs = None
        if raw is not None or prompt_lp is not None:
            k = max(top_logprobs, prompt_k if prompt_lp is not None else 0)
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (log-probabilities, scored token) per row
            rows = list(wants_logprobs)
            if raw is not None:
                parts.append((raw, tokens[torch.tensor(wants_logprobs, device=tokens.device)]))
            if prompt_lp is not None:
                parts.append((prompt_lp, targets.to(prompt_lp.device)))
                rows += range(tokens.shape[0], tokens.shape[0] + prompt_lp.shape[0])
            values = torch.cat([lp for lp, _ in parts])
            scored_ids = torch.cat([ids for _, ids in parts])
            top, top_ids = values.topk(k, dim=-1) if k else (values[:, :0], values[:, :0].long())
            logprobs = StepLogprobs(rows, values.gather(1, scored_ids[:, None])[:, 0], top_ids, top)
        return tokens, failures, logprobs

    def _collect(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs: append them, publish the blocks
        it completed, apply stop conditions, retire finished sequences."""
        try:
            tokens, failures, logprobs = launched.handle.result()
        except Exception as exc:
            return self._isolate(launched, exc)
        failures = {**launched.failures, **failures}
        if launched.prompt is not None:  # before the outputs: the first one carries the prompt's
            base, p = len(launched.seqs), launched.prompt
            for j, (req, target) in enumerate(zip(p.owners, p.targets, strict=True)):
                req.prompt_logprobs.append(_token_logprob(target, logprobs[base + j], req.params.prompt_logprobs))
        outputs = []
        requests = self.requests
        output = RequestOutput.of
        scores_prompts = bool(self._prompt_logprob_ids)  # before the loop: retiring a request drops its id
        for i, (req, token) in enumerate(zip(launched.seqs, tokens, strict=True)):
            req.num_pending -= 1
            if req.finish_reason is not None or req.request_id not in requests:  # ended while in flight
                continue
            try:
                if failures and i in failures:
                    raise failures[i]
                filled = req.append_token(token)
                if filled and req.kv_row >= 0 and req.num_computed_tokens >= len(req.all_token_ids):
                    self.kv.cache_full_blocks(req)  # a block whose KV was computed before its last token was known
                if req.finish_reason:
                    self.rates.observe_finished(len(req.all_token_ids) - req.num_prompt_tokens)
                    self._retire(req)
                out = output(req, [token])
                if i in logprobs:
                    out.logprobs = [_token_logprob(token, logprobs[i], req.params.logprobs)]
                first = scores_prompts and len(req.all_token_ids) == req.num_prompt_tokens + 1
                if first and req.params.prompt_logprobs is not None:
                    out.prompt_logprobs = req.prompt_logprobs  # with the first token
                outputs.append(out)
            except Exception as exc:
                outputs.append(self._fail(req.request_id, exc))
        # A step's time is from its launch, or from the previous collection if it ran behind it: the period
        # of the pipeline, what one more step costs. A step that ran inline was timed at its launch.
        now = time.perf_counter()
        seconds = launched.ran_s if launched.ran_s is not None else now - max(launched.t0, self._last_collect)
        self.rates.observe(launched.prefill, launched.decodes, seconds, now)
        self._last_collect = now
        return outputs

    def _isolate(self, launched: _Launched, exc: Exception) -> list[RequestOutput]:
        """A step failed on the device. Undo it (and the step launched on top of it, which read its tokens),
        then run its requests again one at a time: the ones that fail alone are failed, the others get
        exactly the tokens the step would have given them."""
        log.warning("a step of %d requests failed (%r); running them one at a time", len(launched.batch), exc)
        later, self._inflight = self._inflight, None
        if later is not None and later is not launched:
            with contextlib.suppress(Exception):
                later.handle.result()
            self._undo(later)
        self._undo(launched)
        return self._run_alone(launched.batch)

    def _run_alone(self, batch: list[ScheduledRequest]) -> list[RequestOutput]:
        """Run each still-running request of ``batch`` as a step of its own, to completion; a request whose
        step fails is failed."""
        outputs: list[RequestOutput] = []
        for sr in batch:
            req = sr.request
            if req.status is not RequestStatus.RUNNING or req.request_id not in self.requests:
                continue
            try:
                single = self._launch([ScheduledRequest(req, sr.num_new_tokens)])
                single.handle.result()
            except _PrepareFailed as err:
                outputs.append(self._fail(req.request_id, err.__cause__))
                continue
            except Exception as err:
                self._undo(single)
                outputs.append(self._fail(req.request_id, err))
                continue
            outputs += self._collect(single)
        return outputs

    def _undo(self, launched: _Launched) -> None:
        """Take back what launching a step did on the host: pending tokens, forks, computed positions. A
        sequence preempted since is reset to recompute from scratch (what it kept may include the step)."""
        for seq in launched.seqs:
            seq.num_pending -= 1
        for family in launched.forks:
            parent, children = family[0], family[1:]
            for child in children:
                self._end(child, "abort")
            if parent.request_id in self.requests:
                self.requests[parent.request_id] = [parent]
            parent.fork_pending = True
        for sr in launched.batch:
            req = sr.request
            if req.status is RequestStatus.RUNNING:
                req.num_computed_tokens = sr.start
            elif req.status is RequestStatus.WAITING and req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0

    def _fail(self, request_id: str, exc: BaseException) -> RequestOutput:
        """End a request (all its sequences) that made the step fail; its output names the cause."""
        seqs = self.requests.pop(request_id, [])
        for req in seqs:
            self._end(req, "error")
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

    def drain(self) -> list[RequestOutput]:
        """Collect the step in flight, if any (its outputs); the engine then holds no pending token."""
        previous, self._inflight = self._inflight, None
        outputs = self._collect(previous) if previous is not None else []
        self._flush_events()
        return outputs

    def _fork(self, req: Request) -> list[Request]:
        family = self.scheduler.fork(req)
        for child in family[1:]:
            if child.penalty_row >= 0:  # its own counts (still empty: forks come before any output)
                child.penalty_row = self.penalties.assign()
        self.requests[req.request_id] = list(family)
        return family

    def _end(self, req: Request, reason: str | None) -> None:
        """Finish a sequence in the scheduler (its blocks) and free its penalty counts."""
        self.scheduler.finish(req, reason)
        self._prompt_logprob_ids.discard(req.request_id)
        if req.penalty_row >= 0:
            self.penalties.release(req.penalty_row)
            req.penalty_row = -1

    def _retire(self, req: Request) -> None:
        """A sequence stopped: free its blocks; the request ends with its last sequence."""
        self._end(req, req.finish_reason)
        seqs = self.requests[req.request_id]
        seqs.remove(req)
        if not seqs:
            del self.requests[req.request_id]

    # ------------------------------------------------------------------ observability
    def _flush_events(self) -> None:
        events = self.pool.take_events()
        if events:
            for sink in self.kv_event_sinks:
                sink(events)

    def warm_up(self, batch: int = 8, steps: int = 4) -> None:
        """Prefill and decode a few dummy requests before serving.

        Routers turn queues into seconds with the replica's measured prefill rate and weigh a decode batch by
        its marginal cost per sequence, which a replica can only measure from steps of different sizes;
        without this, a fresh replica would report nothing until traffic happened to vary its batch, and
        routers would guess. The first prefill builds kernels and runs slower than serving will (the tiny test
        model: 56k against 100k tokens/s), so the rate reported comes from a second one. It also warms the
        kernels, so the first user does not pay for it. Leaves no trace: blocks, cache and counters are reset.
        """
        n = max(2, min(batch, self.scheduler.max_num_seqs))
        params = SamplingParams(max_tokens=2 * steps + 2, temperature=0, ignore_eos=True)
        vocab = self.loaded.config.vocab_size
        per_seq = max(1, min(4, self.num_blocks // n - 1, self.config.max_num_batched_tokens // (n * self.block_size)))

        def prompts(first: int) -> list[str]:
            """``n`` prompts of ``per_seq`` blocks no earlier prompt shares, added; their ids."""
            tokens = per_seq * self.block_size
            return [
                self.add_request([(first + 97 * i + k) % vocab for k in range(tokens)], params, f"warm-up-{first}-{i}")
                for i in range(n)
            ]

        cold = prompts(1000)
        self.step()  # prefill all, cold
        for rid in cold:
            self.abort_request(rid)
        self.drain()
        self.rates.forget_prefill()
        rids = prompts(5000)
        self.step()  # prefill all again: the rate routers are told
        for running in (n, 1):
            for rid in rids[running:]:
                self.abort_request(rid)
            for _ in range(steps):
                self.step()
        for rid in rids:
            self.abort_request(rid)
        self.drain()
        self.reset_prefix_cache()
        self.scheduler.reset_counters()

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

    def snapshot(self) -> EngineSnapshot:
        """The engine's state in one read (the queues copied first: a step may be running in another
        thread): what the routers' load report, the autoscaler's KV pressure and ``stats`` are made of."""
        s, pool, size = self.scheduler, self.pool, self.block_size
        waiting, running = tuple(s.waiting), tuple(s.running)  # one C-level copy each
        pending = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        pending += sum(
            r.num_tokens - r.num_computed_tokens for r in running if r.num_computed_tokens < r.num_tokens - 1
        )
        return EngineSnapshot(
            num_running=len(running),
            num_waiting=len(waiting),
            pending_prefill_tokens=pending,
            waiting_blocks=sum(-(-r.num_tokens // size) for r in waiting),
            num_blocks=self.num_blocks,
            num_free_blocks=pool.num_free,
            num_evictable_blocks=pool.num_cached_free,
            kv_usage=pool.usage,
            cache_fill=pool.fill,
            max_num_seqs=s.max_num_seqs,
            num_preemptions=s.num_preemptions,
            num_swapped_out=s.num_swapped_out,
            num_recomputed_tokens=s.num_recomputed_tokens,
            requests_admitted=s.requests_admitted,
            prompt_tokens=s.prompt_tokens_queried,
            cached_prompt_tokens=s.prompt_tokens_hit,
            cached_prompt_tokens_host=s.prompt_tokens_hit_host,
            host_cache_blocks=self.swap.cache_blocks if self.swap is not None else 0,
            host_cached_blocks=self.swap.num_cached if self.swap is not None else 0,
            host_load_tok_s=self.swap.load_tok_s(size) if self.swap is not None and self.swap.cache_blocks else None,
            prefill_tok_s=self.rates.prefill_tok_s if self.rates.prefill_measured else None,
            decode_s_per_seq=self.rates.decode_s_per_seq,
            step_s=self.rates.step_s,
            mean_output_tokens=self.rates.mean_output_tokens,
            prefill_busy=self.rates.prefill_busy(time.perf_counter()),
        )

    def stats(self) -> EngineStats:
        return self.snapshot().stats()
