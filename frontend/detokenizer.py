"""Incremental detokenization: the text of a growing token sequence, as deltas that never split a
character.

The text a sequence of output tokens stands for is defined by a sliding *window*: each step decodes
the tokens of the previous emission (the window) plus the tokens that have arrived since
(``pending``), and emits what that text adds to the window's own text. Decoding the neighbour
keeps tokenizer-dependent joins right (a leading space, merges) without decoding the whole
sequence each time. Byte-level tokens can end in the middle of a UTF-8 character (decoded as
U+FFFD): such text is held back until following tokens complete it, and ``flush`` releases what is
left at the end, even an incomplete character. The last few prompt tokens seed the window, so the
first output token is decoded in context; a context whose own text ends in an incomplete character
is not used (it would make the first delta depend on how the prompt was cut).

The fast path is ``tokenizers.decoders.DecodeStream`` (what vLLM uses): the same window algorithm
in Rust, one call per step instead of two Python ``decode`` calls and list slices. It gives the
same text; where it cannot continue (its "Invalid prefix encountered" error: a window whose text
is not a prefix of the next one, which some decoders produce) the detokenizer carries on in
Python from the same window, so the text stays the same (tests/test_detokenizer.py proves
both on random token sequences).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:  # tokenizers >= 0.22: DecodeStream with a prefilled context (``ids``)
    from tokenizers.decoders import DecodeStream

    DecodeStream(ids=[], skip_special_tokens=True)
except (ImportError, TypeError):  # pragma: no cover - older tokenizers: the Python path only
    DecodeStream = None

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens that seed the window
INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error (a plain Exception) when it cannot go on


class IncrementalDetokenizer:
    def __init__(self, tokenizer: "Tokenizer", context_ids=(), skip_special_tokens: bool = True, *,
                 use_decode_stream: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        window = list(context_ids[-CONTEXT_TOKENS:])
        if window and self._decode(window).endswith(REPLACEMENT_CHAR):
            window = []
        self._window = window  # tokens of the last emission (or the context): their text is out
        self._pending: list[int] = []  # tokens since then whose text is not out yet
        self._stream = None
        if use_decode_stream and DecodeStream is not None:
            self._stream = DecodeStream(ids=window, skip_special_tokens=skip_special_tokens)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text ("" while a character is incomplete)."""
        if not new_ids:
            return ""
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.hf, list(new_ids))
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception here
                if not str(exc).startswith(INVALID_PREFIX):
                    raise
                self._stream = None  # its state is spoilt; ours is not: go on in Python
            else:
                if text is None:
                    self._pending.extend(new_ids)
                    return ""
                self._window = self._pending + list(new_ids)
                self._pending = []
                return text
        return self._python_step(new_ids)

    def _python_step(self, new_ids: list[int]) -> str:
        self._pending.extend(new_ids)
        prefix_text = self._decode(self._window)
        text = self._decode(self._window + self._pending)
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still incomplete
        self._window, self._pending = self._pending, []
        return text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        if not self._pending:
            return ""
        prefix_text = self._decode(self._window)
        text = self._decode(self._window + self._pending)
        self._window, self._pending = self._pending, []
        self._stream = None  # the sequence is over
        return text[len(prefix_text):]
