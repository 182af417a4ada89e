"""Incremental detokenization with stop strings, for streaming.

Decoding token by token is delegated to ``tokenizers``' ``DecodeStream`` (it buffers partial UTF-8
sequences and byte-fallback tokens correctly). On top of it we keep the full text, stop at the earliest
stop string, and hold back the last ``len(longest stop) - 1`` characters from the stream so a client
never sees the beginning of a stop string that is later cut off.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop or []
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0
        self.text = ""

    def fresh(self) -> IncrementalDetokenizer:
        """A new detokenizer with the same settings, for another sequence of the same request."""
        return IncrementalDetokenizer(self._tokenizer, self._skip_special_tokens, self._stop, self._include_stop)

    def push(self, token_id: int) -> bool:
        """Append one generated token; True when the text now ends at a stop string."""
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return False
        search_from = len(self.text) - self._holdback
        self.text += chunk
        if not self._stop:
            return False
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, max(0, search_from))) >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        self.text = self.text[: idx + (len(stop) if self._include_stop else 0)]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; withholds a possible stop-string prefix until the request finishes."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
