"""Token ids of a rendered chat, tokenized piece by piece between the tokenizer's added tokens, each long piece's
ids remembered: a conversation's history is rendered again on every turn, and only its new messages are then
tokenized (multi-turn chat spent a sixth of ``kvmesh router``'s CPU re-tokenizing it; SGLang's router caches
the same way).

A fast tokenizer cuts a text at its added tokens (``<|im_start|>``, ...) before normalizing and splitting the
rest, so the pieces' ids joined are the whole text's, as long as no added token strips the whitespace around
it or is matched after normalization. ``PieceTokens.of`` checks that and builds none otherwise.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

MIN_PIECE_CHARS = 256
"""Pieces shorter than this are tokenized each time (a lookup would cost about as much)."""
MAX_CACHED_TOKENS = 1 << 20
"""The remembered pieces' tokens, at most (4 bytes each): the least recently used go first."""


class PieceTokens:
    """``encode(text)``: the ids of ``text`` without the tokenizer's own special tokens around it."""

    def __init__(self, backend, added: dict[str, int], max_tokens: int = MAX_CACHED_TOKENS) -> None:
        self.backend = backend
        self.added = added
        self.split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self.max_tokens = max_tokens
        self.pieces: OrderedDict[str, array] = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = 0
        self.lock = threading.Lock()
        """Long texts are tokenized in worker threads."""

    @classmethod
    def of(cls, tokenizer) -> PieceTokens | None:
        """The piecewise encoder of a Hugging Face fast ``tokenizer``; None where piecewise ids could differ
        from the whole text's (a slow tokenizer, no added tokens, an added token that strips or is normalized)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        tokens = getattr(tokenizer, "added_tokens_decoder", None) or {}
        if backend is None or not tokens:
            return None
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens.values()):
            return None
        return cls(backend, {t.content: i for i, t in tokens.items()})

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(self.split.split(text)):
            if i % 2:
                out.append(self.added[piece])
            elif len(piece) < MIN_PIECE_CHARS:
                out += self.backend.encode(piece, add_special_tokens=False).ids if piece else ()
            else:
                out += self._long(piece)
        return out

    def _long(self, piece: str) -> array:
        with self.lock:
            ids = self.pieces.get(piece)
            if ids is not None:
                self.hits += 1
                self.pieces.move_to_end(piece)
                return ids
            self.misses += 1
        ids = array("i", self.backend.encode(piece, add_special_tokens=False).ids)
        with self.lock:
            if piece not in self.pieces:
                self.pieces[piece] = ids
                self.tokens += len(ids)
            while self.tokens > self.max_tokens:
                self.tokens -= len(self.pieces.popitem(last=False)[1])
        return ids
