"""What an engine tells the world about itself: its measured speed and one snapshot of its state.

``StepRates`` turns step timings into the rates routers price queues with. ``EngineSnapshot`` is read once
(``LLMEngine.snapshot``) and every report is derived from it: the routers' ``LoadReport``
(``kvmesh/shared/messages.py``), the autoscaler's KV pressure and the ``EngineStats`` of ``kvmesh status``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.sessions import decayed
from kvmesh.shared.defaults import DEFAULT_MEAN_OUTPUT_TOKENS, DEFAULT_PREFILL_TOK_S, DEFAULT_STEP_S
from kvmesh.shared.messages import BUSY_WINDOW_S, EngineStats, KVPressure, LoadReport


@dataclass
class EngineSnapshot:
    num_running: int
    num_waiting: int
    pending_prefill_tokens: int
    """Prompt tokens still to prefill: the waiting requests' and those of running requests mid-prefill."""
    waiting_blocks: int
    """Blocks the waiting requests' tokens will need."""
    num_blocks: int
    num_free_blocks: int
    """Blocks an allocation may take: empty plus evictable cached ones."""
    num_evictable_blocks: int
    kv_usage: float
    cache_fill: float
    max_num_seqs: int
    num_preemptions: int
    num_swapped_out: int
    num_recomputed_tokens: int
    requests_admitted: int
    prompt_tokens: int
    cached_prompt_tokens: int
    cached_prompt_tokens_host: int
    host_tier_blocks: int
    host_tier_used_blocks: int
    disk_tier_blocks: int
    disk_tier_used_blocks: int
    disk_blocks_read: int
    disk_blocks_dropped: int
    host_load_tok_s: float | None
    """Prompt tokens per second loaded back from the host tier (None: no host prefix tier)."""
    disk_load_tok_s: float | None
    prefill_tok_s: float | None
    """None until measured: routers then assume what the replica's peers measured."""
    decode_s_per_seq: float | None
    step_s: float
    mean_output_tokens: float
    prefill_busy: float = 0.0
    """Share of the last ``BUSY_WINDOW_S`` spent prefilling (moving average)."""

    def load_report(self, index_id: str, reported_at: float) -> LoadReport:
        """For routers: the wait a newcomer would see here. ``kv_free_blocks`` is what it could take once
        the queue ahead of it is admitted, so a long prompt does not go where it would wait for running
        sequences to finish while another pool has room."""
        return LoadReport(
            index_id=index_id,
            reported_at=reported_at,
            pending_prefill_tokens=self.pending_prefill_tokens,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_usage=self.kv_usage,
            kv_free_blocks=self.num_free_blocks - self.waiting_blocks,
            kv_total_blocks=self.num_blocks,
            cache_fill=self.cache_fill,
            prefill_tok_s=self.prefill_tok_s,
            prefill_busy=self.prefill_busy,
            host_load_tok_s=self.host_load_tok_s,
            disk_load_tok_s=self.disk_load_tok_s,
            decode_s_per_seq=self.decode_s_per_seq,
            step_s=self.step_s,
            mean_output_tokens=self.mean_output_tokens,
            max_num_seqs=self.max_num_seqs,
        )

    def kv_pressure(self, preemptions_seen: int = 0) -> KVPressure:
        """For the autoscaler (``kvmesh/cluster/autoscaling.py``): blocks pinned by requests (evictable cached ones
        are free capacity, not demand), blocks the waiting prompts will need, the pool, the queue, and the
        preemptions since the count ``preemptions_seen``."""
        return KVPressure(
            kv_used_blocks=self.num_blocks - self.num_free_blocks,
            kv_waiting_blocks=self.waiting_blocks,
            kv_total_blocks=self.num_blocks,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            preemptions=self.num_preemptions - preemptions_seen,
        )

    def stats(self) -> EngineStats:
        """For ``kvmesh status`` and the metrics."""
        return EngineStats(
            kv_usage=self.kv_usage,
            prefix_hit_rate=self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions,
            num_swapped_out=self.num_swapped_out,
            num_recomputed_tokens=self.num_recomputed_tokens,
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=self.num_evictable_blocks,
            requests_admitted=self.requests_admitted,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            cached_prompt_tokens_host=self.cached_prompt_tokens_host,
            host_hit_rate=self.cached_prompt_tokens_host / self.prompt_tokens if self.prompt_tokens else 0.0,
            host_tier_blocks=self.host_tier_blocks,
            host_tier_used_blocks=self.host_tier_used_blocks,
            disk_tier_blocks=self.disk_tier_blocks,
            disk_tier_used_blocks=self.disk_tier_used_blocks,
            disk_blocks_read=self.disk_blocks_read,
            disk_blocks_dropped=self.disk_blocks_dropped,
            prefill_busy=self.prefill_busy,
        )


class BusyShare:
    """The share of recent time something was busy: busy seconds added as they happen, fading as
    ``exp(-age / window_s)``, over ``window_s`` (1 when busy without a pause for several windows)."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self._sum, self._at = 0.0, 0.0

    def at(self, now: float) -> float:
        return min(decayed(self._sum, now - self._at, self.window_s) / self.window_s, 1.0)

    def add(self, now: float, seconds: float) -> None:
        self._sum = decayed(self._sum, now - self._at, self.window_s) + seconds
        self._at = now


class StepRates:
    """Running estimates of this engine's speed, reported to routers to turn queues into seconds.

    ``prefill_tok_s`` comes from steps dominated by prefill (an exponential moving average).
    ``decode_s_per_seq`` is the *marginal* cost of one more running sequence in a decode step: the slope of
    ``step_s = base + slope * running`` fitted by exponentially weighted least squares over pure-decode
    steps. It stays unmeasured (``None``) until steps of different batch sizes were seen; a serving replica
    runs ``LLMEngine.warm_up`` first, so it reports a measured slope from its first request on.
    ``prefill_busy`` is the share of recent time spent prefilling (a step that is nearly all prefill counts
    whole; in a mixed step its prefill tokens at the measured rate, at most the step), a moving average over
    ``BUSY_WINDOW_S``: how loaded routers price churn. Counting prefill steps whole keeps the share right
    when another process slows them: the rate's moving average lags such steps and would undercount them.
    """

    def __init__(self, alpha: float = 0.2, decode_alpha: float = 0.05) -> None:
        self.prefill_tok_s = DEFAULT_PREFILL_TOK_S
        self.step_s = DEFAULT_STEP_S
        self.mean_output_tokens = DEFAULT_MEAN_OUTPUT_TOKENS
        self.alpha = alpha
        self.decode_alpha = decode_alpha
        self.prefill_measured = False
        self._fit = [0.0] * 5  # weighted sums: 1, x, y, xx, xy (x = running, y = step seconds)
        self._prefill = BusyShare()

    def forget_prefill(self) -> None:
        """Drop the prefill rate and busy time measured so far (cold warm-up steps): the next prefill-dominated
        step sets the rate afresh."""
        self.prefill_measured = False
        self._prefill = BusyShare()

    def observe_finished(self, output_tokens: int) -> None:
        self.mean_output_tokens += self.alpha * (output_tokens - self.mean_output_tokens)

    def prefill_busy(self, now: float) -> float:
        """Share of the ``BUSY_WINDOW_S`` before ``now`` (``time.perf_counter`` seconds) spent prefilling."""
        return self._prefill.at(now)

    def observe(self, prefill: int, decodes: int, seconds: float, now: float | None = None) -> None:
        """One step, ending at ``now`` (``time.perf_counter``; None: not timed): ``prefill`` tokens of chunks
        longer than one token, ``decodes`` one-token sequences."""
        mostly_prefill = prefill >= 64 and prefill >= 8 * decodes
        if now is not None:  # a step that is nearly all prefill spent its whole time on it, however long it took
            self._prefill.add(now, seconds if mostly_prefill else min(prefill / self.prefill_tok_s, seconds))
        a = self.alpha
        self.step_s += a * (seconds - self.step_s)
        if mostly_prefill:
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
    def decode_s_per_seq(self) -> float | None:
        w, sx, sy, sxx, sxy = self._fit
        if w == 0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var < 0.25:  # batch sizes barely varied: base and slope cannot be told apart yet
            return None
        # One more sequence cannot cost more than a whole recent step: the fit forgets slowly, and warm-up
        # steps on shared cores would otherwise price every running sequence at a slow step for long.
        return min(max((sxy / w - mx * my) / var, 0.0), my, self.step_s)
