"""Benchmark workloads: seeded generators that all produce the same request format, ``Session``s of ``Step``s.

A session is what one user does: it starts at ``start_s`` (open-loop arrivals: Poisson or trace
timestamps) and sends its steps in order, each after the previous reply plus ``think_s``. A chat session's
history grows turn by turn with the replies the server actually generated (so turn k+1 can reuse turn k's
prompt and reply); a single-shot workload is sessions of one step.

Text is drawn from a fixed list of common words that are one token each (with their leading space) in
SmolLM2's vocabulary, so ``*_tokens`` knobs are close to real token counts.

- ``multi_turn_chat``: the shape of vLLM's multi-turn benchmark scaled for CPU: a system prompt shared by
  every conversation, a per-conversation context document, user turns, replies.
- ``shared_prefix``: the shape of SGLang's generated-shared-prefix benchmark: G groups of P prompts, each
  a group system prompt of S tokens plus a Q-token question.
- ``mooncake_trace``: replay of a Mooncake-format trace; each 512-token hash id becomes one deterministic
  block of ``block_tokens`` token ids, so the prefix structure is kept at CPU scale; timestamps / speed.
- ``build_workload``: one of these (or a generated trace of ``trace_workloads.py``) as ``kvmesh bench run``'s
  options choose it, with a warm-up of another seed.
- ``StepPrompts`` / ``step_workload``: ``kvmesh bench autoscale``'s load, short prompts then long ones (a step
  or a ramp), on random token ids so that only KV demand changes.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from kvmesh.bench.harness.trace_workloads import WORKLOADS as TRACE_WORKLOADS

WORDS = """time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home
water room mother area money story fact month lot right study book eye job word business issue side kind
head house service friend father power hour game line end member law car city community name president
team minute idea kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force education cache
router block token replica server model prompt batch queue memory prefix index cluster request reply
answer river mountain garden window paper music light summer winter green blue red small large early late
fast slow good new old great high long little own other""".split()  # noqa: SIM905


@dataclass
class Step:
    """One request: a chat user message (``text`` in a chat session) or a completion prompt."""

    text: str | None = None
    token_ids: list[int] | None = None
    max_tokens: int = 32
    think_s: float = 0.0
    """Pause after the previous step's reply, before this one is sent."""


@dataclass
class Session:
    session_id: str
    start_s: float
    steps: list[Step]
    system: str | None = None
    chat: bool = True
    """Chat sessions use /v1/chat/completions with the growing history; others /v1/completions."""
    model: str | None = None
    """The model its requests name (a LoRA adapter); None: the served model."""
    labels: dict = field(default_factory=dict)


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _poisson_starts(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return out


def multi_turn_chat(
    seed: int = 0,
    conversations: int = 24,
    turns: int = 4,
    rate: float = 0.5,
    system_tokens: int = 120,
    context_tokens: int = 300,
    user_tokens: int = 20,
    max_tokens: int = 24,
    think_s: float = 1.0,
) -> list[Session]:
    """``conversations`` chats starting at ``rate`` per second (Poisson); each sends ``turns`` user messages,
    the first carrying a per-conversation context document of ``context_tokens``."""
    rng = random.Random(seed)
    system = f"You are assistant {seed} of a support team. " + _text(random.Random(-1 - seed), system_tokens)
    sessions = []
    for c, start in enumerate(_poisson_starts(rng, conversations, rate)):
        context = f"Here is the document for case {seed}-{c}: {_text(rng, context_tokens)}"
        steps = [
            Step(
                text=(context + "\n\nQuestion: " if t == 0 else "") + _text(rng, user_tokens) + "?",
                max_tokens=max_tokens,
                think_s=0.0 if t == 0 else think_s,
            )
            for t in range(turns)
        ]
        sessions.append(Session(f"conv-{seed}-{c}", start, steps, system=system, labels={"conversation": c}))
    return sessions


def shared_prefix(
    seed: int = 0,
    groups: int = 8,
    prompts_per_group: int = 8,
    system_tokens: int = 400,
    question_tokens: int = 30,
    max_tokens: int = 16,
    rate: float = 2.0,
) -> list[Session]:
    """G x P single-turn chats in random order, Poisson arrivals at ``rate`` per second."""
    rng = random.Random(seed)
    systems = [f"Group {g} instructions: {_text(rng, system_tokens)}" for g in range(groups)]
    pairs = [(g, p) for g in range(groups) for p in range(prompts_per_group)]
    rng.shuffle(pairs)
    return [
        Session(
            f"sp-{seed}-{g}-{p}",
            start,
            [Step(text=_text(rng, question_tokens) + "?", max_tokens=max_tokens)],
            system=systems[g],
            labels={"group": g},
        )
        for (g, p), start in zip(pairs, _poisson_starts(rng, len(pairs), rate), strict=True)
    ]


def block_tokens_for(hash_id: int, k: int, vocab: tuple[int, int] = (1000, 40000)) -> list[int]:
    """The deterministic ``k`` token ids standing for trace block ``hash_id``."""
    seed = xxhash.xxh64_intdigest(f"mooncake-block-{hash_id}".encode())
    return np.random.default_rng(seed).integers(vocab[0], vocab[1], size=k).tolist()


def mooncake_trace(
    path: str | Path,
    block_tokens: int = 16,
    speed: float = 1.0,
    limit: int | None = None,
    offset: int = 0,
    max_output_tokens: int = 32,
) -> list[Session]:
    """Rows ``offset .. offset+limit`` of a Mooncake trace file as completion sessions (``trace_sessions``)."""
    with Path(path).open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[offset : offset + limit if limit else None]
    if not rows:
        raise ValueError(f"{path}: no trace rows in the requested range")
    return trace_sessions(rows, block_tokens, speed, max_output_tokens, offset)


def trace_sessions(
    rows: list[dict], block_tokens: int = 16, speed: float = 1.0, max_output_tokens: int = 32, first: int = 0
) -> list[Session]:
    """Mooncake-format rows (a file's, or ``benchmarks/harness/trace_workloads.py``'s) as completion sessions on token
    ids. Lengths scale by ``block_tokens / 512`` (every 512-token block becomes ``block_tokens`` tokens);
    output lengths scale the same way, capped at ``max_output_tokens``; arrival times are divided by
    ``speed``. ``first``: the first row's number, for the labels."""
    sessions = []
    scale = block_tokens / 512
    t0 = rows[0]["timestamp"]
    for i, row in enumerate(rows):
        ids = [t for h in row["hash_ids"] for t in block_tokens_for(h, block_tokens)]
        out = max(1, min(max_output_tokens, round(row["output_length"] * scale)))
        sessions.append(
            Session(
                f"trace-{first + i}",
                (row["timestamp"] - t0) / 1000 / speed,
                [Step(token_ids=ids, max_tokens=out)],
                chat=False,
                labels={"row": first + i},
            )
        )
    return sessions


WORKLOADS = {"multi_turn": multi_turn_chat, "shared_prefix": shared_prefix, "mooncake": mooncake_trace}


def build_workload(args: argparse.Namespace, seed: int, warmup: bool = False) -> list[Session]:
    if args.workload == "multi_turn":
        n = args.warmup if warmup else args.sessions
        return multi_turn_chat(seed, n, args.turns, args.rate, max_tokens=args.max_tokens, think_s=args.think_s)
    if args.workload == "shared_prefix":
        if warmup:
            return shared_prefix(seed=seed, groups=args.warmup, prompts_per_group=1, rate=args.rate)
        return shared_prefix(seed=seed, groups=args.groups, prompts_per_group=args.sessions, rate=args.rate)
    if args.workload in TRACE_WORKLOADS:  # generated traces: the warm-up is the same shape, another seed
        rows = TRACE_WORKLOADS[args.workload](seed=seed)[: args.warmup if warmup else args.sessions]
        return trace_sessions(rows, args.block_tokens, args.speed, args.max_tokens)
    if not args.trace:
        raise SystemExit("--workload mooncake needs --trace FILE")
    offset = args.offset + (0 if warmup else args.warmup)  # warm-up rows come just before the measured ones
    rows = args.warmup if warmup else args.sessions
    return mooncake_trace(args.trace, args.block_tokens, args.speed, rows, offset, args.max_tokens)


class StepPrompts:
    """Prompts of ``short`` tokens before ``base_s`` and ``long`` ones after (±10%; growing linearly over
    ``ramp_s`` first), for sessions created at time ``t``. Token ids are random, so no request reuses
    another's prefix: only KV demand changes."""

    def __init__(self, seed: int, args: argparse.Namespace, vocab: int = 49152) -> None:
        self.rng, self.args, self.vocab = random.Random(seed), args, vocab
        self.sessions: list[Session] = []

    def __call__(self, t: float) -> Session | None:
        a = self.args
        if t >= a.base_s + a.step_s:
            return None
        grown = min(1.0, (t - a.base_s) / a.ramp_s) if a.ramp_s else 1.0  # share of the way to long
        n = a.short if t < a.base_s else round(a.short + (a.long - a.short) * grown)
        n = self.rng.randint(int(0.9 * n), int(1.1 * n))
        ids = [self.rng.randrange(1000, self.vocab - 1) for _ in range(n)]
        session = Session(
            f"s{len(self.sessions)}",
            t,
            [Step(token_ids=ids, max_tokens=a.max_tokens)],
            chat=False,
            labels={"phase": "step" if t >= a.base_s else "base"},
        )
        self.sessions.append(session)
        return session


def step_workload(seed: int, args: argparse.Namespace) -> list[Session]:
    """Open loop: Poisson arrivals at ``args.rate`` over the base and the step."""
    prompts, rng = StepPrompts(seed, args), random.Random(seed + 1)
    t = rng.expovariate(args.rate)
    while prompts(t) is not None:
        t += rng.expovariate(args.rate)
    return prompts.sessions
