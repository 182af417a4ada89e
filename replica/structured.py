"""Structured output: grammar-constrained decoding of JSON (``response_format``) with xgrammar.

A request with ``json_schema`` gets a grammar matcher compiled from it (compiled grammars are cached by
the compiler, so a schema used again costs nothing). In each step's device work the matchers of the rows
that have one fill a token bitmask, one ``apply_token_bitmask_inplace`` masks those rows' logits, and after
sampling each matcher accepts its row's token. Matchers advance where the tokens are sampled, in device
order, so the overlapped host loop never needs them. Every sequence of a forked request has its own.

xgrammar was chosen over llguidance and outlines-core because vLLM and SGLang default to it, it ships CPU
and CUDA mask kernels for torch tensors, and its compiler caches grammars by schema.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvmesh.core.errors import InvalidRequest


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer and vocabulary; built on first use (xgrammar loads lazily)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._args = tokenizer, vocab_size, stop_token_ids
        self._compiler = None
        self._lock = threading.Lock()

    def matcher(self, schema: str):
        """A fresh matcher for ``schema`` (JSON text); 400 naming ``response_format`` if it cannot compile."""
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                tokenizer, vocab_size, stops = self._args
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as exc:  # xgrammar raises its own types (and RuntimeError) for unsupported schemas
            message = f"response_format: the JSON schema cannot be compiled: {exc}"
            raise InvalidRequest(message, "response_format") from exc
        return xgr.GrammarMatcher(compiled)


@dataclass
class GrammarRows:
    """The rows of one step that decode under a grammar, and their matchers (in row order)."""

    rows: list[int]
    matchers: list

    def mask(self, logits: torch.Tensor) -> None:
        """Forbid, in place, every token the rows' grammars do not allow next. A grammar already complete
        allows only its stop tokens (the row's request has usually stopped on one; with ``ignore_eos`` it
        goes on, and stays valid JSON followed by stop tokens)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        for row, matcher in zip(self.rows, self.matchers, strict=True):
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                continue
            bitmask[row] = 0
            for token in matcher.stop_token_ids:
                bit = 1 << (token % 32)
                bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=logits.shape[1], indices=self.rows
        )

    def accept(self, tokens: torch.Tensor) -> dict[int, Exception]:
        """Advance each matcher by its row's sampled token; rows whose token the grammar refused (it cannot,
        once masked) fail alone."""
        failures: dict[int, Exception] = {}
        picked = tokens[torch.tensor(self.rows, device=tokens.device)].tolist()
        for row, matcher, token in zip(self.rows, self.matchers, picked, strict=True):
            if not matcher.is_terminated() and not matcher.accept_token(token):
                failures[row] = RuntimeError(f"token {token} breaks the response_format grammar")
        return failures
