"""The incremental detokenizer gives the text of the whole decode, through ``DecodeStream`` and
through the Python window path alike, on random token sequences (multi-byte characters cut at
every byte, special tokens, arbitrary arrival chunks)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend import detokenizer as detok_module
from frontend.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.skipif(detok_module.DecodeStream is None,
                                reason="this tokenizers version has no DecodeStream with a context")

# Text whose byte-level tokens split characters of 2, 3 and 4 bytes.
MULTIBYTE = "Grüße, naïve café — 你好世界 🦊🎉 Ωmega ünïcödé ∑∫ 𝄞"


@pytest.fixture(scope="module")
def token_pool(tokenizer) -> list[int]:
    """Tokens to draw from: the pieces of multi-byte text (many are partial characters), every
    special token, and the whole vocabulary for the rest (drawn by index below)."""
    pieces = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    single_bytes = [tokenizer.hf.token_to_id(c) for c in "ÃĤĥæçèéð"]  # lone UTF-8 lead/continuation bytes
    specials = sorted(tokenizer._special_ids)
    return sorted(set(pieces + [t for t in single_bytes if t is not None] + specials))


def stream_text(tokenizer, context, output, chunks, skip_special_tokens, use_decode_stream) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, context, skip_special_tokens, use_decode_stream=use_decode_stream)
    assert detok.uses_decode_stream == use_decode_stream
    pieces, i, c = [], 0, 0
    while i < len(output):
        k = chunks[c % len(chunks)]
        pieces.append(detok.add(output[i:i + k]))
        i, c = i + k, c + 1
    pieces.append(detok.flush())
    return "".join(pieces), pieces


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_same_text_as_the_whole_decode(tokenizer, token_pool, data):
    vocab = tokenizer.vocab_size
    token = st.one_of(st.sampled_from(token_pool), st.integers(0, vocab - 1))
    context = data.draw(st.lists(token, max_size=8), "context")
    output = data.draw(st.lists(token, max_size=40), "output")
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), "chunks")
    skip = data.draw(st.booleans(), "skip_special_tokens")

    fast, fast_pieces = stream_text(tokenizer, context, output, chunks, skip, use_decode_stream=True)
    slow, slow_pieces = stream_text(tokenizer, context, output, chunks, skip, use_decode_stream=False)
    assert fast_pieces == slow_pieces  # the same deltas at the same steps, not only the same total
    whole = tokenizer.hf.decode(output, skip_special_tokens=skip)
    assert fast == whole
    # held back while incomplete: only the final flush may end in half a character
    assert not any(p.endswith("\ufffd") for p in fast_pieces[:-1])


def test_multibyte_text_streams_one_token_at_a_time(tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    context = tokenizer.encode("Prompt:", add_special_tokens=True)
    text, pieces = stream_text(tokenizer, context, ids, [1], True, use_decode_stream=True)
    assert text == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)  # never half a character on the way
    assert sum(1 for p in pieces if p == "") > 0  # some tokens were partial characters, held back


def test_context_ending_mid_character_is_not_used(tokenizer):
    ids = tokenizer.encode("你好", add_special_tokens=False)
    assert tokenizer.hf.decode(ids[:1]).endswith("\ufffd")
    # the prompt ends in the middle of a character; the output alone decodes as itself
    text, _ = stream_text(tokenizer, ids[:1], ids[1:], [1], True, use_decode_stream=True)
    assert text == tokenizer.hf.decode(ids[1:])


def test_invalid_prefix_falls_back_to_the_python_path(tokenizer, monkeypatch):
    ids = tokenizer.encode("héllo wörld, 你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], True)
    first = detok.add(ids[:3])

    class Broken:
        def step(self, *_):
            raise Exception("Invalid prefix encountered while decoding stream")

    detok._stream = Broken()
    rest = [detok.add([t]) for t in ids[3:]] + [detok.flush()]
    assert not detok.uses_decode_stream
    assert first + "".join(rest) == "héllo wörld, 你好"


def test_other_decode_stream_errors_are_not_swallowed(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], True)

    class Broken:
        def step(self, *_):
            raise Exception("something else")

    detok._stream = Broken()
    with pytest.raises(Exception, match="something else"):
        detok.add([5])
