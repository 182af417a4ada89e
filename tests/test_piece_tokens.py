"""A rendered chat tokenized piece by piece between added tokens, its long pieces remembered
(``cluster/ingress/piece_tokens.py``): the ids must be exactly the whole text's, turn after turn."""

from __future__ import annotations

import random

import pytest

from kvmesh.cluster.ingress.piece_tokens import MIN_PIECE_CHARS, PieceTokens
from kvmesh.core.model_files import load_tokenizer, render_chat

WORDS = ["river", "", "mountain\tcafé", "東京", "naïve", ",.;!?", "42", "\n\n", "code()", "{x:", "<|im_start|>", "🚀"]


@pytest.fixture
def tokenizer(smollm_dir):
    return load_tokenizer(smollm_dir)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + rng.choice(["", " ", "\n", "  "])


def test_a_conversations_ids_are_the_whole_texts_and_its_history_is_tokenized_once(tokenizer):
    """Eight conversations of six turns (unicode, odd whitespace at piece edges, a special token typed by a
    user): every turn's ids equal the tokenizer's for the whole rendered chat; from the second turn on the
    history's long pieces come from memory."""
    pieces = PieceTokens.of(tokenizer)
    assert pieces is not None
    rng = random.Random(3)
    for _ in range(8):
        messages = [{"role": "system", "content": "You answer briefly. " * 20 + _text(rng, 60)}]
        for turn in range(6):
            messages.append({"role": "user", "content": _text(rng, rng.choice([3, 80, 300]))})
            text = render_chat(tokenizer, messages, None)
            hits = pieces.hits
            assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
            if turn:
                assert pieces.hits > hits  # the system prompt at least
            messages.append({"role": "assistant", "content": _text(rng, rng.choice([5, 120]))})


def test_remembered_pieces_stay_within_their_token_bound(tokenizer):
    pieces = PieceTokens.of(tokenizer)
    pieces.max_tokens = 2000
    rng = random.Random(5)
    for _ in range(40):
        text = "<|im_start|>user\n" + _text(rng, 200) + "<|im_end|>\n"
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
        assert pieces.tokens <= 2000 and sum(map(len, pieces.pieces.values())) == pieces.tokens
    assert all(len(p) >= MIN_PIECE_CHARS for p in pieces.pieces)


def test_no_piecewise_encoder_where_an_added_token_strips_whitespace(tokenizer):
    """An added token that strips the whitespace beside it joins its neighbours: pieces would differ."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    assert PieceTokens.of(tokenizer) is None
