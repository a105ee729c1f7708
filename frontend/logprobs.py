"""Engine logprobs (``TokenLogprob``) in the two OpenAI formats.

* Completions (legacy): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict
  token -> logprob per position, with the chosen token added when it is not among the top ones, as
  vLLM does) and ``text_offset`` (each token's character offset in the choice's text, the running
  sum of token lengths). With ``echo`` the prompt's tokens come first; the first prompt token has no
  logprob (``None``), the model never predicted it.
* Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
* vLLM's ``prompt_logprobs``: one entry per prompt token, ``null`` for the first, else a dict
  token id -> ``{"logprob", "rank", "decoded_token"}`` holding the prompt token and the top
  alternatives. ``rank`` (1 = most likely) is known for the top tokens and for a prompt token that
  is among them or at least as likely as one of them; otherwise it is ``null`` (the engine reports
  the top-N, not every token's rank).
"""

from __future__ import annotations

from engine_core.protocol import TokenLogprob

from .openai_types import (ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob,
                           PromptLogprobs)
from .tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # -inf is not JSON


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def chosen_rank(entry: TokenLogprob) -> int | None:
    """The rank of ``entry.token_id`` among all tokens (1 = most likely), where the top list shows it:
    the token is in it, or at least as likely as its last entry; None beyond the list."""
    if entry.token_id in entry.top_ids:
        return entry.top_ids.index(entry.token_id) + 1
    if entry.top_logprobs and entry.logprob >= entry.top_logprobs[-1]:
        return 1 + sum(1 for lp in entry.top_logprobs if lp > entry.logprob)
    return None


def ranked(entry: TokenLogprob, top_n: int) -> list[tuple[int, float, int | None]]:
    """(token id, logprob, rank) of the chosen token first, then of the top ``top_n`` others."""
    out = [(entry.token_id, entry.logprob, chosen_rank(entry))]
    for rank, (token_id, logprob) in enumerate(zip(entry.top_ids[:top_n], entry.top_logprobs[:top_n]), 1):
        if token_id != entry.token_id:
            out.append((token_id, logprob, rank))
    return out


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_string(token_id)

    def token_bytes(self, token_id: int) -> list[int] | None:
        return None if self.tokenizer is None else list(self.tokenizer.token_bytes(token_id))

    def _text_length(self, token_id: int, token: str) -> int:
        """How far a token moves ``text_offset``: special tokens (bos, eos) are not in the text."""
        if self.tokenizer is not None and self.tokenizer.is_special(token_id):
            return 0
        return len(token)

    # ------------------------------------------------------------------ completions
    def _top_dict(self, entry: TokenLogprob, top_n: int | None = None) -> dict[str, float]:
        top = {self.token(t): _finite(lp) for t, lp in zip(entry.top_ids[:top_n], entry.top_logprobs[:top_n])}
        top.setdefault(self.token(entry.token_id), _finite(entry.logprob))
        return top

    def completion(self, entries: list[TokenLogprob], start_offset: int = 0,
                   prompt_ids: list[int] | None = None,
                   prompt_logprobs: list[TokenLogprob] | None = None,
                   prompt_top_n: int | None = None) -> tuple[CompletionLogprobs, int]:
        """The logprobs of ``entries`` (after the echoed prompt's, when ``prompt_ids`` is given, with
        at most ``prompt_top_n`` alternatives each); returns them and the text offset after the last
        token."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        if prompt_ids is not None:
            by_position = prompt_logprobs or []
            for i, token_id in enumerate(prompt_ids):
                tokens.append(self.token(token_id))
                entry = by_position[i - 1] if 0 < i <= len(by_position) else None
                if entry is None:  # the first token (nothing predicts it), or none were computed
                    token_logprobs.append(None)
                    top_logprobs.append(None)
                else:
                    token_logprobs.append(_finite(entry.logprob))
                    top_logprobs.append(self._top_dict(entry, prompt_top_n))
        for entry in entries:
            tokens.append(self.token(entry.token_id))
            token_logprobs.append(_finite(entry.logprob))
            top_logprobs.append(self._top_dict(entry))
        offsets = []
        offset = start_offset
        ids = [*(prompt_ids or ()), *(e.token_id for e in entries)]
        for token_id, token in zip(ids, tokens):
            offsets.append(offset)
            offset += self._text_length(token_id, token)
        return CompletionLogprobs(offsets, token_logprobs, tokens, top_logprobs), offset

    # ------------------------------------------------------------------ vLLM's prompt_logprobs
    def prompt_logprobs(self, entries: list[TokenLogprob], top_n: int) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs`` from the engine's entries (positions 1..P-1) and ``top_n``."""
        out: PromptLogprobs = [None]
        for entry in entries:
            out.append({str(token_id): PromptLogprob(_finite(logprob), rank, self.token(token_id))
                        for token_id, logprob, rank in ranked(entry, top_n)})
        return out

    # ------------------------------------------------------------------ chat
    def chat(self, entries: list[TokenLogprob], top_n: int) -> ChatLogprobs:
        content = []
        for entry in entries:
            top = [ChatTopLogprob(self.token(t), _finite(lp), self.token_bytes(t))
                   for t, lp in zip(entry.top_ids[:top_n], entry.top_logprobs[:top_n])]
            content.append(ChatTokenLogprob(self.token(entry.token_id), _finite(entry.logprob),
                                            self.token_bytes(entry.token_id), top))
        return ChatLogprobs(content)
