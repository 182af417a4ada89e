"""How fast an engine is: ``StepRates`` turns step timings into the rates routers price queues with, and
``BusyShare`` keeps how busy its prefill was lately. They feed ``LLMEngine.stats`` (``core/messages.py``'s
``EngineStats``), from which every report is derived."""

from __future__ import annotations

from kvmesh.core.defaults import DEFAULT_MEAN_OUTPUT_TOKENS, DEFAULT_PREFILL_TOK_S, DEFAULT_STEP_S
from kvmesh.core.messages import BUSY_WINDOW_S
from kvmesh.router.sessions import decayed


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
